"""An open session survives a SIGKILL of the streams worker: the first calls of several sessions are stitched and
committed (their session state in the ``sessions`` changelog, their progress markers with it), the worker is killed,
a new one starts, the remaining calls and the ends follow; every session comes out as exactly one trajectory with
all its turns in order. The memory store is used, so nothing of the killed worker survives but the changelogs.

Negative control: the restarted worker must start every ``calls`` partition past the calls sent before the kill
(at its recovered progress marker), so those calls are not read again and their turns can only come from the
recovered session table. The same check applied to what the stitcher makes of the remaining calls alone (an empty
session table: the worker's state and changelog lost) must fail: sessions missing their first turns, a session whose
every call came before the kill missing altogether. That is the failure the changelog guards against; a second
worker life with the changelog wiped would show the same for another ~15 s."""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import CallEvent, CallKind, TrajectoryEvent
from rlstream.schemas.sessions import session_trajectory_id
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.streams.stitching import Stitcher, StitchRules
from tests.support.streams_helpers import (CODEC, Worker, last_resync, publish, read_all, wait_for_count,
                                          wait_for_processing)
from tests.unit.test_streams_stitching import conversation

SESSIONS = 6
SETTINGS = {"streams.store": "memory", "streams.session_idle_s": 300}  # sessions close only on their end record


def _sessions(cfg: RlstreamConfig) -> dict[str, tuple[list[CallEvent], int]]:
    """Per session id: its three calls and how many of them go out before the kill (1, 2 or all 3)."""
    sessions = {}
    for i in range(SESSIONS):
        session = f"sess-{i}"
        calls = [c.model_copy(update={"session_id": session, "run_id": cfg.run_id}) for c in conversation()]
        sessions[session] = (calls, 1 + i % 3)
    return sessions


def _problems(trajectories: list[TrajectoryEvent], sessions: dict[str, tuple[list[CallEvent], int]]) -> list[str]:
    """Every session exactly once, as its first trajectory, holding every call's turn in order."""
    problems = []
    seen = Counter(t.metadata.get("session_id") for t in trajectories)
    if twice := sorted(s for s, n in seen.items() if n > 1):
        problems.append(f"sessions stitched more than once: {twice}")
    if missing := sorted(set(sessions) - set(seen)):
        problems.append(f"sessions never stitched: {missing}")
    if extra := sorted(str(s) for s in set(seen) - set(sessions)):
        problems.append(f"trajectories of no session sent: {extra}")
    for trajectory in trajectories:
        session = trajectory.metadata.get("session_id", "")
        if session not in sessions:
            continue
        calls, _ = sessions[session]
        want = [(c.turn.prompt_token_ids, c.turn.completion_token_ids) for c in calls if c.turn]
        got = [(t.prompt_token_ids, t.completion_token_ids) for t in trajectory.turns]
        if got != want:
            problems.append(f"{session}: turns {got}, wanted {want}")
        if trajectory.trajectory_id != session_trajectory_id(session, 0):
            problems.append(f"{session}: trajectory {trajectory.trajectory_id} is not the session's first")
    return problems


def test_an_open_session_survives_a_worker_sigkill_through_its_changelog(rl_config: RlstreamConfig,
                                                                         tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    sessions = _sessions(rl_config)

    def record(c: CallEvent) -> tuple[str, bytes, bytes]:
        return names.calls, c.session_id.encode(), CODEC.encode(c)

    before = [record(c) for calls, k in sessions.values() for c in calls[:k]]
    after = [record(c) for calls, k in sessions.values() for c in calls[k:]]
    after += [record(CallEvent(session_id=s, kind=CallKind.end, run_id=rl_config.run_id)) for s in sessions]
    worker = Worker(rl_config, "w1", tmp_path, **SETTINGS).start()
    restarted = None
    try:
        wait_for_processing(worker, tmp_path, 0)
        asyncio.run(publish(rl_config, before))
        # one sessions-changelog record per call: once all are committed, so are the calls' progress markers
        asyncio.run(wait_for_count(rl_config, f"{rl_config.streams.app_id}-sessions-changelog", len(before),
                                   timeout_s=60))
        assert asyncio.run(read_all(rl_config, names.trajectories, TrajectoryEvent, timeout_s=1, quiet_s=0.5)) == []
        sent = Counter(r.partition for r, _ in asyncio.run(read_all(rl_config, names.calls, CallEvent,
                                                                    expect=len(before), quiet_s=0.2)))
        worker.kill()
        restarted = Worker(rl_config, "w1", tmp_path, **SETTINGS).start()
        asyncio.run(publish(rl_config, after))
        got = [t for _, t in asyncio.run(read_all(rl_config, names.trajectories, TrajectoryEvent,
                                                  expect=SESSIONS, timeout_s=90, quiet_s=3))]
        assert restarted.alive(), restarted.log_tail()
    finally:
        worker.stop()
        if restarted:
            restarted.stop()

    problems = _problems(got, sessions)  # type: ignore[arg-type]
    assert not problems, f"{problems}\nrestarted worker log:\n{restarted.log_tail(60)}"
    # the restarted worker read no call sent before the kill: each calls partition started at its recovered marker
    seeks = json.loads(last_resync(tmp_path))["seeks"]
    assert {p: seeks[f"{names.calls}:{p}"] for p in sent} == {p: f"{n} (marker)" for p, n in sent.items()}, seeks
    # negative control: the remaining calls alone, stitched without the recovered session table
    s = rl_config.streams
    stitcher = Stitcher({}, StitchRules(idle_s=s.session_idle_s, max_turns=s.session_max_turns,
                                        max_bytes=s.session_max_bytes, retention_s=s.session_retention_s))
    remaining: list[CallEvent] = [CODEC.decode(value, CallEvent) for _, _, value in after]  # type: ignore[misc]
    without_state = [t for c in remaining for t in stitcher.on_call(c, 0, now=1.0).trajectories]
    control = _problems(without_state, sessions)
    assert any("never stitched" in p for p in control) and any("turns" in p for p in control), control
