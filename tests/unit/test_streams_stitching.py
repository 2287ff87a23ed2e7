"""The stitcher's rules on a plain table: calls of a session join one trajectory while they continue it; a
rewritten history, a cap, an end or idleness close it; re-sent calls are dropped; feedback reaches the latest
trajectory whether it comes before, during or after it."""
from __future__ import annotations

from rlstream.schemas.models import CallEvent, CallKind, Message, Turn
from rlstream.schemas.sessions import session_trajectory_id
from rlstream.streams.stitching import Stitcher, StitchRules
from rlstream.transport import metric_names as mn

RULES = StitchRules(idle_s=10.0, max_turns=3, max_bytes=1 << 20, retention_s=100.0)


def call(session: str, history: list[Message], reply: str, prompt: list[int], completion: list[int],
         **extra: object) -> CallEvent:
    return CallEvent(session_id=session, policy="p", policy_version=2, run_id="r", task="t",
                     request_messages=history, response_message=Message(role="assistant", content=reply),
                     turn=Turn(prompt_token_ids=prompt, completion_token_ids=completion,
                               completion_logprobs=[-0.1] * len(completion), policy_version=2),
                     **extra)  # type: ignore[arg-type]


def conversation() -> list[CallEvent]:
    """Three calls, each prompt extending the previous prompt + completion token for token."""
    u1, u2, u3 = (Message(role="user", content=f"q{i}") for i in range(3))
    a1, a2 = Message(role="assistant", content="a1"), Message(role="assistant", content="a2")
    return [call("s", [u1], "a1", [1, 2], [3]), call("s", [u1, a1, u2], "a2", [1, 2, 3, 4], [5]),
            call("s", [u1, a1, u2, a2, u3], "a3", [1, 2, 3, 4, 5, 6], [7])]


def test_a_continued_session_is_one_trajectory_on_end_and_a_resent_call_is_dropped() -> None:
    table: dict[str, object] = {}
    stitcher = Stitcher(table, RULES)  # type: ignore[arg-type]
    calls = conversation()
    for c in calls[:2]:
        assert not stitcher.on_call(c, 0, now=1.0).trajectories
    assert stitcher.on_call(calls[1], 0, now=1.5).counts == {mn.STREAMS_SESSION_DUPLICATE_CALLS: 1}
    out = stitcher.on_call(calls[2].model_copy(update={"end_session": True}), 0, now=2.0)
    [traj] = out.trajectories
    assert traj.trajectory_id == session_trajectory_id("s", 0) and traj.group_size == 1
    assert [t.prompt_token_ids for t in traj.turns] == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]
    assert [t.message_index for t in traj.turns] == [1, 3, 5] and traj.messages[-1].content == "a3"
    assert traj.example_id == "t" and traj.source.value == "production"


def test_rewritten_history_and_the_turn_cap_split_and_idle_closes() -> None:
    table: dict[str, object] = {}
    stitcher = Stitcher(table, RULES)  # type: ignore[arg-type]
    first, second, _ = conversation()
    stitcher.on_call(first, 0, now=1.0)
    rewritten = call("s", [Message(role="user", content="other")], "x", [9, 9], [8])
    out = stitcher.on_call(rewritten, 0, now=2.0)
    assert [t.trajectory_id for t in out.trajectories] == [session_trajectory_id("s", 0)]
    assert out.counts[mn.STREAMS_SESSION_SPLITS] == 1
    assert not stitcher.on_tick(1, now=100.0).trajectories  # another partition's tick leaves it alone
    assert not stitcher.on_tick(0, now=5.0).trajectories    # not idle yet
    idle = stitcher.on_tick(0, now=12.5)
    assert [t.trajectory_id for t in idle.trajectories] == [session_trajectory_id("s", 1)]
    capped = Stitcher({}, StitchRules(idle_s=10, max_turns=1, max_bytes=1 << 20, retention_s=1))  # type: ignore[arg-type]
    capped.on_call(first, 0, now=1.0)
    assert capped.on_call(second, 0, now=1.0).counts[mn.STREAMS_SESSION_SPLITS_LONG] == 1


def test_feedback_before_during_and_after_the_trajectory() -> None:
    table: dict[str, object] = {}
    stitcher = Stitcher(table, RULES)  # type: ignore[arg-type]
    early = CallEvent(session_id="s", kind=CallKind.feedback, reward=0.25, feedback_id="f1")
    stitcher.on_call(early, 0, now=1000.0)
    assert not stitcher.on_tick(0, now=1050.0).trajectories and "s" in table  # kept within the retention
    first = conversation()[0]
    stitcher.on_call(first, 0, now=1051.0)
    [traj] = stitcher.on_call(CallEvent(session_id="s", kind=CallKind.end), 0, now=1052.0).trajectories
    assert traj.reward == 0.25
    late = stitcher.on_call(CallEvent(session_id="s", kind=CallKind.feedback, reward=1.0, feedback_id="f1",
                                      run_id="r"), 0, now=1053.0)
    [reward] = late.rewards
    assert (reward.trajectory_id, reward.reward, reward.feedback_id) == (traj.trajectory_id, 1.0, "f1")
    assert stitcher.on_tick(0, now=1300.0).trajectories == [] and "s" not in table  # forgotten after retention


def test_a_stitched_trajectory_carries_the_tool_schemas_its_calls_offered() -> None:
    # the export's tools column comes from this metadata; a call without tools (or with garbage) adds none
    import json

    from rlstream.schemas.models import TOOLS_METADATA_KEY

    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    clock = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    first, second, third = conversation()
    calls = [first.model_copy(update={"tools": json.dumps([weather])}),
             second.model_copy(update={"tools": json.dumps([clock, weather])}),
             third.model_copy(update={"tools": "not json", "end_session": True})]
    stitcher = Stitcher({}, RULES)  # type: ignore[arg-type]
    for c in calls[:2]:
        stitcher.on_call(c, 0, now=1.0)
    [traj] = stitcher.on_call(calls[2], 0, now=2.0).trajectories
    assert json.loads(traj.metadata[TOOLS_METADATA_KEY]) == [weather, clock]
    stitcher = Stitcher({}, RULES)  # type: ignore[arg-type]
    for c in conversation()[:2]:
        stitcher.on_call(c, 0, now=1.0)
    [bare] = stitcher.on_call(conversation()[2].model_copy(update={"end_session": True}), 0, now=2.0).trajectories
    assert TOOLS_METADATA_KEY not in bare.metadata
