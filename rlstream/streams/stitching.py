"""Sessions stitched from ``calls``: each gateway publishes a session's calls as they complete (keyed by session id,
so a session's calls meet in one partition) and this stitcher, with its state in a changelog-backed table keyed by
session id, joins them into trajectories by the rule the gateway used in memory (rlstream/schemas/sessions.py): a
call continues its session's open trajectory while its prompt extends the previous prompt + completion token for
token, or its messages extend the previous messages + reply; a rewritten history, a session at its turn or byte cap,
an explicit end or an idle session closes the trajectory, which becomes one TrajectoryEvent (source production,
group_size 1) produced in the transaction of the call that closed it. Which gateway took which call, and whether a
gateway died in between, does not matter: the state lives here, and a call re-sent by a gateway is dropped by id.

The trajectory ids are derived (``session_trajectory_id(session, segment)``), so every gateway hands out the id of a
session's first trajectory without asking anyone; feedback by session id is routed through ``calls`` too and lands
on the session's latest trajectory."""
from __future__ import annotations

import json
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from rlstream.schemas.models import (TOOLS_METADATA_KEY, CallEvent, CallKind, Message, RewardEvent, TrajectoryEvent,
                                     TrajectorySource, Turn, merged_tools)
from rlstream.schemas.sessions import MESSAGES, continues, session_trajectory_id, stitched_turns
from rlstream.transport import metric_names as mn

#: Call ids of a session remembered for dropping re-sent calls (a gateway re-sends at most its last drained batch).
REMEMBERED_CALL_IDS = 256


@dataclass(frozen=True)
class StitchRules:
    """When a session's trajectory closes (streams config ``session_*``)."""

    idle_s: float
    max_turns: int
    max_bytes: int
    retention_s: float
    producer_id: str = "streams"


@dataclass
class Stitched:
    """What one ``calls`` record or tick produced: trajectories and rewards to send, figures to count."""

    trajectories: list[TrajectoryEvent] = field(default_factory=list)
    rewards: list[RewardEvent] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def call_bytes(call: CallEvent) -> int:
    """What one call holds in the session table: the size of its JSON (as the table's changelog record carries it)."""
    return len(call.model_dump_json())


@dataclass
class SessionState:
    """A session in the table: its open trajectory's calls (JSON of CallEvents), its segment number, the latest
    trajectory published, a reward waiting for its trajectory, the call ids seen."""

    partition: int
    segment: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    approx_bytes: int = 0
    last_active: float = 0.0
    closed_at: float | None = None
    published: dict[str, str] | None = None  # trajectory_id, example_id, group_id, run_id of the latest published
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    feedback_id: str | None = None
    seen: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"partition": self.partition, "segment": self.segment, "calls": self.calls,
                "approx_bytes": self.approx_bytes, "last_active": self.last_active, "closed_at": self.closed_at,
                "published": self.published, "reward": self.reward, "components": self.components,
                "feedback_id": self.feedback_id, "seen": self.seen}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "SessionState":
        return cls(**raw)

    def open_calls(self) -> list[CallEvent]:
        return [CallEvent.model_validate(c) for c in self.calls]


class Stitcher:
    """Session stitching over a table view (``DetachedValues`` of the ``sessions`` table, keyed by session id)."""

    def __init__(self, table: MutableMapping[str, Any], rules: StitchRules) -> None:
        self.table = table
        self.rules = rules

    def on_call(self, call: CallEvent, partition: int, now: float) -> Stitched:
        """Apply one ``calls`` record (a call, an end or a feedback) of the session it names."""
        out = Stitched()
        raw = self.table.get(call.session_id)
        state = SessionState.from_json(raw) if raw is not None else SessionState(partition=partition)
        state.partition = partition
        if call.call_id in state.seen:
            out.count(mn.STREAMS_SESSION_DUPLICATE_CALLS)
            return out
        state.seen = [*state.seen, call.call_id][-REMEMBERED_CALL_IDS:]
        if call.kind is CallKind.feedback:
            self._feedback(state, call, now, out)
        elif call.kind is CallKind.end:
            if state.calls:
                self._close(state, call.session_id, now, out)
            else:
                out.count(mn.STREAMS_SESSION_ENDS_UNKNOWN)
        else:
            self._add(state, call, now, out)
            if call.end_session:
                self._close(state, call.session_id, now, out)
        self.table[call.session_id] = state.to_json()
        return out

    def _add(self, state: SessionState, call: CallEvent, now: float, out: Stitched) -> None:
        if call.turn is None or call.response_message is None:
            out.count(mn.STREAMS_SESSION_CALLS_INCOMPLETE)
            return
        if state.calls:
            last = CallEvent.model_validate(state.calls[-1])
            assert last.turn is not None and last.response_message is not None
            how = continues(last.turn.prompt_token_ids, last.turn.completion_token_ids,
                            [*last.request_messages, last.response_message], call.turn.prompt_token_ids,
                            call.request_messages)
            size = call_bytes(call)
            full = len(state.calls) >= self.rules.max_turns or state.approx_bytes + size > self.rules.max_bytes
            if how is not None and not full:
                if how == MESSAGES and call.turn.prompt_token_ids is not None:
                    out.count(mn.STREAMS_SESSION_RETOKENIZED)
            else:
                out.count(mn.STREAMS_SESSION_SPLITS_LONG if how is not None else mn.STREAMS_SESSION_SPLITS)
                self._close(state, call.session_id, now, out)
        elif state.published is not None:  # the session continues after its last trajectory closed
            state.segment += 1
        state.calls = [*state.calls, call.model_dump(mode="json")]
        state.approx_bytes += call_bytes(call)
        state.last_active = now
        state.closed_at = None
        out.count(mn.STREAMS_SESSION_CALLS)

    def _close(self, state: SessionState, session_id: str, now: float, out: Stitched) -> None:
        """Publish the open trajectory (carrying a reward that came first) and start the next segment."""
        calls = state.open_calls()
        if not calls:
            return
        event = self.trajectory(session_id, state.segment, calls, state.reward, state.components)
        out.trajectories.append(event)
        out.count(mn.STREAMS_SESSION_TRAJECTORIES)
        state.published = {"trajectory_id": event.trajectory_id, "example_id": event.example_id,
                           "group_id": event.group_id, "run_id": event.run_id}
        state.calls, state.approx_bytes, state.closed_at = [], 0, now
        state.reward, state.components, state.feedback_id = None, {}, None
        state.segment += 1

    def _feedback(self, state: SessionState, call: CallEvent, now: float, out: Stitched) -> None:
        """A reward for the session: its open trajectory carries it; else its latest published trajectory gets a
        RewardEvent; else it waits for the session's first trajectory."""
        if call.reward is None:
            out.count(mn.STREAMS_SESSION_CALLS_INCOMPLETE)
            return
        if state.calls or state.published is None:
            state.reward, state.components, state.feedback_id = call.reward, dict(call.reward_components), \
                call.feedback_id
            if not state.calls:  # kept for the session's first trajectory, as long as a closed session is
                state.closed_at = now
            return
        target = state.published
        out.rewards.append(RewardEvent(trajectory_id=target["trajectory_id"], group_id=target["group_id"],
                                       example_id=target["example_id"], run_id=target["run_id"] or call.run_id,
                                       reward=call.reward, components=dict(call.reward_components),
                                       feedback_id=call.feedback_id))

    def on_tick(self, partition: int, now: float) -> Stitched:
        """Close this partition's idle sessions; forget closed ones past their retention."""
        out = Stitched()
        for session_id, raw in list(self.table.items()):
            if raw.get("partition") != partition:
                continue
            state = SessionState.from_json(raw)
            if state.calls and now - state.last_active >= self.rules.idle_s:
                self._close(state, session_id, now, out)
                out.count(mn.STREAMS_SESSIONS_IDLE_CLOSED)
                self.table[session_id] = state.to_json()
            elif not state.calls and now - (state.closed_at or state.last_active) >= self.rules.retention_s:
                del self.table[session_id]
        return out

    def trajectory(self, session_id: str, segment: int, calls: list[CallEvent], reward: float | None,
                   components: dict[str, float]) -> TrajectoryEvent:
        """The TrajectoryEvent of a session's ``segment``-th trajectory made of ``calls``."""
        first = calls[0]
        parts: list[tuple[list[Message], Message, Turn]] = [
            (c.request_messages, c.response_message, c.turn) for c in calls
            if c.response_message is not None and c.turn is not None]
        messages, turns = stitched_turns(parts)
        trajectory_id = session_trajectory_id(session_id, segment)
        meta = {"capture": "gateway", "session_id": session_id, "stitched": "streams"}
        if first.task:
            meta["task"] = first.task
        served = sorted({c.served_model for c in calls if c.served_model})
        if served:
            meta["served_models"] = ",".join(served)
        gateways = sorted({c.gateway_id for c in calls if c.gateway_id})
        if gateways:
            meta["gateways"] = ",".join(gateways)
        tools = merged_tools(_tool_schemas(c) for c in calls)
        if tools:
            meta[TOOLS_METADATA_KEY] = json.dumps(tools, sort_keys=True)
        return TrajectoryEvent(
            trajectory_id=trajectory_id, run_id=first.run_id, example_id=first.task or trajectory_id,
            group_id=trajectory_id, group_size=1, generation_index=0, policy=first.policy,
            policy_version=first.policy_version, source=TrajectorySource.production, messages=messages, turns=turns,
            reward=reward, reward_components=dict(components), metadata=meta, producer_id=self.rules.producer_id)


def _tool_schemas(call: CallEvent) -> list[dict[str, Any]]:
    """The tool schemas a call offered (none when its ``tools`` is absent or not a JSON list of objects)."""
    try:
        tools = json.loads(call.tools) if call.tools else []
    except ValueError:
        return []
    return [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
