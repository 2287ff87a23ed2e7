"""Sessions: the calls of one session form one multi-turn trajectory while each call continues the previous one:
its prompt extends the previous prompt + completion token for token (Agent Lightning's rule), or its messages extend
the previous messages + reply where the chat template re-renders a reply into other tokens (tool calls); when the
history was rewritten a new trajectory starts and the split is counted."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from rlstream.rollout.capture import RecordedCall, Recording
from rlstream.schemas.models import Message, TrajectoryEvent, TrajectorySource, new_id
from rlstream.schemas.sampling import NEUTRAL_TEMPERATURE
from rlstream.schemas.sessions import MESSAGES, TOKENS, continues


def continuation(previous: RecordedCall, prompt_ids: list[int] | None, messages: list[Message]) -> str | None:
    """How a call with ``prompt_ids`` / ``messages`` continues ``previous``, or None when it does not
    (:func:`rlstream.schemas.sessions.continues`: ``TOKENS``, ``MESSAGES`` or None). Every turn keeps the exact
    prompt and completion tokens the upstream saw and produced, so nothing is trained on tokens that were not
    sampled."""
    turn = previous.turn
    return continues(turn.prompt_token_ids, turn.completion_token_ids,
                     [*previous.request_messages, previous.response_message], prompt_ids, messages)


def extends(previous: RecordedCall, prompt_ids: list[int] | None, messages: list[Message]) -> bool:
    """True when the call continues ``previous`` (by tokens or by messages: :func:`continuation`)."""
    return continuation(previous, prompt_ids, messages) is not None


@dataclass
class Trajectory:
    """One trajectory being captured (a session's current one, or a single call's)."""

    session_id: str | None
    policy_version: int
    task: str | None = None
    trajectory_id: str = field(default_factory=new_id)
    recording: Recording = field(default_factory=Recording)
    last_active: float = field(default_factory=time.monotonic)
    closed: bool = False
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    choices_group: str | None = None  # n > 1: the group of the request's choices (one trajectory per choice)
    group_size: int = 1
    generation_index: int = 0
    approx_bytes: int = 0  # what its calls hold in memory, roughly (:func:`call_bytes`)
    tenant: str | None = None  # the caller's tenant (its share of the capture queue); None: the session's

    @property
    def example_id(self) -> str:
        """The task names the baseline key; without one the trajectory (or its request's choices) is its own
        example."""
        return self.task or self.choices_group or self.trajectory_id

    @property
    def group_id(self) -> str:
        return self.choices_group or self.trajectory_id

    def add(self, call: RecordedCall) -> None:
        self.recording.add(call)
        self.approx_bytes += call_bytes(call)
        self.last_active = time.monotonic()

    def to_event(self, *, run_id: str, policy: str, producer_id: str) -> TrajectoryEvent:
        meta: dict[str, str] = {"capture": "gateway"}
        if self.session_id:
            meta["session_id"] = self.session_id
        if self.task:
            meta["task"] = self.task
        event = self.recording.to_event(
            run_id=run_id, example_id=self.example_id, group_id=self.group_id, group_size=self.group_size,
            generation_index=self.generation_index,
            policy=policy, policy_version=self.policy_version, reward=self.reward,
            reward_components=self.reward_components, metadata=meta, source=TrajectorySource.production,
            producer_id=producer_id)
        return event.model_copy(update={"trajectory_id": self.trajectory_id})


def _utf8_len(value: object) -> int:
    return len(str(value or "").encode("utf-8", errors="replace"))


def call_bytes(call: RecordedCall) -> int:
    """Roughly the memory one recorded call holds, and at least what it adds to its session's encoded record: its
    messages' text in UTF-8 bytes (a character of non-Latin text is 2-4 of them) and its token ids and logprobs
    (8 bytes each, more than their Avro encoding takes)."""
    text = sum(_utf8_len(m.content) + _utf8_len(m.tool_calls) for m in call.request_messages)
    reply = call.response_message
    text += _utf8_len(reply.content) + _utf8_len(reply.tool_calls)
    turn = call.turn
    tokens = sum(len(ids or ()) for ids in (turn.prompt_token_ids, turn.completion_token_ids,
                                             turn.completion_logprobs))
    return text + 8 * tokens


@dataclass(frozen=True)
class KnownTrajectory:
    """What /v1/feedback needs to address a reward to a trajectory."""

    trajectory_id: str
    example_id: str
    group_id: str
    captured_at: float = 0.0  # wall clock when the gateway captured it (the correction window counts from here)


class SessionStore:
    """Open session trajectories, and the ids of recent trajectories (for feedback)."""

    def __init__(self, idle_s: float, remembered: int = 100_000, max_open: int = 1 << 62,
                 max_turns: int = 1 << 62, max_bytes: int = 1 << 62,
                 tenant_of: Callable[[str], str] = lambda session_id: "") -> None:
        self.idle_s = idle_s
        self.remembered = remembered
        self.tenant_of = tenant_of  # the tenant of a (scoped) session id
        self.max_open, self.max_turns, self.max_bytes = max_open, max_turns, max_bytes
        #: open session trajectories, least recently active first
        self.open: OrderedDict[str, Trajectory] = OrderedDict()
        self.known: dict[str, KnownTrajectory] = {}
        self.session_last: dict[str, str] = {}  # session id -> its latest trajectory id
        self._session_of: dict[str, str] = {}  # trajectory id -> its session id
        #: known trajectories no tenant has claimed yet (:meth:`claim`), oldest first, at most ``remembered``;
        #: a claimed one is bounded by its tenant's share (the gateway's ``FeedbackIndex``) and :meth:`forget`
        self._unclaimed: OrderedDict[str, None] = OrderedDict()
        self.splits = 0  # calls of a session that did not extend its open trajectory and started a new one
        self.retokenized = 0  # calls that continued by messages while their prompt tokens differ (tool calls)
        self.evicted = 0  # open sessions closed (and published) because max_open were open
        self.splits_long = 0  # sessions split because their trajectory reached max_turns or max_bytes
        self._evicted: list[Trajectory] = []

    def remember(self, traj: Trajectory) -> None:
        """Keep what feedback needs to address ``traj`` (unclaimed until :meth:`claim`)."""
        tid = traj.trajectory_id
        self.known[tid] = KnownTrajectory(tid, traj.example_id, traj.group_id, time.time())
        self._unclaimed[tid] = None
        self._unclaimed.move_to_end(tid)
        if traj.session_id:
            self.session_last[traj.session_id] = tid
            self._session_of[tid] = traj.session_id
        while len(self._unclaimed) > self.remembered:
            self.forget(self._unclaimed.popitem(last=False)[0])

    def claim(self, trajectory_id: str) -> None:
        """``trajectory_id`` now counts against its tenant's share (kept until :meth:`forget`)."""
        self._unclaimed.pop(trajectory_id, None)

    def forget(self, trajectory_id: str) -> None:
        """Drop a known trajectory (and its session's pointer to it)."""
        self.known.pop(trajectory_id, None)
        self._unclaimed.pop(trajectory_id, None)
        session_id = self._session_of.pop(trajectory_id, None)
        if session_id is not None and self.session_last.get(session_id) == trajectory_id:
            del self.session_last[session_id]

    def begin(self, session_id: str | None, prompt_ids: list[int] | None, messages: list[Message],
              policy_version: int, task: str | None = None) -> tuple[Trajectory, Trajectory | None]:
        """(the trajectory this call joins, a trajectory it closes: to publish now, or None). Past ``max_open``
        open sessions, the least recently active ones are closed too: :meth:`take_evicted` hands them out."""
        closed = None
        if session_id is not None:
            current = self.open.get(session_id)
            how = continuation(current.recording.calls[-1], prompt_ids, messages) if (
                current is not None and current.recording.calls) else None
            full = current is not None and (len(current.recording.calls) >= self.max_turns
                                            or current.approx_bytes >= self.max_bytes)
            if current is not None and how is not None and not full:
                if how == MESSAGES and prompt_ids is not None:
                    self.retokenized += 1
                current.last_active = time.monotonic()
                self.open.move_to_end(session_id)
                return current, None
            if current is not None:
                closed = self.close(session_id)
                if closed is not None:
                    if how is not None:  # it continued, but the trajectory is as long as one may be
                        self.splits_long += 1
                    else:
                        self.splits += 1
        traj = Trajectory(session_id=session_id, policy_version=policy_version, task=task)
        if session_id is not None:
            self.open[session_id] = traj
            while len(self.open) > self.max_open:
                evicted = self.close(self._eviction_victim(session_id))
                self.evicted += 1
                if evicted is not None:
                    self._evicted.append(evicted)
        self.remember(traj)
        return traj, closed

    def _eviction_victim(self, newcomer: str) -> str:
        """The session to close for ``newcomer``: the least recently active of the newcomer's own tenant, so a
        tenant flooding sessions closes its own; the least recently active overall only when that tenant has no
        other session open."""
        tenant = self.tenant_of(newcomer)
        for session_id in self.open:
            if session_id != newcomer and self.tenant_of(session_id) == tenant:
                return session_id
        return next(iter(self.open))

    def take_evicted(self) -> list[Trajectory]:
        """The trajectories closed because ``max_open`` sessions were open (to publish), since the last call."""
        out, self._evicted = self._evicted, []
        return out

    def close(self, session_id: str) -> Trajectory | None:
        """Take a session's open trajectory out (to publish); None when it has none (or no calls)."""
        traj = self.open.pop(session_id, None)
        if traj is None:
            return None
        traj.closed = True
        return traj if traj.recording.calls else None

    def idle(self, now: float | None = None) -> list[Trajectory]:
        """Close and return the trajectories of sessions idle for ``idle_s``."""
        now = time.monotonic() if now is None else now
        stale = [sid for sid, traj in self.open.items() if now - traj.last_active >= self.idle_s]
        return [t for t in (self.close(sid) for sid in stale) if t is not None]

    def close_all(self) -> list[Trajectory]:
        return [t for t in (self.close(sid) for sid in list(self.open)) if t is not None]

    def lookup(self, trajectory_id: str | None = None, session_id: str | None = None) -> KnownTrajectory | None:
        if trajectory_id:
            return self.known.get(trajectory_id)
        if session_id and session_id in self.session_last:
            return self.known.get(self.session_last[session_id])
        return None

    def open_trajectory(self, trajectory_id: str) -> Trajectory | None:
        for traj in self.open.values():
            if traj.trajectory_id == trajectory_id:
                return traj
        return None


def recorded_call(request: dict[str, Any], message: dict[str, Any], prompt_ids: list[int] | None,
                  completion_ids: list[int] | None, logprobs: list[float] | None, finish_reason: str | None,
                  served_model: str, *, policy_version: int | None = None,
                  default_temperature: float = NEUTRAL_TEMPERATURE) -> RecordedCall:
    """A gateway call as capture's RecordedCall (grammar-constrained logprobs dropped, as capture does); its turn
    carries ``policy_version`` (the version the call was routed to) and the request's sampling temperature
    (``default_temperature``, the upstream's default, when the request names none)."""
    from rlstream.rollout.capture import constrained, request_temperature, request_tools, to_message
    from rlstream.schemas.models import Turn

    if logprobs is not None and constrained({**request, "extra_body": {
            k: v for k, v in request.items() if k.startswith("guided_") or k == "structured_outputs"}}):
        logprobs = None
    if completion_ids is not None and logprobs is not None and len(completion_ids) != len(logprobs):
        logprobs = None
    turn = Turn(model=str(request.get("model")), prompt_token_ids=prompt_ids, completion_token_ids=completion_ids,
                completion_logprobs=logprobs, trainable=True, finish_reason=finish_reason,
                policy_version=policy_version,
                temperature=request_temperature(request, default_temperature))
    return RecordedCall(request_messages=[to_message(m) for m in request.get("messages", [])],
                        response_message=to_message(message), turn=turn, served_model=served_model,
                        tools=request_tools(request))
