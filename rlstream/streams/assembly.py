"""Group assembly as a state machine over two key-value stores (no Kafka, no Faust).

``groups`` maps group_id -> the group's state as JSON (:class:`OpenGroup` or :class:`ClosedGroup`,
written with ``to_json()`` and read back with :func:`group_state_from_json`; the short keys are the
changelog layout, so existing changelogs recover unchanged). The state is small: ids, rewards, versions and
where each record came from (about 200 bytes per waiting trajectory), never a payload. ``payloads`` maps a
record's source (topic, partition, offset) -> its bytes as consumed: in the app a bounded in-memory cache that
is not a changelog (streams/payloads.py), refilled by reading a record back by its offset when a group is about to
leave and a payload is not cached (after a restart, a rebalance or an eviction). The Faust app passes a
changelog-backed table for ``groups``; tests pass dicts. Every call returns what must go out: finished groups
(:class:`Finished`, members as consumed, so an unchanged member is never decoded or re-encoded) and rejected
records (:class:`Reject`), plus counters.

Rules: a ``validation`` trajectory (held-out answers: the gate's, ``rlstream finetune``'s validation passes) is
never grouped (counted ``validation_skipped``: it stays on ``trajectories`` for lineage and the console, and never
reaches ``groups``); a trajectory_id already held (or already emitted) is ignored; a reward before its trajectory is
held; a group completes when ``group_size`` members have rewards; after ``group_timeout_s`` since its
first record it is emitted with completion=timeout if at least ``min_group_size`` members have rewards,
else it expires. Members left out of a timed-out group and every member of an expired group go to the
dead letters (nothing is dropped silently).

Which reward a trajectory trains with (feedback corrections):

* The first reward to reach a trajectory is its reward: the trajectory's own (inline) reward, else the first
  RewardEvent for it (held if it came before the trajectory). That reward's ``feedback_id`` (or none) owns it.
* A later RewardEvent with the *same* ``feedback_id`` is a correction: while the trajectory's group is still open,
  the last write wins (its reward replaces the owned one, its components replace those the feedback set; counted
  ``rewards_corrected``; the group's ``source_offsets`` then name the correcting record). Feedback ids are scoped to
  their trajectory.
* Once the group has left (emitted, or expired), a correction is never trained: it is recorded on ``dlq`` with
  reason ``correction_after_emit`` and counted ``rewards_corrected_after_emit``. A single response (group_size 1)
  leaves at its first reward, so every correction of one is of this kind.
* Any other later reward (no ``feedback_id``, or another one, or a reward for a trajectory that had its own) keeps
  the first-reward-wins rule: counted ``duplicate_reward`` and ignored, before and after its group left.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, MutableMapping

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import (GroupBaseline, GroupCompletion, RewardEvent, SourceOffset, TrajectoryEvent,
                                     TrajectoryGroup, TrajectorySource, utc_now)
from rlstream.streams import validation as v
from rlstream.streams.baseline import (BaselineRules, BaselineState, baseline_key, is_baseline, mean_and_std, score,
                                       table_key, task_of)
from rlstream.streams.deadlines import DueIndex
from rlstream.streams.reward_rules import (RewardRules, Scores, ScoreTaken, all_named_in, combined, components,
                                          event_scores, feedback_ids, take_scores)


@dataclass(frozen=True)
class SourceRef:
    """Where a record came from (lineage)."""

    topic: str
    partition: int
    offset: int

    def as_list(self) -> list[Any]:
        return [self.topic, self.partition, self.offset]

    @classmethod
    def from_list(cls, data: list[Any]) -> "SourceRef":
        return cls(str(data[0]), int(data[1]), int(data[2]))

    def as_offset(self) -> SourceOffset:
        return SourceOffset(topic=self.topic, partition=self.partition, offset=self.offset)


# -- stored state ------------------------------------------------------------------------------
# JSON keys (the changelog layout): group "g" group_id, "e" example_id, "r" run_id, "pol" policy,
# "n" group_size, "p" partition, "t0" opened_at, "t1" last_record_ts, "m" members, "pr" pending rewards;
# "tk" task (baseline key of a single response); member "src" source, "rw" reward, "comp" reward components,
# "rsrc" reward source, "v" policy version, "gi" generation index, "k" record key, "fid" feedback id of its reward,
# "fc" component names that feedback set; pending reward "rw", "comp", "src", "fid"; closed group "g", "p",
# "closed", "closed_at", "ids" member ids, "fids" feedback id of each member's reward (members that had one).

def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass
class MemberState:
    """A trajectory held in an open group: its lineage, its reward once known, and its record key."""

    source: SourceRef
    reward: float | None
    reward_components: dict[str, float]
    reward_source: SourceRef | None  # the reward record, when the reward came separately
    policy_version: int
    key: str | None  # the record key as text (dead letters carry it back as bytes)
    generation_index: int = 0
    feedback_id: str | None = None  # of the RewardEvent that gave its reward (a correction must repeat it)
    feedback_components: list[str] = field(default_factory=list)  # component names that feedback set
    scores: Scores = field(default_factory=dict)  # named scores so far (streams.reward.scores set)
    scored_at: float | None = None  # when its first score arrived (the score window counts from here)
    captured_at: float = 0.0  # the trajectory's created_at (the correction window of a single counts from here)

    @property
    def rewarded(self) -> bool:
        return self.reward is not None

    def key_bytes(self) -> bytes | None:
        return self.key.encode() if self.key is not None else None

    def take_feedback(self, reward: float, components: dict[str, float], source: SourceRef,
                      feedback_id: str | None) -> None:
        """Set the reward from a RewardEvent (or correct it): the components an earlier write of the same feedback
        set are replaced by this one's; the trajectory's own components stay."""
        kept = {k: v for k, v in self.reward_components.items() if k not in self.feedback_components}
        self.reward = reward
        self.reward_components = {**kept, **components}
        self.reward_source = source
        self.feedback_id = feedback_id
        self.feedback_components = sorted(components)

    def to_json(self) -> dict[str, Any]:
        data = {"src": self.source.as_list(), "rw": self.reward, "comp": dict(self.reward_components),
                "rsrc": self.reward_source.as_list() if self.reward_source is not None else None,
                "v": self.policy_version, "gi": self.generation_index, "k": self.key}
        if self.feedback_id is not None:
            data["fid"], data["fc"] = self.feedback_id, list(self.feedback_components)
        if self.scores:
            data["sc"], data["s0"] = {k: list(v) for k, v in self.scores.items()}, self.scored_at
        if self.captured_at:
            data["ca"] = self.captured_at
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MemberState":
        rsrc = data.get("rsrc")
        return cls(source=SourceRef.from_list(data["src"]), reward=_optional_float(data.get("rw")),
                   reward_components=dict(data.get("comp") or {}),
                   reward_source=SourceRef.from_list(rsrc) if rsrc is not None else None,
                   policy_version=int(data.get("v") or 0), key=data.get("k"),
                   generation_index=int(data.get("gi") or 0), feedback_id=data.get("fid"),
                   feedback_components=list(data.get("fc") or []),
                   scores={k: list(v) for k, v in (data.get("sc") or {}).items()},
                   scored_at=_optional_float(data.get("s0")), captured_at=float(data.get("ca") or 0.0))


@dataclass
class PendingReward:
    """A reward that arrived before its trajectory."""

    reward: float
    reward_components: dict[str, float]
    source: SourceRef
    feedback_id: str | None = None
    scores: Scores = field(default_factory=dict)  # its named scores (streams.reward.scores set)
    scored_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        data = {"rw": self.reward, "comp": dict(self.reward_components), "src": self.source.as_list()}
        if self.feedback_id is not None:
            data["fid"] = self.feedback_id
        if self.scores:
            data["sc"], data["s0"] = {k: list(v) for k, v in self.scores.items()}, self.scored_at
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PendingReward":
        return cls(reward=float(data["rw"]), reward_components=dict(data.get("comp") or {}),
                   source=SourceRef.from_list(data["src"]), feedback_id=data.get("fid"),
                   scores={k: list(v) for k, v in (data.get("sc") or {}).items()},
                   scored_at=_optional_float(data.get("s0")))


@dataclass
class OpenGroup:
    """A group still collecting members and rewards."""

    group_id: str
    example_id: str
    partition: int  # the source partition that owns it (ticks time it out there)
    opened_at: float  # wall clock of its first record: the timeout counts from here
    run_id: str = ""
    policy: str = ""
    group_size: int | None = None  # known once its first trajectory arrived
    task: str = ""  # the baseline's task key of a single response (metadata "task", else the policy)
    last_record_ts: float = 0.0  # latest record timestamp of a member or a joined reward
    members: dict[str, MemberState] = field(default_factory=dict)  # trajectory_id -> member, in arrival order
    pending_rewards: dict[str, PendingReward] = field(default_factory=dict)  # trajectory_id -> early reward
    due_at: float | None = None  # before its timeout: when a score window ends or a held single may leave

    def rewarded_ids(self) -> list[str]:
        return [tid for tid, m in self.members.items() if m.rewarded]

    def to_json(self) -> dict[str, Any]:
        return {"g": self.group_id, "e": self.example_id, "r": self.run_id, "pol": self.policy, "n": self.group_size,
                "tk": self.task, "p": self.partition, "t0": self.opened_at, "t1": self.last_record_ts,
                "m": {tid: m.to_json() for tid, m in self.members.items()},
                "pr": {tid: p.to_json() for tid, p in self.pending_rewards.items()},
                **({"dl": self.due_at} if self.due_at is not None else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "OpenGroup":
        n = data.get("n")
        return cls(group_id=data["g"], example_id=data["e"], partition=int(data["p"]), opened_at=float(data["t0"]),
                   run_id=data.get("r", ""), policy=data.get("pol", ""), group_size=int(n) if n is not None else None,
                   task=data.get("tk", ""),
                   last_record_ts=float(data.get("t1", 0.0)),
                   members={tid: MemberState.from_json(m) for tid, m in data.get("m", {}).items()},
                   pending_rewards={tid: PendingReward.from_json(p) for tid, p in data.get("pr", {}).items()},
                   due_at=_optional_float(data.get("dl")))


@dataclass
class ClosedGroup:
    """A group already emitted or expired, remembered for a while so that late duplicates are recognised."""

    group_id: str
    partition: int
    closed_at: float
    member_ids: list[str]  # sorted trajectory ids it held
    feedback_ids: dict[str, str] = field(default_factory=dict)  # trajectory id -> feedback id of its reward
    score_feedback_ids: dict[str, list[str]] = field(default_factory=dict)  # trajectory id -> ids of its scores

    def corrects(self, trajectory_id: str, feedback_id: str | None) -> bool:
        """True when ``feedback_id`` set (part of) the reward ``trajectory_id`` left with."""
        return feedback_id is not None and (self.feedback_ids.get(trajectory_id) == feedback_id
                                            or feedback_id in self.score_feedback_ids.get(trajectory_id, ()))

    def to_json(self) -> dict[str, Any]:
        data = {"g": self.group_id, "p": self.partition, "closed": True, "closed_at": self.closed_at,
                "ids": list(self.member_ids)}
        if self.feedback_ids:
            data["fids"] = dict(self.feedback_ids)
        if self.score_feedback_ids:
            data["fidx"] = dict(self.score_feedback_ids)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ClosedGroup":
        return cls(group_id=data["g"], partition=int(data["p"]), closed_at=float(data["closed_at"]),
                   member_ids=list(data.get("ids", [])), feedback_ids=dict(data.get("fids") or {}),
                   score_feedback_ids={k: list(v) for k, v in (data.get("fidx") or {}).items()})


GroupState = OpenGroup | ClosedGroup


def group_state_from_json(data: dict[str, Any]) -> GroupState:
    """The stored JSON of a group (either kind) as its dataclass."""
    return ClosedGroup.from_json(data) if data.get("closed") else OpenGroup.from_json(data)


def stored_partition(data: Any) -> int | None:
    """The partition of a stored group state without decoding all of it (None for a foreign value)."""
    return data.get("p") if isinstance(data, dict) else None


@dataclass(frozen=True)
class Reject:
    """A record for the dead letters: reason code, message, where it came from, its bytes."""

    reason: str
    message: str
    source: SourceRef
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class FinishedMember:
    """A member of a finished group: its record as consumed and the reward it leaves with."""

    trajectory_id: str
    source: SourceRef
    payload: bytes  # the trajectory record as read from its topic (framed)
    reward: float
    reward_components: dict[str, float]
    joined: bool  # its reward came in a RewardEvent: the record as consumed does not carry it

    def event(self, codec: AvroCodec) -> TrajectoryEvent:
        """The member decoded, with its reward."""
        event = codec.decode(self.payload, TrajectoryEvent)
        return event.model_copy(update={"reward": self.reward, "reward_components": self.reward_components})

    def body(self, codec: AvroCodec) -> bytes:
        """The member's Avro body inside a group record: the consumed bytes as they are when nothing changed and they
        were written with this codec's schema; otherwise decoded, given the joined reward and encoded again."""
        if not self.joined:
            body = codec.body_as_written(self.payload, TrajectoryEvent.avro_name)
            if body is not None:
                return body
        record = codec.decode_record(self.payload, TrajectoryEvent.avro_name)
        record["reward"], record["reward_components"] = self.reward, dict(self.reward_components)
        return codec.encode_body(record, TrajectoryEvent.avro_name)


@dataclass(frozen=True)
class Finished:
    """A group that left assembly (full or timeout); filters come next.

    ``header`` is the group record with every field but its members (``trajectories`` empty); :meth:`encode` places
    the members' bytes into it, and :attr:`group` is the whole group decoded (tests, and readers that need it)."""

    header: TrajectoryGroup
    members: list[FinishedMember]
    last_member_ts: float  # when its last member was produced (record timestamp, seconds)
    codec: AvroCodec

    @property
    def rewards(self) -> list[float]:
        return [m.reward for m in self.members]

    @cached_property
    def group(self) -> TrajectoryGroup:
        return self.header.model_copy(update={"trajectories": [m.event(self.codec) for m in self.members]})

    def encode(self, header: TrajectoryGroup | None = None) -> bytes:
        """The group record (``header``, e.g. with curriculum info, or this group's) with its members' bytes."""
        return self.codec.encode_with_bodies(header or self.header, "trajectories",
                                             [m.body(self.codec) for m in self.members])


@dataclass
class Outcome:
    finished: list[Finished] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def extend(self, other: "Outcome") -> None:
        self.finished += other.finished
        self.rejects += other.rejects
        self.counts.update(other.counts)


@dataclass(frozen=True)
class AssemblyRules:
    group_timeout_s: float
    min_group_size: int
    closed_retention_s: float = 3600.0
    single_timeout_s: float = 86_400.0  # a single response (group_size 1) waits this long for its reward
    baseline: BaselineRules = BaselineRules()
    reward: RewardRules = RewardRules()  # streams.reward: named scores and the correction window of singles


def group_stats(rewards: list[float]) -> tuple[float, float, float, float]:
    """Mean, population standard deviation, min and max of a group's rewards (no overflow: see
    :func:`streams.baseline.mean_and_std`)."""
    mean, std = mean_and_std(rewards, ddof=0)
    return mean, std, min(rewards), max(rewards)


class GroupAssembler:
    """Turns trajectory and reward records into finished groups, one partition's stores at a time."""

    def __init__(self, groups: MutableMapping[str, Any], payloads: MutableMapping[SourceRef, bytes],
                 codec: AvroCodec, rules: AssemblyRules, due_index: DueIndex | None = None) -> None:
        self.groups = groups  # group_id -> GroupState.to_json()
        self.payloads = payloads  # source -> record bytes as consumed (a cache: a miss is read back by offset)
        self.codec = codec
        self.rules = rules
        # when each group's time comes (streams/deadlines.py); without one, a tick walks the whole table
        self.due_index = due_index

    # -- records -------------------------------------------------------------------------
    def on_trajectory(self, event: TrajectoryEvent, raw: bytes, key: bytes | None, src: SourceRef,
                      record_ts: float, now: float, stored: GroupState | None = None) -> Outcome:
        """``stored``: the group's state as :func:`group_state_from_json` just read it from ``groups`` (a caller that
        decoded it already saves a second decode); None: read here."""
        out = Outcome()
        if event.source == TrajectorySource.validation:  # held-out answers: never a group, never trained
            out.counts["validation_skipped"] += 1
            return out
        state = stored if stored is not None else self._open_state(event, src, now)
        if isinstance(state, ClosedGroup):
            self._on_closed(state, event.trajectory_id, "duplicate_trajectory",
                            f"group {event.group_id} was already emitted or expired; "
                            f"member {event.trajectory_id} came too late", out, src, key, raw)
            return out
        if event.trajectory_id in state.members:
            out.counts["duplicate_trajectory"] += 1
            return out
        if state.group_size is not None and state.group_size != event.group_size:
            out.rejects.append(Reject(v.GROUP_SIZE_MISMATCH, f"group_size {event.group_size} differs from the "
                                      f"group's {state.group_size}", src, key, raw))
            return out
        if state.example_id != event.example_id:
            out.rejects.append(Reject(v.REWARD_GROUP_MISMATCH, f"example_id {event.example_id!r} differs from the "
                                      f"group's {state.example_id!r}", src, key, raw))
            return out
        state.group_size, state.run_id, state.policy = event.group_size, event.run_id, event.policy
        state.task = state.task or task_of(event)
        member = MemberState(source=src, reward=event.reward, reward_components=dict(event.reward_components),
                             reward_source=None, policy_version=event.policy_version,
                             key=key.decode("utf-8", "replace") if key is not None else None,
                             generation_index=event.generation_index, captured_at=event.created_at.timestamp())
        pending = state.pending_rewards.pop(event.trajectory_id, None)
        if pending is not None:
            if member.reward is not None:
                out.counts["duplicate_reward"] += 1
            elif pending.scores:  # named scores: they wait for the rest of their window in the member
                member.scores, member.scored_at, member.reward_source = pending.scores, pending.scored_at, \
                    pending.source
            else:
                member.take_feedback(pending.reward, pending.reward_components, pending.source, pending.feedback_id)
        state.members[event.trajectory_id] = member
        state.last_record_ts = max(state.last_record_ts, record_ts)
        self.payloads[src] = raw
        out.counts["trajectories_accepted"] += 1
        out.extend(self._maybe_complete(state, now))
        return out

    def on_reward(self, event: RewardEvent, raw: bytes, key: bytes | None, src: SourceRef, record_ts: float,
                  now: float, stored: GroupState | None = None) -> Outcome:
        """``stored``: as for :meth:`on_trajectory`."""
        out = Outcome()
        state = stored if stored is not None else self._open_state(event, src, now)
        fid = event.feedback_id
        if isinstance(state, ClosedGroup):
            if state.corrects(event.trajectory_id, fid):
                out.rejects.append(Reject(v.CORRECTION_AFTER_EMIT, (
                    f"correction {fid!r} of the reward of {event.trajectory_id} (now {event.reward:g}) came after "
                    f"group {event.group_id} was emitted or expired; it is recorded here and never trained"),
                    src, key, raw))
                out.counts["rewards_corrected_after_emit"] += 1
                return out
            self._on_closed(state, event.trajectory_id, "duplicate_reward",
                            f"reward for {event.trajectory_id} came after group "
                            f"{event.group_id} was emitted or expired", out, src, key, raw)
            return out
        if state.example_id != event.example_id:
            out.rejects.append(Reject(v.REWARD_GROUP_MISMATCH, f"reward names example {event.example_id!r} but group "
                                      f"{event.group_id} belongs to {state.example_id!r}", src, key, raw))
            return out
        if self.rules.reward.combines:
            return self._on_score(state, event, src, record_ts, now, out)
        member = state.members.get(event.trajectory_id)
        if member is None:
            held = state.pending_rewards.get(event.trajectory_id)
            if held is not None and (fid is None or held.feedback_id != fid):
                out.counts["duplicate_reward"] += 1
                return out
            state.pending_rewards[event.trajectory_id] = PendingReward(
                reward=event.reward, reward_components=dict(event.components), source=src, feedback_id=fid)
            out.counts["rewards_corrected" if held is not None else "rewards_held"] += 1
            self._store(state)
            return out
        if member.rewarded:
            if fid is None or member.feedback_id != fid:
                out.counts["duplicate_reward"] += 1
                return out
            member.take_feedback(event.reward, dict(event.components), src, fid)  # a correction: last write wins
            state.last_record_ts = max(state.last_record_ts, record_ts)
            out.counts["rewards_corrected"] += 1
            self._store(state)  # rewarded already: it cannot complete the group
            return out
        member.take_feedback(event.reward, dict(event.components), src, fid)
        state.last_record_ts = max(state.last_record_ts, record_ts)
        out.counts["rewards_joined"] += 1
        out.extend(self._maybe_complete(state, now))
        return out

    def _on_score(self, state: OpenGroup, event: RewardEvent, src: SourceRef, record_ts: float, now: float,
                  out: Outcome) -> Outcome:
        """A RewardEvent under a named-score rule (``streams.reward.scores``): its scores join the trajectory's,
        and the reward is the combination once every named score is in or the score window has ended."""
        given, fid = event_scores(event), event.feedback_id
        member = state.members.get(event.trajectory_id)
        if member is None:  # before its trajectory: the scores wait with the group
            held = state.pending_rewards.get(event.trajectory_id)
            if held is None:
                held = state.pending_rewards[event.trajectory_id] = PendingReward(
                    reward=event.reward, reward_components={}, source=src, feedback_id=fid, scored_at=now)
            taken = take_scores(held.scores, given, fid)
            out.counts[{ScoreTaken.NEW: "rewards_held", ScoreTaken.CORRECTED: "rewards_corrected",
                        ScoreTaken.DUPLICATE: "duplicate_reward"}[taken]] += 1
            if taken is not ScoreTaken.DUPLICATE:
                self._store(state)
            return out
        if member.rewarded and not member.scores:  # its own (inline) reward: first reward wins
            out.counts["duplicate_reward"] += 1
            return out
        was_rewarded = member.rewarded
        taken = take_scores(member.scores, given, fid)
        if taken is ScoreTaken.DUPLICATE:
            out.counts["duplicate_reward"] += 1
            return out
        member.scored_at = member.scored_at if member.scored_at is not None else now
        member.reward_source = src
        state.last_record_ts = max(state.last_record_ts, record_ts)
        if was_rewarded:  # settled already, its group still here: the combination follows the new score
            member.reward = combined(self.rules.reward, member.scores)
            member.reward_components = components(member.scores)
        out.counts["rewards_corrected" if taken is ScoreTaken.CORRECTED else "rewards_joined"] += 1
        out.extend(self._maybe_complete(state, now))
        return out

    def _settle(self, state: OpenGroup, now: float, force: bool = False) -> None:
        """Give each scored member its combined reward once every named score is in or its window has ended
        (``force``: whatever is in, at the group's timeout)."""
        rules = self.rules.reward
        for member in state.members.values():
            if member.rewarded or not member.scores:
                continue
            ends = (member.scored_at or now) + rules.score_window_s
            if force or now >= ends or all_named_in(rules, member.scores):
                member.reward = combined(rules, member.scores)  # None while no named score is in
                member.reward_components = components(member.scores)

    def _next_due(self, state: OpenGroup, now: float) -> float | None:
        """When the earliest score window still running ends, or None."""
        ends = [end for m in state.members.values() if not m.rewarded and m.scores
                if (end := (m.scored_at or 0.0) + self.rules.reward.score_window_s) > now]
        return min(ends) if ends else None

    def _held_until(self, state: OpenGroup) -> float:
        """When a rewarded single may leave: its capture time plus the correction window (0: at once)."""
        hold = self.rules.reward.hold_s()
        if state.group_size != 1 or hold <= 0:
            return 0.0
        return max((m.captured_at for m in state.members.values()), default=0.0) + hold

    def on_tick(self, partition: int, now: float) -> Outcome:
        """Time out, expire and forget groups of ``partition`` whose time has come."""
        return self.time_out(self.due(partition, now), now)

    def due(self, partition: int, now: float) -> list[tuple[str, OpenGroup | None]]:
        """Groups of ``partition`` whose time has come: (group_id, open state to time out, or None to forget)."""
        if self.due_index is None:
            candidates: Iterable[tuple[str, Any]] = list(self.groups.items())
        else:
            ids = self.due_index.pop_due(partition, now, lambda: self._deadlines(partition))
            candidates = [(group_id, self.groups.get(group_id)) for group_id in dict.fromkeys(ids)]
        due: list[tuple[str, OpenGroup | None]] = []
        for group_id, data in candidates:
            if data is None or stored_partition(data) != partition or is_baseline(data):
                continue
            # decided on the stored fields: a scan must not decode every group at every tick
            if now < self._deadline(data):
                continue  # (from the index: a later write moved its deadline and noted the new one)
            due.append((group_id, None if data.get("closed") else OpenGroup.from_json(data)))
        return due

    def _deadline(self, data: dict[str, Any]) -> float:
        """When a stored group state's time comes: a closed group is forgotten, an open one timed out."""
        if data.get("closed"):
            return float(data["closed_at"]) + self.rules.closed_retention_s
        timeout = float(data["t0"]) + self._timeout_for(data.get("n"))
        due_at = data.get("dl")
        return min(timeout, float(due_at)) if due_at is not None else timeout

    def _deadlines(self, partition: int) -> list[tuple[float, str]]:
        """(deadline, group_id) of every stored group of ``partition`` (to build its index)."""
        return [(self._deadline(data), group_id) for group_id, data in list(self.groups.items())
                if stored_partition(data) == partition and not is_baseline(data)]

    def time_out(self, due: list[tuple[str, OpenGroup | None]], now: float) -> Outcome:
        """Time out or expire the open groups of ``due`` and forget the closed ones (see :meth:`due`)."""
        out = Outcome()
        for group_id, open_state in due:
            if open_state is None:
                del self.groups[group_id]
                out.counts["closed_forgotten"] += 1
            elif now < open_state.opened_at + self._timeout_of(open_state):  # a score window or a hold ended
                out.extend(self._maybe_complete(open_state, now))
            else:
                out.extend(self._time_out(open_state, now))
                self._note(self.groups.get(group_id), group_id)  # (closed by now; noted again whatever happened)
        return out

    # -- internals -----------------------------------------------------------------------
    def _timeout_of(self, state: OpenGroup) -> float:
        return self._timeout_for(state.group_size)

    def _timeout_for(self, group_size: int | None) -> float:
        """Singles wait for feedback (hours); GRPO groups for their members (minutes)."""
        return self.rules.single_timeout_s if group_size == 1 else self.rules.group_timeout_s

    def _score_single(self, state: OpenGroup, reward: float) -> GroupBaseline:
        """The keyed baseline of a single response (then its reward joins that baseline)."""
        key = baseline_key(state.policy, state.task or state.policy)
        where = table_key(state.partition, key)
        baseline_state = BaselineState.from_stored(self.groups.get(where), state.partition, self.rules.baseline, key)
        baseline = score(baseline_state, reward, key, self.rules.baseline)
        self.groups[where] = baseline_state.to_json()
        return baseline

    def _open_state(self, event: TrajectoryEvent | RewardEvent, src: SourceRef, now: float) -> GroupState:
        """The group's state, or a fresh one for a group seen for the first time."""
        data = self.groups.get(event.group_id)
        if data is not None:
            return group_state_from_json(data)
        return OpenGroup(group_id=event.group_id, example_id=event.example_id, partition=src.partition, opened_at=now)

    def _store(self, state: GroupState) -> None:
        data = self.groups[state.group_id] = state.to_json()
        self._note(data, state.group_id)

    def _note(self, data: dict[str, Any] | None, group_id: str) -> None:
        if self.due_index is not None and data is not None:
            self.due_index.note(int(data["p"]), group_id, self._deadline(data))

    @staticmethod
    def _on_closed(state: ClosedGroup, trajectory_id: str, duplicate_counter: str, late_message: str,
                   out: Outcome, src: SourceRef, key: bytes | None, raw: bytes) -> None:
        """A record for a group already emitted or expired: a member's duplicate is counted, else dead-lettered."""
        if trajectory_id in state.member_ids:
            out.counts[duplicate_counter] += 1
        else:
            out.rejects.append(Reject("group_closed", late_message, src, key, raw))

    def _maybe_complete(self, state: OpenGroup, now: float) -> Outcome:
        self._settle(state, now)
        rewarded = state.rewarded_ids()
        state.due_at = self._next_due(state, now)
        if state.group_size is not None and len(rewarded) >= state.group_size:
            held_until = self._held_until(state)
            if now < held_until:  # a single waits out its correction window
                state.due_at = held_until
            else:
                out = self._finish(state, rewarded, GroupCompletion.full, now)
                out.counts["groups_completed"] += 1
                return out
        self._store(state)
        return Outcome()

    def _time_out(self, state: OpenGroup, now: float) -> Outcome:
        self._settle(state, now, force=True)
        rewarded = state.rewarded_ids()
        if rewarded and len(rewarded) >= self.rules.min_group_size:
            out = self._finish(state, rewarded, GroupCompletion.timeout, now)
            out.counts["groups_timed_out"] += 1
            return out
        out = Outcome()
        for tid in list(state.members):
            out.rejects.append(self._member_reject(state, tid, v.GROUP_EXPIRED,
                                                   f"group {state.group_id} expired after {self._timeout_of(state)}s "
                                                   f"with {len(rewarded)} rewarded of {state.group_size} "
                                                   f"(min_group_size {self.rules.min_group_size})"))
        out.rejects += self._orphans(state)
        out.counts["groups_expired"] += 1
        self._close(state, now)
        return out

    def _finish(self, state: OpenGroup, rewarded: list[str], completion: GroupCompletion, now: float) -> Outcome:
        out = Outcome()
        members: list[FinishedMember] = []
        offsets: list[SourceOffset] = []
        order = sorted(rewarded, key=lambda tid: (state.members[tid].generation_index, tid))
        for tid in order:
            m = state.members[tid]
            payload = self.payloads.get(m.source)
            if payload is None:  # neither cached nor read back: never emitted without its record
                out.rejects.append(self._member_reject(state, tid, v.PAYLOAD_UNAVAILABLE, (
                    f"the record of trajectory {tid} at {m.source.topic}/{m.source.partition}@{m.source.offset} "
                    "could not be read back (is the topic's retention shorter than streams.reward_window_s?); "
                    f"group {state.group_id} was emitted without it")))
                continue
            members.append(FinishedMember(trajectory_id=tid, source=m.source, payload=payload,
                                          reward=float(m.reward),  # type: ignore[arg-type]
                                          reward_components=dict(m.reward_components),
                                          joined=m.reward_source is not None))
            offsets.append(m.source.as_offset())
            if m.reward_source is not None:
                offsets.append(m.reward_source.as_offset())
        for tid in state.members:
            if tid not in rewarded:
                out.rejects.append(self._member_reject(state, tid, v.REWARD_TIMEOUT,
                                                       f"no reward within {self.rules.group_timeout_s}s; group "
                                                       f"{state.group_id} was emitted without this member"))
        out.rejects += self._orphans(state)
        if not members:
            out.counts["groups_without_records"] += 1
            self._close(state, now)
            return out
        rewards = [m.reward for m in members]
        mean, std, lo, hi = group_stats(rewards)
        versions = [state.members[m.trajectory_id].policy_version for m in members]
        baseline = self._score_single(state, rewards[0]) if state.group_size == 1 else None
        header = TrajectoryGroup(
            group_id=state.group_id, run_id=state.run_id, example_id=state.example_id, policy=state.policy,
            min_policy_version=min(versions), max_policy_version=max(versions),
            expected_size=int(state.group_size),  # type: ignore[arg-type]
            trajectories=[], reward_mean=mean, reward_std=std, reward_min=lo, reward_max=hi,
            completion=completion, assembled_at=utc_now(), source_offsets=offsets, baseline=baseline,
        )
        out.finished.append(Finished(header=header, members=members, last_member_ts=state.last_record_ts,
                                     codec=self.codec))
        self._close(state, now)
        return out

    def _member_reject(self, state: OpenGroup, tid: str, reason: str, message: str) -> Reject:
        m = state.members[tid]
        return Reject(reason, message, m.source, m.key_bytes(), self.payloads.get(m.source))

    @staticmethod
    def _orphans(state: OpenGroup) -> list[Reject]:
        return [Reject(v.ORPHAN_REWARD, f"reward {p.reward} for trajectory {tid} of group {state.group_id}: the "
                       "trajectory never arrived", p.source, state.example_id.encode(), None)
                for tid, p in state.pending_rewards.items()]

    def _close(self, state: OpenGroup, now: float) -> None:
        for member in state.members.values():
            self.payloads.pop(member.source, None)
        self._store(ClosedGroup(group_id=state.group_id, partition=state.partition, closed_at=now,
                                member_ids=sorted(state.members),
                                feedback_ids={tid: m.feedback_id for tid, m in state.members.items()
                                              if m.feedback_id is not None},
                                score_feedback_ids={tid: feedback_ids(m.scores) for tid, m in state.members.items()
                                                    if feedback_ids(m.scores)}))
