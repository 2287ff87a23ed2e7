"""Group assembly as a state machine over two key-value stores (no Kafka, no Faust).

``groups`` maps group_id -> a JSON-able state (members, their rewards and source offsets, rewards
waiting for their trajectory, timestamps); ``members`` maps trajectory_id -> the member's Avro bytes.
The Faust app passes changelog-backed tables; tests pass dicts. Every call returns what must go out:
finished groups (:class:`Finished`) and rejected records (:class:`Reject`), plus counters.

Rules: a trajectory_id already held (or already emitted) is ignored; a reward before its trajectory is
held; a group completes when ``group_size`` members have rewards; after ``group_timeout_s`` since its
first record it is emitted with completion=timeout if at least ``min_group_size`` members have rewards,
else it expires. Members left out of a timed-out group and every member of an expired group go to the
dead letters (nothing is dropped silently).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, MutableMapping

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import GroupCompletion, RewardEvent, SourceOffset, TrajectoryEvent, TrajectoryGroup, utc_now
from rlstream.streams import validation as v


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


@dataclass(frozen=True)
class Reject:
    """A record for the dead letters: reason code, message, where it came from, its bytes."""

    reason: str
    message: str
    source: SourceRef
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class Finished:
    """A group that left assembly (full or timeout); filters come next."""

    group: TrajectoryGroup
    last_member_ts: float  # when its last member was produced (record timestamp, seconds)


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


def group_stats(rewards: list[float]) -> tuple[float, float, float, float]:
    """Mean, population standard deviation, min and max of a group's rewards."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return mean, std, min(rewards), max(rewards)


class GroupAssembler:
    """Turns trajectory and reward records into finished groups, one partition's stores at a time."""

    def __init__(self, groups: MutableMapping[str, Any], members: MutableMapping[str, bytes], codec: AvroCodec,
                 rules: AssemblyRules) -> None:
        self.groups = groups
        self.members = members
        self.codec = codec
        self.rules = rules

    # -- records -------------------------------------------------------------------------
    def on_trajectory(self, event: TrajectoryEvent, raw: bytes, key: bytes | None, src: SourceRef,
                      record_ts: float, now: float) -> Outcome:
        out = Outcome()
        state = self._open_state(event, src, now)
        if state.get("closed"):
            self._on_closed(state, event.trajectory_id, "duplicate_trajectory",
                            f"group {event.group_id} was already emitted or expired; "
                            f"member {event.trajectory_id} came too late", out, src, key, raw)
            return out
        if event.trajectory_id in state["m"]:
            out.counts["duplicate_trajectory"] += 1
            return out
        if state["n"] is not None and state["n"] != event.group_size:
            out.rejects.append(Reject(v.GROUP_SIZE_MISMATCH, f"group_size {event.group_size} differs from the "
                                      f"group's {state['n']}", src, key, raw))
            return out
        if state["e"] != event.example_id:
            out.rejects.append(Reject(v.REWARD_GROUP_MISMATCH, f"example_id {event.example_id!r} differs from the "
                                      f"group's {state['e']!r}", src, key, raw))
            return out
        state.update(n=event.group_size, r=event.run_id, pol=event.policy)
        member = {"src": src.as_list(), "rw": event.reward, "comp": dict(event.reward_components), "rsrc": None,
                  "v": event.policy_version, "k": key.decode("utf-8", "replace") if key is not None else None}
        pending = state["pr"].pop(event.trajectory_id, None)
        if pending is not None:
            if member["rw"] is None:
                member.update(rw=pending["rw"], comp={**member["comp"], **pending["comp"]}, rsrc=pending["src"])
            else:
                out.counts["duplicate_reward"] += 1
        state["m"][event.trajectory_id] = member
        state["t1"] = max(state["t1"], record_ts)
        self.members[event.trajectory_id] = raw
        out.counts["trajectories_accepted"] += 1
        out.extend(self._maybe_complete(event.group_id, state, now))
        return out

    def on_reward(self, event: RewardEvent, raw: bytes, key: bytes | None, src: SourceRef, record_ts: float,
                  now: float) -> Outcome:
        out = Outcome()
        state = self._open_state(event, src, now)
        if state.get("closed"):
            self._on_closed(state, event.trajectory_id, "duplicate_reward",
                            f"reward for {event.trajectory_id} came after group "
                            f"{event.group_id} was emitted or expired", out, src, key, raw)
            return out
        if state["e"] != event.example_id:
            out.rejects.append(Reject(v.REWARD_GROUP_MISMATCH, f"reward names example {event.example_id!r} but group "
                                      f"{event.group_id} belongs to {state['e']!r}", src, key, raw))
            return out
        member = state["m"].get(event.trajectory_id)
        if member is None:
            if event.trajectory_id in state["pr"]:
                out.counts["duplicate_reward"] += 1
                return out
            state["pr"][event.trajectory_id] = {"rw": event.reward, "comp": dict(event.components),
                                                "src": src.as_list()}
            out.counts["rewards_held"] += 1
            self.groups[event.group_id] = state
            return out
        if member["rw"] is not None:
            out.counts["duplicate_reward"] += 1
            return out
        member.update(rw=event.reward, comp={**member["comp"], **event.components}, rsrc=src.as_list())
        state["t1"] = max(state["t1"], record_ts)
        out.counts["rewards_joined"] += 1
        out.extend(self._maybe_complete(event.group_id, state, now))
        return out

    def on_tick(self, partition: int, now: float) -> Outcome:
        """Time out, expire and forget groups of ``partition`` whose time has come."""
        out = Outcome()
        due = []
        for group_id, state in list(self.groups.items()):
            if not isinstance(state, dict) or state.get("p") != partition:
                continue
            if state.get("closed"):
                if now - state["closed_at"] >= self.rules.closed_retention_s:
                    due.append((group_id, None))
            elif now - state["t0"] >= self.rules.group_timeout_s:
                due.append((group_id, state))
        for group_id, state in due:
            if state is None:
                del self.groups[group_id]
                out.counts["closed_forgotten"] += 1
            else:
                out.extend(self._time_out(group_id, state, now))
        return out

    # -- internals -----------------------------------------------------------------------
    def _open_state(self, event: TrajectoryEvent | RewardEvent, src: SourceRef, now: float) -> dict[str, Any]:
        """The group's state, or a fresh one for a group seen for the first time."""
        state = self.groups.get(event.group_id)
        return state if state is not None else self._new_state(event.group_id, event.example_id, src.partition, now)

    @staticmethod
    def _on_closed(state: dict[str, Any], trajectory_id: str, duplicate_counter: str, late_message: str,
                   out: Outcome, src: SourceRef, key: bytes | None, raw: bytes) -> None:
        """A record for a group already emitted or expired: a member's duplicate is counted, else dead-lettered."""
        if trajectory_id in state["ids"]:
            out.counts[duplicate_counter] += 1
        else:
            out.rejects.append(Reject("group_closed", late_message, src, key, raw))

    @staticmethod
    def _new_state(group_id: str, example_id: str, partition: int, now: float) -> dict[str, Any]:
        return {"g": group_id, "e": example_id, "r": "", "pol": "", "n": None, "p": partition, "t0": now,
                "t1": 0.0, "m": {}, "pr": {}}

    def _rewarded(self, state: dict[str, Any]) -> list[str]:
        return [tid for tid, m in state["m"].items() if m["rw"] is not None]

    def _maybe_complete(self, group_id: str, state: dict[str, Any], now: float) -> Outcome:
        rewarded = self._rewarded(state)
        if state["n"] is not None and len(rewarded) >= state["n"]:
            out = self._finish(group_id, state, rewarded, GroupCompletion.full, now)
            out.counts["groups_completed"] += 1
            return out
        self.groups[group_id] = state
        return Outcome()

    def _time_out(self, group_id: str, state: dict[str, Any], now: float) -> Outcome:
        rewarded = self._rewarded(state)
        if rewarded and len(rewarded) >= self.rules.min_group_size:
            out = self._finish(group_id, state, rewarded, GroupCompletion.timeout, now)
            out.counts["groups_timed_out"] += 1
            return out
        out = Outcome()
        for tid in list(state["m"]):
            out.rejects.append(self._member_reject(state, tid, v.GROUP_EXPIRED,
                                                   f"group {group_id} expired after {self.rules.group_timeout_s}s "
                                                   f"with {len(rewarded)} rewarded of {state['n']} "
                                                   f"(min_group_size {self.rules.min_group_size})"))
        out.rejects += self._orphans(state)
        out.counts["groups_expired"] += 1
        self._close(group_id, state, now)
        return out

    def _finish(self, group_id: str, state: dict[str, Any], rewarded: list[str], completion: GroupCompletion,
                now: float) -> Outcome:
        out = Outcome()
        members: list[TrajectoryEvent] = []
        offsets: list[SourceOffset] = []
        for tid in rewarded:
            m = state["m"][tid]
            event = self.codec.decode(self.members[tid], TrajectoryEvent)
            event = event.model_copy(update={"reward": float(m["rw"]), "reward_components": m["comp"]})
            members.append(event)
            offsets.append(SourceOffset(topic=m["src"][0], partition=m["src"][1], offset=m["src"][2]))
            if m["rsrc"] is not None:
                offsets.append(SourceOffset(topic=m["rsrc"][0], partition=m["rsrc"][1], offset=m["rsrc"][2]))
        members.sort(key=lambda e: (e.generation_index, e.trajectory_id))
        for tid in state["m"]:
            if tid not in rewarded:
                out.rejects.append(self._member_reject(state, tid, v.REWARD_TIMEOUT,
                                                       f"no reward within {self.rules.group_timeout_s}s; group "
                                                       f"{group_id} was emitted without this member"))
        out.rejects += self._orphans(state)
        rewards = [float(e.reward) for e in members]  # type: ignore[arg-type]
        mean, std, lo, hi = group_stats(rewards)
        versions = [e.policy_version for e in members]
        first = members[0]
        group = TrajectoryGroup(
            group_id=group_id, run_id=first.run_id, example_id=first.example_id, policy=first.policy,
            min_policy_version=min(versions), max_policy_version=max(versions), expected_size=int(state["n"]),
            trajectories=members, reward_mean=mean, reward_std=std, reward_min=lo, reward_max=hi,
            completion=completion, assembled_at=utc_now(), source_offsets=offsets,
        )
        out.finished.append(Finished(group=group, last_member_ts=float(state["t1"])))
        self._close(group_id, state, now)
        return out

    def _member_reject(self, state: dict[str, Any], tid: str, reason: str, message: str) -> Reject:
        m = state["m"][tid]
        key = m["k"].encode() if m.get("k") is not None else None
        return Reject(reason, message, SourceRef.from_list(m["src"]), key, self.members.get(tid))

    def _orphans(self, state: dict[str, Any]) -> list[Reject]:
        return [Reject(v.ORPHAN_REWARD, f"reward {p['rw']} for trajectory {tid} of group {state['g']}: the "
                       "trajectory never arrived", SourceRef.from_list(p["src"]), state["e"].encode(), None)
                for tid, p in state["pr"].items()]

    def _close(self, group_id: str, state: dict[str, Any], now: float) -> None:
        for tid in state["m"]:
            if tid in self.members:
                del self.members[tid]
        self.groups[group_id] = {"g": group_id, "p": state["p"], "closed": True, "closed_at": now,
                                 "ids": sorted(state["m"])}
