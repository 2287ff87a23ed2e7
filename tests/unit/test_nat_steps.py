"""NAT intermediate steps -> rlstream conversation and turns; NAT trajectories into the epoch engine's groups and
its per-trajectory rejection."""
from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from nat.data_models.finetuning import EpisodeItem, EpisodeItemRole, Trajectory, TrajectoryCollection

from rlstream.finetune import Rejection, checked_groups, trajectory_problem
from rlstream.nat.adapter import RlstreamTrainerAdapter, to_event
from rlstream.nat.builder import CONVERSATION_KEY
from rlstream.nat.config import RlstreamTrainerAdapterConfig
from rlstream.nat.steps import conversation_from_steps
from rlstream.schemas.config import load_config

CALL = {"name": "pick_letter", "args": {"letter": "c"}, "id": "call-1", "type": "tool_call"}


def step(kind: str, uuid: str, model: str = "policy", function: str = "<workflow>", **data: Any) -> dict:
    """One step as NAT's evaluation hands it over (dumped: messages are dicts with a "type")."""
    return {"payload": {"event_type": kind, "UUID": uuid, "name": model, "data": data},
            "function_ancestry": {"function_name": function}}


def llm_call(uuid: str, prompt: list, answer: AIMessage, model: str = "policy", function: str = "<workflow>",
             keep_tool_calls: bool = False) -> list[dict]:
    dumped = answer.model_dump()
    if not keep_tool_calls:  # NAT's serialised LLM_END steps lose the AIMessage's tool calls
        dumped.pop("tool_calls", None)
    return [step("LLM_START", uuid, model, function, input=[m.model_dump() for m in prompt]),
            step("LLM_END", uuid, model, function, payload={"message": dumped}, output=str(answer.content))]


def tool_exchange(model: str = "policy") -> list[dict]:
    user = HumanMessage(content="Repeat the letter c.")
    call = AIMessage(content="", tool_calls=[CALL])
    result = ToolMessage(content=json.dumps({"picked": "c"}), tool_call_id="call-1")
    return [*llm_call("u1", [user], call, model),
            step("TOOL_END", "t1", "pick_letter", output="c"),
            *llm_call("u2", [user, call, result], AIMessage(content="ccc"), model)]


def test_a_tool_calling_run_is_one_conversation_with_its_tool_calls() -> None:
    conv = conversation_from_steps(tool_exchange(), ["<workflow>"], None)
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    call = conv.messages[1].tool_calls[0]  # recovered from the next call's input
    assert call.name == "pick_letter" and json.loads(call.arguments) == {"letter": "c"} and call.id == "call-1"
    assert conv.messages[2].tool_call_id == "call-1" and conv.messages[3].content == "ccc"
    assert [t.message_index for t in conv.turns] == [1, 3] and conv.replaced_turns == 0
    assert {t.model for t in conv.turns} == {"policy"} and {t.function for t in conv.turns} == {"<workflow>"}


def test_target_model_and_functions_select_the_turns() -> None:
    judge = llm_call("j1", [HumanMessage(content="grade it")], AIMessage(content="10/10"), model="judge")
    steps = tool_exchange() + judge
    assert len(conversation_from_steps(steps, ["<workflow>"], None).turns) == 1  # the judge's call restarted it
    only_policy = conversation_from_steps(steps, ["<workflow>"], {"policy"})
    assert [t.message_index for t in only_policy.turns] == [1, 3]
    assert conversation_from_steps(steps, ["some_tool_fn"], None).turns == []
    inner = llm_call("f1", [HumanMessage(content="hi")], AIMessage(content="yo"), function="planner")
    assert [t.function for t in conversation_from_steps(inner, ["planner"], None).turns] == ["planner"]


def test_a_call_that_rewrites_its_context_starts_again_and_is_counted() -> None:
    steps = tool_exchange() + llm_call("u3", [SystemMessage(content="summarise"), HumanMessage(content="x")],
                                       AIMessage(content="y"))
    conv = conversation_from_steps(steps, ["<workflow>"], None)
    assert [m.role for m in conv.messages] == ["system", "user", "assistant"]
    assert conv.replaced_turns == 2 and [t.message_index for t in conv.turns] == [2]


def vllm_exchange() -> list[tuple[dict, dict]]:
    """The two chat requests of the tool exchange as ChatOpenAI sends them, and vLLM's answers with token data
    (return_token_ids, logprobs): the first answer is the tool call, with content null."""
    user = {"role": "user", "content": "Repeat the letter c."}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "pick_letter", "arguments": '{"letter":"c"}'}}]}
    result = {"role": "tool", "content": json.dumps({"picked": "c"}), "tool_call_id": "call-1"}

    def answer(message: dict, prompt_ids: list[int], ids: list[int]) -> dict:
        return {"prompt_token_ids": prompt_ids, "choices": [{"index": 0, "message": message, "token_ids": ids,
                "logprobs": {"content": [{"token": "t", "logprob": -0.25 * (i + 1)} for i in range(len(ids))]}}]}

    forced = {"tools": [{"type": "function", "function": {"name": "pick_letter"}}],
              "tool_choice": {"type": "function", "function": {"name": "pick_letter"}}}
    return [({"model": "policy", "messages": [user], **forced}, answer(call, [1, 2, 3], [7, 8])),
            ({"model": "policy", "messages": [user, call, result]},
             answer({"role": "assistant", "content": "ccc"}, [1, 2, 3, 7, 8, 4, 5], [9, 9, 9, 2]))]


def test_turns_take_the_token_data_of_their_recorded_calls() -> None:
    from rlstream.nat.token_capture import CallRecorder

    recorder = CallRecorder()
    assert all(recorder.record(request, response) for request, response in vllm_exchange())
    conv = conversation_from_steps(tool_exchange(), ["<workflow>"], None, recorder.lookup)
    first, second = conv.turns
    assert (first.prompt_token_ids, first.completion_token_ids) == ([1, 2, 3], [7, 8])
    assert first.completion_logprobs is None  # a forced tool call: vLLM's logprobs are the grammar-masked ones
    assert (second.prompt_token_ids, second.completion_token_ids) == ([1, 2, 3, 7, 8, 4, 5], [9, 9, 9, 2])
    assert second.completion_logprobs == [-0.25, -0.5, -0.75, -1.0] and conv.turns_with_token_data == 2
    # the same prompt answered with another tool call (another generation) is another call
    other_pick = {**vllm_exchange()[0][1]}
    other_pick["choices"] = [{**other_pick["choices"][0], "token_ids": [7, 6], "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "call-9", "type": "function", "function": {
            "name": "pick_letter", "arguments": '{"letter": "d"}'}}]}}]
    assert recorder.record(vllm_exchange()[0][0], other_pick)
    again = conversation_from_steps(tool_exchange(), ["<workflow>"], None, recorder.lookup)
    assert again.turns[0].completion_token_ids == [7, 8]  # the "c" pick's tokens, not the "d" pick's
    # a call nobody recorded (another answer to the same prompt) keeps no token data: the learner renders it
    other = conversation_from_steps(llm_call("x", [HumanMessage(content="Repeat the letter c.")],
                                             AIMessage(content="ddd")), ["<workflow>"], None, recorder.lookup)
    assert other.turns[0].completion_token_ids is None and other.turns_with_token_data == 0


def test_a_response_without_token_data_is_not_recorded_and_the_recorder_is_bounded() -> None:
    from rlstream.nat.token_capture import CallRecorder

    recorder = CallRecorder(max_calls=1)
    request, response = vllm_exchange()[0]
    assert not recorder.record(request, {"choices": [{"message": {"role": "assistant", "content": "x"}}]})
    for req, resp in vllm_exchange():
        recorder.record(req, resp)
    assert len(recorder) == 1  # the oldest went


def test_the_builder_swaps_openai_and_gateway_llms_for_their_capturing_twins() -> None:
    from nat.llm.openai_llm import OpenAIModelConfig

    from rlstream.nat.gateway_llm import RlstreamGatewayLLMConfig
    from rlstream.nat.token_capture import TokenCaptureLLMConfig, capturing_config

    plain = OpenAIModelConfig(model_name="policy", base_url="http://vllm:8000/v1", temperature=0.7)
    twin = capturing_config(plain)
    assert isinstance(twin, TokenCaptureLLMConfig) and not twin.session_headers
    assert (twin.model_name, twin.base_url, twin.temperature) == ("policy", "http://vllm:8000/v1", 0.7)
    gateway = capturing_config(RlstreamGatewayLLMConfig(model_name="policy", base_url="http://gw/v1", task="qa"))
    assert gateway.session_headers and gateway.task == "qa"
    assert capturing_config(twin) is twin  # anything else is left alone


def good(example: str, reward: float) -> Trajectory:
    conv = conversation_from_steps(tool_exchange(), ["<workflow>"], None)
    return Trajectory(episode=[EpisodeItem(role=EpisodeItemRole.USER, content="q")], reward=reward,
                      metadata={"id": example, CONVERSATION_KEY: {
                          "messages": [m.model_dump(mode="json") for m in conv.messages],
                          "turns": [t.model_dump(mode="json") for t in conv.turns]}})


def test_one_bad_trajectory_is_rejected_and_its_group_still_trains() -> None:
    adapter = RlstreamTrainerAdapter(RlstreamTrainerAdapterConfig())
    adapter.cfg = load_config(None, [("run_id", "r"), ("policy", "p")])
    starts_with_assistant = Trajectory(episode=[EpisodeItem(role=EpisodeItemRole.ASSISTANT, content="hi",
                                                            logprobs=[]),
                                                EpisodeItem(role=EpisodeItemRole.USER, content="q")],
                                       reward=1.0, metadata={"id": "ex1"})
    collection = TrajectoryCollection(run_id="epoch0", trajectories=[
        [good("ex1", 0.2), starts_with_assistant, good("ex1", 0.9)],
        [good("ex2", float("nan")), good("ex2", 0.5)],  # one NaN: the other alone is below min_group_size 2
    ])
    candidates = adapter.candidate_groups(collection)
    assert [c.group_id for c in candidates] == ["r:epoch0:ex1", "r:epoch0:ex2"]
    rejected: list[Rejection] = []
    groups, dropped = checked_groups(candidates, adapter.cfg.streams.min_group_size, rejected)
    assert len(groups) == 1
    events = groups[0]
    assert [e.group_size for e in events] == [2, 2] and [e.generation_index for e in events] == [0, 1]
    assert [e.reward for e in events] == [0.2, 0.9] and {e.group_id for e in events} == {"r:epoch0:ex1"}
    assert events[0].messages[1].tool_calls[0].name == "pick_letter"
    reasons = [(r.group_id, r.reason) for r in rejected]
    assert ("r:epoch0:ex1", "episode starts with assistant, not user or system") in reasons
    assert ("r:epoch0:ex2", "non-finite reward nan") in reasons
    assert any(g == "r:epoch0:ex2" and "fewer than streams.min_group_size" in r for g, r in reasons)
    # a dead letter carries the NAT trajectory itself
    assert all(json.loads(member.raw)["metadata"]["id"] in ("ex1", "ex2") for _, member, _ in dropped)


def test_an_episode_without_rlstream_conversation_keeps_its_tool_calls() -> None:
    """A trajectory from another NAT builder: its episode's messages, tool calls and tool_call_id from the items'
    metadata, one on-policy turn per assistant item."""
    call = {"id": "c1", "name": "f", "arguments": "{}"}
    episode = [EpisodeItem(role=EpisodeItemRole.USER, content="hi"),
               EpisodeItem(role=EpisodeItemRole.ASSISTANT, content="", logprobs=[-0.1, -0.2],
                           metadata={"tool_calls": [call]}),
               EpisodeItem(role=EpisodeItemRole.TOOL, content="42", metadata={"tool_call_id": "c1"}),
               EpisodeItem(role=EpisodeItemRole.ASSISTANT, content="done", logprobs=[])]
    foreign = Trajectory(episode=episode, reward=0.5, metadata={"policy_version": 3, "run_id": "nat-run"})
    event = to_event(foreign, run_id="r", policy="p", group_id="g", example_id="x", size=2, index=1)
    assert [m.role for m in event.messages] == ["user", "assistant", "tool", "assistant"]
    assert event.messages[1].tool_calls[0].name == "f" and event.messages[2].tool_call_id == "c1"
    assert [turn.message_index for turn in event.turns] == [1, 3] and event.reward == 0.5
    assert event.turns[0].completion_token_ids is None  # no token data: the learner renders it, on-policy
    assert event.policy_version == 3 and event.metadata["nat_run_id"] == "nat-run" and event.generation_index == 1
    assert trajectory_problem(event) is None


async def test_one_chat_model_builder_serves_the_gateway_and_the_capturing_llms() -> None:
    """Both LLM types build LangChain's ChatOpenAI the same way; only their httpx hooks and options differ."""
    from rlstream.nat.gateway_llm import RlstreamGatewayLLMConfig, openai_chat_model, session_hook
    from rlstream.nat.token_capture import _record_response

    config = RlstreamGatewayLLMConfig(model_name="toy", base_url="http://127.0.0.1:9/v1", temperature=0.5,
                                      task="letters")
    async with openai_chat_model(config, request_hooks=[session_hook(config.task)]) as gateway_model:
        hooks = gateway_model.http_async_client.event_hooks
        assert len(hooks["request"]) == 1 and hooks["response"] == []
        assert gateway_model.model_name == "toy" and gateway_model.temperature == 0.5 and not gateway_model.logprobs
    async with openai_chat_model(config, response_hooks=[_record_response], logprobs=True,
                                 extra_body={"return_token_ids": True}) as capturing_model:
        hooks = capturing_model.http_async_client.event_hooks
        assert hooks["request"] == [] and hooks["response"] == [_record_response]
        assert capturing_model.logprobs and capturing_model.extra_body == {"return_token_ids": True}
    assert gateway_model.http_async_client.is_closed and capturing_model.http_async_client.is_closed
