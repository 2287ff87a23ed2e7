"""The Redis control plane (DESIGN.md, Redis): latest version pointer, learner lease, worker heartbeats, run status.

Kafka is the data plane; nothing here is the only copy of data. Every call retries with
exponential backoff while Redis is unreachable and says so in the logs.
"""
from __future__ import annotations

import asyncio
import math
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, AuthorizationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlstream.schemas.config import valid_worker_id
from rlstream.schemas.masking import mask_url
from rlstream.transport.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")


def latest_key(policy: str) -> str:
    return f"rlstream:{policy}:latest"


def lease_key(policy: str) -> str:
    return f"rlstream:{policy}:learner"


def fencing_counter_key(policy: str) -> str:
    return f"rlstream:{policy}:learner:fencing"


def announcements_key(policy: str) -> str:
    """Hash of the policy's version announcements: sha256 of the record's bytes -> :class:`Announcement` fields."""
    return f"rlstream:{policy}:announcements"


def learner_waiting_key(policy: str) -> str:
    """How long the policy's learner has been waiting for groups (seconds, refreshed while it waits; expires)."""
    return f"rlstream:{policy}:learner:waiting"


def worker_key(policy: str, worker_id: str) -> str:
    return f"rlstream:{policy}:worker:{worker_id}"


def tenant_map_keys(policy: str, namespace: str, tenant: str) -> tuple[str, str]:
    """(entries hash, order sorted set) of one tenant's bounded map ``namespace`` (a gateway's shared ids)."""
    base = f"rlstream:{policy}:gateway:{namespace}:{tenant}"
    return base + ":entries", base + ":order"


def status_key(run_id: str) -> str:
    return f"rlstream:{run_id}:status"


class ControlPlaneRefused(RuntimeError):
    """Redis answered but refused this client: wrong password or user, no permission, or a TLS certificate this
    client does not trust. Not retried: no wait fixes it."""


def _plaintext_hint(url: str, exc: BaseException) -> dict[str, str]:
    """A hint for the log when a plain ``redis://`` connection was reset: what a TLS-only server does."""
    if url.startswith("redis://") and isinstance(exc.__context__, ConnectionResetError):
        return {"hint": "a server that listens only with TLS resets plain connections: use rediss://"}
    return {}


class LeaseLost(RuntimeError):
    """This learner no longer holds the lease (another took it, or it expired)."""


# Moves the pointer only forward, and only for the current lease holder when a fence is given.
_PUBLISH_LUA = """
local fence = ARGV[5]
if fence ~= '' then
  if redis.call('GET', KEYS[2]) ~= fence then return -1 end
end
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
if tonumber(ARGV[1]) <= current then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'uri', ARGV[2], 'sha256', ARGV[3], 'published_at', ARGV[4])
return 1
"""
# An announcement is registered (pending) before the learner's Kafka transaction and confirmed (committed) after its
# commit, each only while the lease is held: a record counts once its announcement is committed.
_REGISTER_LUA = """
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return -1 end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held and string.sub(held, 1, 10) == 'committed|' then return 1 end
redis.call('HSET', KEYS[1], ARGV[1], 'pending|' .. ARGV[2] .. '|' .. ARGV[3])
return 1
"""
_CONFIRM_LUA = """
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return -1 end
if redis.call('HGET', KEYS[1], ARGV[1]) ~= 'pending|' .. ARGV[2] .. '|' .. ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], 'committed|' .. ARGV[2] .. '|' .. ARGV[3])
return 1
"""
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# A tenant's bounded map: a hash of entries and a sorted set of the time each was put (Redis's clock, ms). A put
# drops the entries older than the TTL and then the tenant's oldest beyond its capacity (returns how many of those);
# a get ignores an entry older than the TTL. Both keys expire a TTL after the tenant's last put.
_TENANT_PUT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], now, ARGV[i])
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - ttl))
local left = redis.call('ZCARD', KEYS[2]) - #gone
local over = {}
if left > cap then over = redis.call('ZRANGE', KEYS[2], #gone, #gone + left - cap - 1) end
for _, name in ipairs(gone) do redis.call('HDEL', KEYS[1], name) end
for _, name in ipairs(over) do redis.call('HDEL', KEYS[1], name) end
if #gone + #over > 0 then redis.call('ZREMRANGEBYRANK', KEYS[2], 0, #gone + #over - 1) end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return #over
"""
_TENANT_GET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local put = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not put or tonumber(put) < now - tonumber(ARGV[2]) then return false end
return redis.call('HGET', KEYS[1], ARGV[1])
"""


@dataclass(frozen=True)
class Lease:
    holder: str
    token: int

    @property
    def value(self) -> str:
        return f"{self.holder}|{self.token}"


@dataclass(frozen=True)
class Announcement:
    """What the control plane holds about one announced PolicyVersion record (by the sha256 of its bytes):
    ``committed`` once its learner confirmed the Kafka commit, else pending; the lease it was announced under."""

    committed: bool
    version: int
    lease: str

    @property
    def fencing_token(self) -> int:
        return int(self.lease.rsplit("|", 1)[1])

    @classmethod
    def parse(cls, raw: str) -> "Announcement":
        state, version, lease = raw.split("|", 2)
        return cls(state == "committed", int(version), lease)


class ControlPlane:
    """Async access to rlstream's Redis keys."""

    def __init__(self, url: str, retry_max_s: float = 300.0) -> None:
        self.url = url
        self.retry_max_s = retry_max_s
        self.redis: aioredis.Redis = aioredis.from_url(url, decode_responses=True, socket_timeout=5.0)
        self._tenant_put_script = self.redis.register_script(_TENANT_PUT_LUA)
        self._tenant_get_script = self.redis.register_script(_TENANT_GET_LUA)
        self._ignored_workers: set[str] = set()  # heartbeat keys left out (logged once each)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]], patience_s: float | None = None) -> T:
        """``call()``, retried while Redis is unreachable for up to ``patience_s`` (default ``retry_max_s``)."""
        delay, waited = 0.1, 0.0
        limit = self.retry_max_s if patience_s is None else patience_s
        while True:
            try:
                return await call()
            except (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError) as exc:
                # a subclass of ConnectionError in redis-py, but no retry can fix a wrong password
                log.error("redis refused the credentials", op=what, url=self.url, error=str(exc))
                raise ControlPlaneRefused(f"redis at {mask_url(self.url)} refused the credentials ({exc}): check "
                                          "the password (and user) in redis.url") from exc
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if isinstance(exc.__context__, ssl.SSLCertVerificationError):
                    log.error("redis certificate not trusted", op=what, url=self.url, error=str(exc))
                    raise ControlPlaneRefused(f"redis at {mask_url(self.url)}: TLS certificate not trusted ({exc}): "
                                              "name the CA that signed it with ?ssl_ca_certs=FILE in redis.url"
                                              ) from exc
                if waited >= limit:
                    log.error("redis unreachable, giving up", op=what, url=self.url, waited_s=round(waited, 1))
                    raise
                pause = delay * random.uniform(0.5, 1.5)  # jitter: restarted services do not retry in step
                log.warning("redis unreachable, retrying", op=what, url=self.url, error=str(exc),
                            retry_in_s=round(pause, 2), waited_s=round(waited, 1), **_plaintext_hint(self.url, exc))
                await asyncio.sleep(pause)
                waited += pause
                delay = min(delay * 2, 5.0)

    # -- latest version ----------------------------------------------------------------
    async def latest(self, policy: str) -> dict[str, str] | None:
        data = await self._retry("latest", lambda: self.redis.hgetall(latest_key(policy)))
        return data or None

    async def latest_version(self, policy: str) -> int:
        """The latest published version, -1 when none was published."""
        data = await self.latest(policy)
        return int(data["version"]) if data else -1

    async def publish_latest(self, policy: str, version: int, uri: str, sha256: str, lease: Lease | None = None) -> bool:
        """Compare-and-set the latest pointer: True if moved; False if ``version`` is not newer.

        With ``lease``, raises :class:`LeaseLost` unless that lease is still held (fencing).
        """
        fence = lease.value if lease else ""
        result = await self._retry(
            "publish_latest",
            lambda: self.redis.eval(_PUBLISH_LUA, 2, latest_key(policy), lease_key(policy),
                                    str(version), uri, sha256, str(time.time()), fence),
        )
        if int(result) == -1:
            raise LeaseLost(f"learner lease for policy {policy!r} is not held by {fence}; refusing to publish")
        return int(result) == 1

    # -- announcements -----------------------------------------------------------------
    async def register_announcement(self, policy: str, record_sha256: str, version: int, lease: Lease) -> None:
        """Record a PolicyVersion record as pending (about to be sent in the learner's Kafka transaction); raises
        :class:`LeaseLost` unless ``lease`` is held."""
        result = await self._retry("register_announcement", lambda: self.redis.eval(
            _REGISTER_LUA, 2, announcements_key(policy), lease_key(policy), record_sha256, str(version), lease.value))
        if int(result) == -1:
            raise LeaseLost(f"learner lease for policy {policy!r} is not held by {lease.value}; not announced")

    async def confirm_announcement(self, policy: str, record_sha256: str, version: int, lease: Lease) -> None:
        """Mark a registered record committed (its Kafka transaction committed); raises :class:`LeaseLost` unless
        ``lease`` is held and registered it."""
        result = await self._retry("confirm_announcement", lambda: self.redis.eval(
            _CONFIRM_LUA, 2, announcements_key(policy), lease_key(policy), record_sha256, str(version), lease.value))
        if int(result) != 1:
            raise LeaseLost(f"announcement of version {version} of {policy!r} not confirmed: the lease is not held by "
                            f"{lease.value}, or it did not register the record")

    async def announcement(self, policy: str, record_sha256: str) -> Announcement | None:
        """The registered announcement of a record (by the sha256 of its bytes), None when never registered."""
        raw = await self._retry("announcement", lambda: self.redis.hget(announcements_key(policy), record_sha256))
        try:
            return Announcement.parse(raw) if raw else None
        except ValueError:  # not written by register_announcement: no announcement
            log.warning("malformed announcement entry ignored", policy=policy, record_sha256=record_sha256)
            return None

    async def fencing_tokens_issued(self, policy: str) -> int:
        """The newest fencing token ever issued for ``policy`` (0 when none): no genuine record carries a larger one."""
        raw = await self._retry("fencing", lambda: self.redis.get(fencing_counter_key(policy)))
        return int(raw or 0)

    # -- learner lease -----------------------------------------------------------------
    async def acquire_lease(self, policy: str, holder: str, ttl_s: float) -> Lease | None:
        """Take the learner lease if free; returns it with a new fencing token, else None."""
        token = await self._retry("fencing", lambda: self.redis.incr(fencing_counter_key(policy)))
        lease = Lease(holder, int(token))
        ok = await self._retry("acquire_lease", lambda: self.redis.set(lease_key(policy), lease.value, nx=True,
                                                                     px=int(ttl_s * 1000)))
        return lease if ok else None

    async def wait_for_lease(self, policy: str, holder: str, ttl_s: float, poll_s: float = 1.0) -> Lease:
        """Block until the lease is ours (a second learner waits here)."""
        logged = False
        while True:
            lease = await self.acquire_lease(policy, holder, ttl_s)
            if lease:
                log.info("learner lease acquired", policy=policy, holder=holder, fencing_token=lease.token)
                return lease
            if not logged:
                log.info("learner lease held by another learner; waiting", policy=policy,
                         holder=await self.lease_holder(policy))
                logged = True
            await asyncio.sleep(poll_s)

    async def renew_lease(self, policy: str, lease: Lease, ttl_s: float, patience_s: float | None = None) -> None:
        """Extend the lease; raises :class:`LeaseLost` when it is not held (anymore) by ``lease``."""
        ok = await self._retry("renew_lease", lambda: self.redis.eval(_RENEW_LUA, 1, lease_key(policy), lease.value,
                                                                    str(int(ttl_s * 1000))), patience_s)
        if not int(ok):
            raise LeaseLost(f"learner lease for policy {policy!r} was lost by {lease.value}")

    async def release_lease(self, policy: str, lease: Lease) -> None:
        await self._retry("release_lease", lambda: self.redis.eval(_RELEASE_LUA, 1, lease_key(policy), lease.value))

    async def lease_holder(self, policy: str) -> str | None:
        return await self._retry("lease_holder", lambda: self.redis.get(lease_key(policy)))

    # -- learner starvation --------------------------------------------------------------
    async def report_learner_waiting(self, policy: str, waited_s: float | None, ttl_s: float,
                                     patience_s: float | None = None) -> None:
        """The learner has read every group there is and has been waiting ``waited_s`` for the next one (None: it
        is training again). The mark expires after ``ttl_s`` unless refreshed, so a learner that died leaves none."""
        key = learner_waiting_key(policy)
        if waited_s is None:
            await self._retry("learner_waiting", lambda: self.redis.delete(key), patience_s)
            return
        await self._retry("learner_waiting",
                          lambda: self.redis.set(key, f"{waited_s:.3f}", px=max(1, int(ttl_s * 1000))), patience_s)

    async def learner_waiting_s(self, policy: str, patience_s: float | None = None) -> float | None:
        """Seconds the policy's learner has been waiting for groups, None when it is not waiting (or not alive)."""
        raw = await self._retry("learner_waiting", lambda: self.redis.get(learner_waiting_key(policy)), patience_s)
        try:
            waited = float(raw) if raw is not None else None
        except ValueError:
            return None
        return waited if waited is not None and math.isfinite(waited) and waited >= 0 else None

    # -- inference workers -------------------------------------------------------------
    async def heartbeat_worker(self, policy: str, worker_id: str, version: int, name: str, ttl_s: float) -> None:
        key = worker_key(policy, worker_id)

        async def call() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping={"version": version, "name": name, "heartbeat_at": time.time()})
                pipe.expire(key, max(1, int(ttl_s)))
                await pipe.execute()

        await self._retry("heartbeat_worker", call)

    async def workers(self, policy: str) -> dict[str, dict[str, str]]:
        """The sync workers' heartbeats: worker id -> its hash. A key under the heartbeat prefix whose id no sync
        worker may take (:func:`valid_worker_id`) is left out: another service's Redis user may write it through a
        pattern of its own (``rlstream:*:status``), and only the sync workers' user writes heartbeats."""
        prefix = worker_key(policy, "")

        async def call() -> dict[str, dict[str, str]]:
            out = {}
            async for key in self.redis.scan_iter(match=prefix + "*"):
                worker_id = key[len(prefix):]
                if not valid_worker_id(worker_id):
                    if worker_id not in self._ignored_workers and len(self._ignored_workers) < 1000:
                        self._ignored_workers.add(worker_id)
                        log.warning("heartbeat key under an id no sync worker may take: ignored", key=key[:200])
                    continue
                out[worker_id] = await self.redis.hgetall(key)
            return out

        return await self._retry("workers", call)

    # -- per-tenant bounded maps (the gateways' shared ids) -------------------------------
    async def tenant_put(self, policy: str, namespace: str, tenant: str, entries: dict[str, str], ttl_s: float,
                         capacity: int, patience_s: float | None = None) -> int:
        """Put ``entries`` (name -> value) in ``tenant``'s map ``namespace``, each kept ``ttl_s``; the tenant's
        oldest entries beyond ``capacity`` are dropped (only its own: each tenant has its own keys). Returns how
        many were dropped for the capacity."""
        if not entries:
            return 0
        keys = tenant_map_keys(policy, namespace, tenant)
        args: list[str | int] = [max(1, int(ttl_s * 1000)), capacity]
        for name, value in entries.items():
            args += [name, value]
        dropped = await self._retry("tenant_put", lambda: self._tenant_put_script(keys=keys, args=args),
                                    patience_s)
        return int(dropped)

    async def tenant_get(self, policy: str, namespace: str, tenant: str, name: str, ttl_s: float,
                         patience_s: float | None = None) -> str | None:
        """The value of ``name`` in ``tenant``'s map ``namespace``; None when absent or older than ``ttl_s``."""
        keys = tenant_map_keys(policy, namespace, tenant)
        value = await self._retry("tenant_get", lambda: self._tenant_get_script(
            keys=keys, args=[name, max(1, int(ttl_s * 1000))]), patience_s)
        return value if isinstance(value, str) else None

    async def tenant_size(self, policy: str, namespace: str, tenant: str) -> int:
        """How many entries ``tenant``'s map ``namespace`` holds (expired ones not yet dropped included)."""
        return int(await self._retry("tenant_size", lambda: self.redis.zcard(
            tenant_map_keys(policy, namespace, tenant)[1])))

    # -- run status --------------------------------------------------------------------
    async def set_status(self, run_id: str, figures: dict[str, Any], patience_s: float | None = None) -> None:
        mapping = {k: str(v) for k, v in figures.items()}
        if mapping:
            await self._retry("set_status", lambda: self.redis.hset(status_key(run_id), mapping=mapping), patience_s)

    async def status(self, run_id: str) -> dict[str, str]:
        return await self._retry("status", lambda: self.redis.hgetall(status_key(run_id)))
