"""The serving pointer and the fleet's load acknowledgements (DESIGN.md, Redis; docs/promotion.md).

``rlstream:{policy}:latest`` is the newest *candidate* (moved by the learner). ``rlstream:{policy}:serving`` is the
version production traffic gets (model name ``policy``); it is moved only by a decider holding a serving fencing
token (the promotion gate, or an operator through ``rlstream promote`` / ``rlstream rollback``):

* forward (``promote``, ``finish_canary``): a compare-and-set to a version above the current one and above the
  ``floor`` a rollback left (a rolled-back version, or one older, never comes back by itself);
* backward only through :meth:`ServingControl.rollback` (the target must be older than the current version);
* ``force_promote`` moves it to any version (an operator's decision).

A backward or forced move (an operator's ``rollback`` or ``force_promote``) ends a running canary in the same
compare-and-set (``canary_version``, ``canary_share`` and ``canary_workers`` cleared): no session is sent to it after
the move, and the gate, finding its canary gone, drops its test (docs/gate.md).

Every move carries a fencing token issued by ``rlstream:{policy}:serving:fencing``; the pointer keeps the token of
its last move and refuses a move with an older one (a paused decider that wakes up after a newer decision changes
nothing), and a move that names ``expected_version`` is refused when the pointer is elsewhere.

Each inference sync worker acknowledges what its vLLM server actually has loaded (read back from ``/v1/models``)
with its heartbeat (``rlstream:{policy}:worker:{id}``, TTL ``inference.heartbeat_ttl_s``): the versions and the
name each is requested by, the versions that failed to load, the server's URL and the replica's role (``serve``, or
``evaluate``: a dedicated evaluation server, never sent production traffic). The fleet rule
(:func:`fleet_readiness`): a version is ready to serve when at least one serve replica is alive and every alive
serve replica (heartbeat not expired) has it loaded; a replica that is down is excluded once its heartbeat expires.
:func:`move_serving_when_loaded` asks the fleet to load a version (``pending_version``), waits for that rule, moves
the pointer and records the decision on ``promotions``.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from redis import exceptions as redis_errors

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import DecisionKind, PolicyVersion, PromotionDecision
from rlstream.transport.control import ControlPlane, worker_key
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: The model name separator of a pinned version: ``policy@12`` is version 12 of ``policy``.
VERSION_SEPARATOR = "@"


def serving_key(policy: str) -> str:
    """Hash of the serving pointer (see :class:`ServingPointer` for its fields)."""
    return f"rlstream:{policy}:serving"


def serving_fencing_key(policy: str) -> str:
    """Counter of the serving fencing tokens issued for ``policy``."""
    return f"rlstream:{policy}:serving:fencing"


def session_pin_key(policy: str, session_id: str) -> str:
    """The version a gateway session is pinned to (string; expires ``session_ttl_s`` after the session's last call)."""
    return f"rlstream:{policy}:session:{session_id}"


def canary_state_key(policy: str) -> str:
    """The running canary's test state (hash, see :class:`CanaryState`), so that a restarted gate resumes it."""
    return f"rlstream:{policy}:canary"


def evaluation_hold_key(policy: str, worker_id: str) -> str:
    """The versions evaluations (the gate's, ``rlstream up``'s held-out scoring) hold on replica ``worker_id``: a
    sorted set of ``<version>|<holder>`` scored by each hold's expiry time. Until a hold is released or expires, an
    ``evaluate`` replica loads no newer full-weights candidate over its version and no replica trims that version
    away as a LoRA adapter."""
    return f"rlstream:{policy}:evaluation-holds:{worker_id}"


def parse_model_name(model: str, policy: str) -> tuple[bool, int | None]:
    """(whether ``model`` names ``policy``, the version it pins or None for the serving version).

    ``policy`` -> (True, None); ``policy@12`` -> (True, 12); anything else, ``policy@x`` included -> (False, None).
    """
    if model == policy:
        return True, None
    head, sep, tail = model.rpartition(VERSION_SEPARATOR)
    if sep and head == policy and tail.isdigit() and len(tail) <= 18:
        return True, int(tail)
    return False, None


def files_digest(record: PolicyVersion) -> str:
    """The serving pointer's ``sha256`` of a version: the sha256 of its files' ``<path> <sha256>`` lines, sorted."""
    lines = sorted(f"{f.path} {f.sha256}" for f in record.files)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def versioned_model_name(policy: str, version: int) -> str:
    """The model name clients use for one version: ``policy@version``."""
    return f"{policy}{VERSION_SEPARATOR}{version}"


class MoveKind(str, Enum):
    forward = "forward"
    rollback = "rollback"
    force = "force"


#: Which pointer move each decision makes (``reject`` and ``canary`` do not move it).
MOVE_OF_DECISION: dict[DecisionKind, MoveKind] = {
    DecisionKind.promote: MoveKind.forward, DecisionKind.finish_canary: MoveKind.forward,
    DecisionKind.rollback: MoveKind.rollback, DecisionKind.force_promote: MoveKind.force,
}


class ServingMoveRefused(RuntimeError):
    """The serving pointer did not move; ``reason`` is a short machine-readable tag."""

    reason = "refused"


class ServingFenced(ServingMoveRefused):
    """The token is older than the one of the pointer's last move, or was never issued."""

    reason = "fenced"


class ServingConflict(ServingMoveRefused):
    """The pointer is not at ``expected_version`` (another decision moved it)."""

    reason = "conflict"


class NotForward(ServingMoveRefused):
    """A forward move to a version not above the current one (or the floor a rollback left), or a rollback to a
    version not below it."""

    reason = "not_forward"


class FleetNotReady(ServingMoveRefused):
    """Not every alive replica acknowledged loading the version (or no replica is alive)."""

    reason = "not_loaded"


def _int_or_none(raw: str | None) -> int | None:
    return int(raw) if raw not in (None, "") else None


def _workers(raw: str | None) -> tuple[str, ...]:
    """The ``canary_workers`` field: worker ids, comma-separated."""
    return tuple(w for w in (raw or "").split(",") if w)


@dataclass(frozen=True)
class ServingPointer:
    """``rlstream:{policy}:serving``. ``floor``: forward moves must go above it (the version a rollback left).
    ``pending_version``: a version the fleet is asked to load (a move waiting for acknowledgements)."""

    version: int
    uri: str = ""
    sha256: str = ""
    moved_at: float = 0.0
    reason: str = ""
    decided_by: str = ""
    fencing_token: int = 0
    floor: int = -1
    pending_version: int | None = None
    canary_version: int | None = None
    canary_share: float = 0.0
    anchor_version: int | None = None  # the gate's anchor: the best version promoted (kept loaded, re-measured)
    canary_workers: tuple[str, ...] = ()  # a full-weights canary: the serve replicas that hold it (the others serve)

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> "ServingPointer | None":
        if "version" not in raw:
            return None
        return cls(version=int(raw["version"]), uri=raw.get("uri", ""), sha256=raw.get("sha256", ""),
                   moved_at=float(raw.get("moved_at") or 0.0), reason=raw.get("reason", ""),
                   decided_by=raw.get("decided_by", ""), fencing_token=int(raw.get("fencing_token") or 0),
                   floor=int(raw.get("floor") or -1), pending_version=_int_or_none(raw.get("pending_version")),
                   canary_version=_int_or_none(raw.get("canary_version")),
                   canary_share=float(raw.get("canary_share") or 0.0),
                   anchor_version=_int_or_none(raw.get("anchor_version")),
                   canary_workers=_workers(raw.get("canary_workers")))

    def wanted_versions(self) -> set[int]:
        """The versions every replica should hold loaded: serving, pending and canary."""
        return {v for v in (self.version, self.pending_version, self.canary_version) if v is not None and v > 0}


@dataclass(frozen=True)
class WantedVersions:
    """The versions the serving pointer asks the fleet to hold (each None when unset; also before the first
    promotion, when only ``pending`` may be set). ``anchor``: the gate's anchor, kept loaded beside the others (LoRA)
    so each decision can measure it again. ``canary_workers``: the serve replicas a full-weights canary runs on
    (empty for a LoRA canary, which every replica loads beside serving)."""

    serving: int | None = None
    pending: int | None = None
    canary: int | None = None
    anchor: int | None = None
    canary_workers: tuple[str, ...] = ()

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> "WantedVersions":
        def version(name: str) -> int | None:  # 0 is a version too: the base weights (rollback --to 0)
            value = _int_or_none(raw.get(name))
            return value if value is not None and value >= 0 else None

        return cls(version("version"), version("pending_version"), version("canary_version"),
                   version("anchor_version"), _workers(raw.get("canary_workers")))

    def all(self) -> set[int]:
        """Every version set: what replicas keep loaded (LoRA versions side by side)."""
        return {v for v in (self.serving, self.pending, self.canary, self.anchor) if v is not None}


@dataclass(frozen=True)
class ArmStats:
    """One arm's online rewards: count, mean and the sum of squared deviations from the mean (Welford's ``m2``)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0


@dataclass(frozen=True)
class CanaryState:
    """What the gate needs to resume a running canary's sequential test after a restart: the candidate, the version
    it is tested against, its share, when it started, each arm's statistics, the rewards left out as invalid, whether
    it is held for an operator, the offline figures it started on (for its decision records), and its files (for the
    move that finishes it)."""

    version: int
    serving: int
    share: float
    started_at: float
    canary: ArmStats = field(default_factory=ArmStats)
    serving_arm: ArmStats = field(default_factory=ArmStats)
    invalid_rewards: int = 0
    held: bool = False
    candidate_metrics: dict[str, float] = field(default_factory=dict)
    serving_metrics: dict[str, float] = field(default_factory=dict)
    uri: str = ""
    sha256: str = ""

    def to_hash(self) -> dict[str, str]:
        """The Redis hash's fields (:meth:`from_hash` reads them back; floats by ``repr``, exact)."""
        out = {"version": str(self.version), "serving": str(self.serving), "share": repr(self.share),
               "started_at": repr(self.started_at), "invalid_rewards": str(self.invalid_rewards),
               "held": "1" if self.held else "0", "candidate_metrics": json.dumps(self.candidate_metrics),
               "serving_metrics": json.dumps(self.serving_metrics), "uri": self.uri, "sha256": self.sha256}
        for name, arm in (("canary", self.canary), ("serving_arm", self.serving_arm)):
            out.update({f"{name}_count": str(arm.count), f"{name}_mean": repr(arm.mean), f"{name}_m2": repr(arm.m2)})
        return out

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> "CanaryState | None":
        if "version" not in raw:
            return None
        try:
            def arm(name: str) -> ArmStats:
                return ArmStats(int(raw[f"{name}_count"]), float(raw[f"{name}_mean"]), float(raw[f"{name}_m2"]))

            return cls(int(raw["version"]), int(raw["serving"]), float(raw["share"]), float(raw["started_at"]),
                       arm("canary"), arm("serving_arm"), int(raw.get("invalid_rewards") or 0), raw.get("held") == "1",
                       {str(k): float(v) for k, v in json.loads(raw.get("candidate_metrics") or "{}").items()},
                       {str(k): float(v) for k, v in json.loads(raw.get("serving_metrics") or "{}").items()},
                       raw.get("uri", ""), raw.get("sha256", ""))
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            log.warning("unreadable canary state ignored", error=str(exc))
            return None


#: Replica roles (``inference.role``): ``serve`` replicas take production traffic and count in the fleet rule;
#: ``evaluate`` replicas load every candidate for the gate and do neither.
ROLE_SERVE = "serve"
ROLE_EVALUATE = "evaluate"


@dataclass(frozen=True)
class ReplicaAck:
    """One sync worker's acknowledgement (its heartbeat hash): what its server has loaded, read back from
    ``/v1/models``. ``loaded`` maps each version to the model name the server answers it by (0 = base weights);
    ``failed`` maps a version that did not load to the error. ``role``: ``serve`` or ``evaluate``
    (``inference.role``; a hash without it is ``serve``); ``follows``: the replica's ``inference.full_weights_follow``
    (``newest`` or ``serving``)."""

    worker_id: str
    version: int
    name: str
    url: str = ""
    loaded: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    heartbeat_at: float = 0.0
    role: str = ROLE_SERVE
    follows: str = "newest"

    def to_hash(self, heartbeat_at: float) -> dict[str, str]:
        """The heartbeat hash's fields (:meth:`from_hash` reads them back)."""
        return {"version": str(self.version), "name": self.name, "heartbeat_at": repr(heartbeat_at), "url": self.url,
                "loaded": json.dumps({str(k): v for k, v in self.loaded.items()}),
                "failed": json.dumps({str(k): v for k, v in self.failed.items()}), "role": self.role,
                "follows": self.follows}

    @property
    def serves(self) -> bool:
        """Whether the replica takes production traffic (and counts in the fleet rule)."""
        return self.role != ROLE_EVALUATE

    @classmethod
    def from_hash(cls, worker_id: str, raw: dict[str, str]) -> "ReplicaAck":
        def versions(text: str | None) -> dict[int, str]:
            try:
                data = json.loads(text or "{}")
                return {int(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
            except (ValueError, TypeError):
                return {}

        version = int(raw.get("version") or 0)
        loaded = versions(raw.get("loaded"))
        if "loaded" not in raw and "version" in raw:  # a worker that does not read back: what it claims
            loaded = {version: raw.get("name", "")}
        return cls(worker_id=worker_id, version=version, name=raw.get("name", ""), url=raw.get("url", ""),
                   loaded=loaded, failed=versions(raw.get("failed")),
                   heartbeat_at=float(raw.get("heartbeat_at") or 0.0), role=raw.get("role") or ROLE_SERVE,
                   follows=raw.get("follows") or "newest")


#: The fields of a replica's hash while its server is down (:meth:`ServingControl.mark_replica_down`).
DOWN_FIELDS = ("down", "down_at")


def staleness_reference(latest: int | None, serving: int | None) -> int | None:
    """The version data is judged stale against (``behaviour < reference - max_policy_lag``): the learner's
    ``latest``, or, while a promotion gate holds ``serving`` behind it, the serving version. The rollout can only
    sample what serves: judged against the learner, everything a gate that rejected a candidate leaves serving would be
    stale, and the learner, with nothing it may train, would never make the next candidate."""
    if latest is None or serving is None:
        return latest
    return min(latest, serving)


def canary_replicas(worker_ids: list[str], share: float) -> tuple[str, ...]:
    """The serve replicas a full-weights canary runs on (one set of full weights per server): ``round(share x n)`` of
    them, at least one and never all (the others keep serving), chosen by a stable hash of their ids; ``()`` when
    fewer than two replicas serve (no canary can run beside serving)."""
    ids = sorted(set(worker_ids))
    if len(ids) < 2 or share <= 0:
        return ()
    count = min(len(ids) - 1, max(1, round(share * len(ids))))
    ranked = sorted(ids, key=lambda w: hashlib.blake2b(w.encode(), digest_size=8).digest())
    return tuple(sorted(ranked[:count]))


def serve_replicas(replicas: list[ReplicaAck]) -> list[ReplicaAck]:
    """The replicas that take production traffic (``evaluate`` replicas left out)."""
    return [r for r in replicas if r.serves]


@dataclass(frozen=True)
class FleetReadiness:
    """Whether ``version`` may serve: ``ready`` with the replicas that have it, or the reason it may not."""

    version: int
    ready: bool
    reason: str
    loaded_on: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)


def fleet_readiness(replicas: list[ReplicaAck], version: int) -> FleetReadiness:
    """The fleet rule: ready when at least one serve replica is alive and every alive serve replica acknowledged
    ``version``.

    ``replicas`` are the alive ones (a replica whose heartbeat expired is no longer listed: it is excluded);
    ``evaluate`` replicas never take production traffic and are left out.
    """
    replicas = serve_replicas(replicas)
    if not replicas:
        return FleetReadiness(version, False,
                              "no inference replica is alive that serves (no heartbeat of a serve replica)")
    loaded = tuple(sorted(r.worker_id for r in replicas if version in r.loaded))
    missing = tuple(sorted(r.worker_id for r in replicas if version not in r.loaded))
    failed = {r.worker_id: r.failed[version] for r in replicas if version in r.failed and version not in r.loaded}
    if not missing:
        return FleetReadiness(version, True, f"loaded on every alive replica ({', '.join(loaded)})", loaded)
    parts = [f"{wid} failed to load it: {error}" for wid, error in sorted(failed.items())]
    waiting = [wid for wid in missing if wid not in failed]
    if waiting:
        parts.append(f"not yet loaded on {', '.join(waiting)}")
    return FleetReadiness(version, False, f"version {version}: " + "; ".join(parts), loaded, missing, failed)


# KEYS: serving, fencing counter. ARGV: mode, version, token, expected ('' = any), uri, sha256, now, reason, decided_by
# Returns 1 moved, -1 fenced, -2 conflict, -3 not forward/backward.
_MOVE_LUA = """
local token = tonumber(ARGV[3])
local issued = tonumber(redis.call('GET', KEYS[2]) or '0')
local held = tonumber(redis.call('HGET', KEYS[1], 'fencing_token') or '0')
if token < 1 or token > issued or token < held then return -1 end
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
if ARGV[4] ~= '' and tonumber(ARGV[4]) ~= current then return -2 end
local version = tonumber(ARGV[2])
local floor = tonumber(redis.call('HGET', KEYS[1], 'floor') or '-1')
local mode = ARGV[1]
if mode == 'forward' then
  if version <= current or version <= floor then return -3 end
elseif mode == 'rollback' then
  if current < 0 or version >= current then return -3 end
  if current > floor then redis.call('HSET', KEYS[1], 'floor', current) end
elseif mode == 'force' then
  if version == current then return -3 end
  if version < current and current > floor then redis.call('HSET', KEYS[1], 'floor', current) end
end
if mode ~= 'forward' then redis.call('HDEL', KEYS[1], 'canary_version', 'canary_share', 'canary_workers') end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'uri', ARGV[5], 'sha256', ARGV[6], 'moved_at', ARGV[7],
           'reason', ARGV[8], 'decided_by', ARGV[9], 'fencing_token', ARGV[3])
if redis.call('HGET', KEYS[1], 'pending_version') == ARGV[2] then redis.call('HDEL', KEYS[1], 'pending_version') end
return 1
"""
# KEYS: session pin. ARGV: the version to pin when none is, ttl seconds. The pinned version (TTL refreshed).
_PIN_LUA = """
local held = redis.call('GET', KEYS[1])
if held then redis.call('EXPIRE', KEYS[1], ARGV[2]) return held end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return ARGV[1]
"""
# KEYS: serving, fencing counter. ARGV: token, then field/value pairs ('' value = delete the field). 1 or -1 fenced.
_FIELDS_LUA = """
local token = tonumber(ARGV[1])
local issued = tonumber(redis.call('GET', KEYS[2]) or '0')
local held = tonumber(redis.call('HGET', KEYS[1], 'fencing_token') or '0')
if token < 1 or token > issued or token < held then return -1 end
for i = 2, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i]) else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 1
"""


class ServingControl:
    """The serving pointer of every policy and the replicas' acknowledgements, over a :class:`ControlPlane`
    (whose retries while Redis is unreachable apply)."""

    def __init__(self, control: ControlPlane) -> None:
        self.control = control

    @property
    def redis(self) -> Any:
        return self.control.redis

    # -- the pointer -------------------------------------------------------------------
    async def serving(self, policy: str) -> ServingPointer | None:
        """The serving pointer, None before the first promotion."""
        raw = await self.control._retry("serving", lambda: self.redis.hgetall(serving_key(policy)))
        return ServingPointer.from_hash(raw or {})

    async def wanted_versions(self, policy: str) -> set[int]:
        """The versions every replica should hold loaded: serving, pending (also before the first promotion) and
        canary."""
        return (await self.wanted(policy)).all()

    async def wanted(self, policy: str) -> WantedVersions:
        """The serving, pending and canary versions, each on its own (see :class:`WantedVersions`)."""
        raw = await self.control._retry("serving", lambda: self.redis.hgetall(serving_key(policy))) or {}
        return WantedVersions.from_hash(raw)

    async def issue_token(self, policy: str) -> int:
        """A new serving fencing token (greater than every one issued before): take one per decision."""
        return int(await self.control._retry("serving_token", lambda: self.redis.incr(serving_fencing_key(policy))))

    async def move(self, policy: str, version: int, *, kind: MoveKind, token: int, reason: str, decided_by: str,
                   expected_version: int | None = None, uri: str = "", sha256: str = "") -> ServingPointer:
        """Move the pointer to ``version`` (a fenced compare-and-set; see the module docstring) and return it.

        Raises :class:`ServingFenced`, :class:`ServingConflict` (``expected_version`` given, -1 = no pointer yet,
        and the pointer elsewhere) or :class:`NotForward`. Does not look at the fleet: see
        :func:`move_serving_when_loaded`.
        """
        expected = "" if expected_version is None else str(expected_version)
        result = int(await self.control._retry("move_serving", lambda: self.redis.eval(
            _MOVE_LUA, 2, serving_key(policy), serving_fencing_key(policy), kind.value, str(version), str(token),
            expected, uri, sha256, str(time.time()), reason, decided_by)))
        if result == -1:
            raise ServingFenced(f"serving pointer of {policy!r} not moved to {version}: fencing token {token} is "
                                "older than the last move's, or was never issued")
        if result == -2:
            current = await self.serving(policy)
            raise ServingConflict(f"serving pointer of {policy!r} is at {current.version if current else None}, "
                                  f"not at the expected {expected_version}")
        if result == -3:
            current = await self.serving(policy)
            where = f"at {current.version} (floor {current.floor})" if current else "unset"
            raise NotForward(f"serving pointer of {policy!r} ({where}) cannot make a {kind.value} move to {version}")
        pointer = await self.serving(policy)
        assert pointer is not None
        log.info("serving pointer moved", policy=policy, version=version, kind=kind.value, token=token,
                 reason=reason, decided_by=decided_by)
        return pointer

    async def promote(self, policy: str, version: int, *, token: int, reason: str, decided_by: str,
                      expected_version: int | None = None, uri: str = "", sha256: str = "") -> ServingPointer:
        """Move forward (see :meth:`move`)."""
        return await self.move(policy, version, kind=MoveKind.forward, token=token, reason=reason,
                               decided_by=decided_by, expected_version=expected_version, uri=uri, sha256=sha256)

    async def rollback(self, policy: str, version: int, *, token: int, reason: str, decided_by: str,
                       expected_version: int | None = None, uri: str = "", sha256: str = "") -> ServingPointer:
        """The only backward move: to an older ``version``; the version left becomes the floor (see :meth:`move`)."""
        return await self.move(policy, version, kind=MoveKind.rollback, token=token, reason=reason,
                               decided_by=decided_by, expected_version=expected_version, uri=uri, sha256=sha256)

    async def _set_fields(self, policy: str, token: int, fields: dict[str, str]) -> None:
        args = [str(token)] + [item for pair in fields.items() for item in pair]
        result = int(await self.control._retry("serving_fields", lambda: self.redis.eval(
            _FIELDS_LUA, 2, serving_key(policy), serving_fencing_key(policy), *args)))
        if result == -1:
            raise ServingFenced(f"serving pointer of {policy!r} not changed: fencing token {token} is older than "
                                "the last move's, or was never issued")

    async def request_load(self, policy: str, version: int | None, token: int) -> None:
        """Ask every replica to load ``version`` (``pending_version``; None clears it). Fenced like a move."""
        await self._set_fields(policy, token, {"pending_version": "" if version is None else str(version)})

    async def set_anchor(self, policy: str, version: int, token: int) -> None:
        """Record the gate's anchor (the best version promoted) on the pointer: replicas keep it loaded and a
        restarted gate reads it back. Fenced like a move."""
        await self._set_fields(policy, token, {"anchor_version": str(version)})

    async def set_canary(self, policy: str, version: int | None, share: float, token: int,
                         workers: tuple[str, ...] = ()) -> None:
        """Start (or end, with ``version`` None) a canary: ``share`` of new sessions go to ``version``; ``workers``:
        the serve replicas a full-weights canary runs on (the others keep serving)."""
        if version is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"canary share {share} is not within [0, 1]")
        if any("," in w for w in workers):
            raise ValueError(f"a worker id of {workers} holds a comma")
        await self._set_fields(policy, token, {"canary_version": "" if version is None else str(version),
                                               "canary_share": "" if version is None else repr(share),
                                               "canary_workers": "" if version is None else ",".join(workers)})

    # -- the canary's test state ---------------------------------------------------------
    async def save_canary_state(self, policy: str, state: "CanaryState") -> None:
        """Write the running canary's test state (a restarted gate resumes the test from it)."""
        mapping = state.to_hash()
        await self.control._retry("save_canary", lambda: self.redis.hset(canary_state_key(policy), mapping=mapping))

    async def canary_state(self, policy: str) -> "CanaryState | None":
        """The saved canary test state, or None (none saved, or unreadable)."""
        raw = await self.control._retry("canary_state", lambda: self.redis.hgetall(canary_state_key(policy)))
        return CanaryState.from_hash(raw or {})

    async def clear_canary_state(self, policy: str) -> None:
        """Forget the canary's test state (the canary ended)."""
        await self.control._retry("clear_canary", lambda: self.redis.delete(canary_state_key(policy)))

    # -- sessions ----------------------------------------------------------------------
    async def pin_session(self, policy: str, session_id: str, version: int, ttl_s: float,
                          replace: bool = False) -> int:
        """The version ``session_id`` is pinned to: the one pinned before (its expiry renewed), else ``version``
        (pinned now). ``replace`` pins ``version`` whatever was pinned. Shared by every gateway."""
        key, ttl = session_pin_key(policy, session_id), str(max(1, int(ttl_s)))
        if replace:
            await self.control._retry("pin_session", lambda: self.redis.set(key, str(version), ex=int(ttl)))
            return version
        held = await self.control._retry("pin_session", lambda: self.redis.eval(_PIN_LUA, 1, key, str(version), ttl))
        return int(held)

    # -- evaluation holds ----------------------------------------------------------------
    async def hold_for_evaluation(self, policy: str, worker_id: str, version: int, ttl_s: float,
                                  holder: str) -> None:
        """Ask replica ``worker_id`` to keep ``version`` loaded for ``ttl_s`` at most on behalf of ``holder`` (an
        evaluation: the gate's, or ``rlstream up``'s held-out scoring). Holds of several holders stand side by side:
        no replica trims a held version away as a LoRA adapter, and an ``evaluate`` replica loads no newer
        full-weights candidate over the one it holds."""
        key, ttl = evaluation_hold_key(policy, worker_id), max(1, int(ttl_s))
        member = f"{version}|{holder}"

        async def call() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zremrangebyscore(key, "-inf", time.time())  # the holders prune: the replicas only read
                pipe.zadd(key, {member: time.time() + ttl})
                pipe.expire(key, ttl, gt=True)
                pipe.expire(key, ttl, nx=True)
                await pipe.execute()
        await self.control._retry("hold_for_evaluation", call)

    @contextlib.asynccontextmanager
    async def held_for_evaluation(self, policy: str, worker_id: str, version: int,
                                  ttl_s: float) -> AsyncIterator[None]:
        """:meth:`hold_for_evaluation` for the ``async with`` block under a holder of its own, released when it
        ends (also on an error); another holder's hold stays."""
        holder = uuid.uuid4().hex
        await self.hold_for_evaluation(policy, worker_id, version, ttl_s, holder)
        try:
            yield
        finally:
            await self.release_evaluation(policy, worker_id, version, holder)

    async def release_evaluation(self, policy: str, worker_id: str, version: int, holder: str) -> None:
        """End ``holder``'s hold of ``version`` (:meth:`hold_for_evaluation`)."""
        key = evaluation_hold_key(policy, worker_id)
        await self.control._retry("release_evaluation", lambda: self.redis.zrem(key, f"{version}|{holder}"))

    async def evaluation_holds(self, policy: str, worker_id: str) -> set[int]:
        """The versions held on ``worker_id`` for evaluations now (expired holds and members that are not
        ``<version>|<holder>`` are ignored). Only reads: a sync worker's Redis user may write its heartbeat alone
        (docs/security.md)."""
        key = evaluation_hold_key(policy, worker_id)

        async def call() -> list[Any]:
            return list(await self.redis.zrangebyscore(key, time.time(), "+inf"))
        try:
            members = await self.control._retry("evaluation_holds", call)
        except redis_errors.ResponseError:  # not a sorted set: written by something else, holds nothing
            return set()
        held: set[int] = set()
        for raw in members:
            version = (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split("|", 1)[0]
            if version.isdigit() and len(version) <= 18:
                held.add(int(version))
        return held

    # -- the fleet ---------------------------------------------------------------------
    async def record_replica(self, policy: str, ack: ReplicaAck, ttl_s: float) -> None:
        """A sync worker's heartbeat with its acknowledgement (the hash expires ``ttl_s`` after the last one)."""
        key = worker_key(policy, ack.worker_id)
        mapping = ack.to_hash(heartbeat_at=time.time())

        async def call() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=mapping)
                pipe.hdel(key, *DOWN_FIELDS)
                pipe.expire(key, max(1, int(ttl_s)))
                await pipe.execute()

        await self.control._retry("record_replica", call)

    async def mark_replica_down(self, policy: str, worker_id: str, reason: str, ttl_s: float) -> None:
        """Take a replica out of routing at once (its server stopped answering): the heartbeat field goes, so
        :meth:`replicas` no longer counts it, and ``down``/``down_at`` say why until its next heartbeat."""
        key = worker_key(policy, worker_id)

        async def call() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hdel(key, "heartbeat_at")
                pipe.hset(key, mapping={"down": reason, "down_at": repr(time.time())})
                pipe.expire(key, max(1, int(ttl_s)))
                await pipe.execute()

        await self.control._retry("mark_replica_down", call)

    async def replicas(self, policy: str) -> list[ReplicaAck]:
        """The alive replicas (heartbeat not expired) with what each acknowledged, of every role."""
        workers = await self.control.workers(policy)
        # a hash without a heartbeat (only a failure written after it expired) is no alive replica
        return [ReplicaAck.from_hash(wid, raw) for wid, raw in sorted(workers.items()) if raw.get("heartbeat_at")]

    async def serve_replicas(self, policy: str) -> list[ReplicaAck]:
        """The alive replicas that take production traffic (``evaluate`` replicas left out)."""
        return serve_replicas(await self.replicas(policy))

    async def readiness(self, policy: str, version: int) -> FleetReadiness:
        """The fleet rule (:func:`fleet_readiness`) over the alive serve replicas."""
        return fleet_readiness(await self.replicas(policy), version)


@dataclass(frozen=True)
class MoveOutcome:
    """What :func:`move_serving_when_loaded` did: ``moved`` with the new pointer, or ``reason`` why not."""

    moved: bool
    reason: str
    pointer: ServingPointer | None
    readiness: FleetReadiness | None = None
    decision: PromotionDecision | None = None


async def publish_decision(producer: Any, codec: AvroCodec, topic: str, decision: PromotionDecision) -> None:
    """Write one decision to the ``promotions`` topic (keyed by policy) and wait for the broker's acknowledgement."""
    await producer.send_and_wait(topic, codec.encode(decision), key=decision.policy.encode())


async def move_serving_when_loaded(
    serving: ServingControl, policy: str, version: int, *, decision: DecisionKind, reason: str, decided_by: str,
    token: int | None = None, expected_version: int | None = None, uri: str = "", sha256: str = "",
    timeout_s: float = 120.0, poll_s: float = 0.5, producer: Any = None, codec: AvroCodec | None = None,
    topic: str | None = None, candidate_metrics: dict[str, float] | None = None,
    serving_metrics: dict[str, float] | None = None,
) -> MoveOutcome:
    """Move serving to ``version`` once every alive replica has it loaded (:func:`fleet_readiness`).

    Asks the fleet to load it (``pending_version``), waits up to ``timeout_s``, then makes the move ``decision``
    calls for (``promote``/``finish_canary`` forward, ``rollback`` back, ``force_promote`` either way) with
    ``token`` (a new one when None). With ``producer``, ``codec`` and ``topic`` the decision is recorded on
    ``promotions`` once the pointer moved. Never raises for a refusal: returns ``moved=False`` and the reason
    (the fleet not ready, fenced, a conflict, not forward); a pending request it made is withdrawn then.
    """
    kind = MOVE_OF_DECISION.get(decision)
    if kind is None:
        raise ValueError(f"a {decision.value} decision does not move the serving pointer")
    token = token if token is not None else await serving.issue_token(policy)
    before = await serving.serving(policy)
    try:
        await serving.request_load(policy, version, token)
    except ServingMoveRefused as exc:
        return MoveOutcome(False, str(exc), before)
    deadline = time.monotonic() + timeout_s
    readiness = await serving.readiness(policy, version)
    while not readiness.ready and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
        readiness = await serving.readiness(policy, version)
    if not readiness.ready:
        await _withdraw(serving, policy, version, token)
        log.warning("serving pointer not moved: the fleet has not loaded the version", policy=policy,
                    version=version, reason=readiness.reason)
        return MoveOutcome(False, readiness.reason, before, readiness)
    try:
        pointer = await serving.move(policy, version, kind=kind, token=token, reason=reason, decided_by=decided_by,
                                     expected_version=expected_version, uri=uri, sha256=sha256)
    except ServingMoveRefused as exc:
        await _withdraw(serving, policy, version, token)
        return MoveOutcome(False, str(exc), before, readiness)
    record = PromotionDecision(policy=policy, version=version, decision=decision, reason=reason,
                               serving_before=before.version if before else None,
                               candidate_metrics=candidate_metrics or {}, serving_metrics=serving_metrics or {},
                               decided_by=decided_by, fencing_token=token)
    if producer is not None and codec is not None and topic is not None:
        await publish_decision(producer, codec, topic, record)
    return MoveOutcome(True, readiness.reason, pointer, readiness, record)


async def _withdraw(serving: ServingControl, policy: str, version: int, token: int) -> None:
    """Clear ``pending_version`` when it still names ``version`` (a newer decision's request stays)."""
    raw = await serving.control._retry("serving", lambda: serving.redis.hgetall(serving_key(policy))) or {}
    if _int_or_none(raw.get("pending_version")) == version:
        try:
            await serving.request_load(policy, None, token)
        except ServingMoveRefused:
            pass
