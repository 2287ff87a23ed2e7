"""Which model name to request, and which policy version that is: the serving pointer and the replicas'
acknowledgements (rlstream/transport/serving.py, docs/promotion.md).

Production traffic (the gateway's :class:`FleetRouter`): ``policy`` is the serving version, or the canary for its
share; with no serving pointer (the gate promotes version 0, the base weights, as soon as it sees it) it is nothing:
:class:`NoServingVersion` (the gateway answers 503), never an unevaluated candidate. ``policy@N`` is version N on a
replica that acknowledged loading it; for an N that is neither serving nor the canary the caller needs the
``evaluate`` scope (:class:`VersionForbidden` otherwise). A session pinned to a version stays on it while that
version may serve (serving, canary, or an older promoted version still loaded); one pinned to a version above the
serving one that is not the canary (rolled back) moves to serving at its next call.

Training traffic (:class:`VersionRouter`: the rollout runner, the shadow sampler) goes to the serving version, and,
before any pointer exists (no promotion gate), to the newest version a replica acknowledged.

Only ``serve`` replicas take these requests: an ``evaluate`` replica (``inference.role``) holds candidates for the
promotion gate and is never routed to.
"""
from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

import httpx

from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ReplicaAck, ServingControl, ServingPointer, parse_model_name, serve_replicas


@dataclass(frozen=True)
class Route:
    """Requests for the policy go to ``model``, which serves ``version``; ``url``: the replica's server (empty: the
    caller's configured upstream)."""

    model: str
    version: int
    worker_id: str | None = None
    url: str = field(default="", compare=False)


#: The key scope that may name any version (``policy@N`` for an N that neither serves nor is the canary).
SCOPE_EVALUATE = "evaluate"


def production_version(pointer: ServingPointer | None, replicas: list[ReplicaAck],
                       unpromoted: bool = False) -> int | None:
    """The version ``policy`` means: the serving one; None without a serving pointer. ``unpromoted`` (no promotion
    gate: ``gateway.serve_unpromoted``, and training traffic): without a pointer, the newest version a serve replica
    acknowledged (``evaluate`` replicas do not count)."""
    if pointer is not None:
        return pointer.version
    if not unpromoted:
        return None
    versions = [v for r in serve_replicas(replicas) for v in r.loaded]
    return max(versions) if versions else None


def released(pointer: ServingPointer | None, version: int) -> bool:
    """Whether ``version`` is what ``policy`` serves now: the serving version or the canary (``policy@N`` for any
    other N needs the ``evaluate`` scope)."""
    return pointer is not None and version in (pointer.version, pointer.canary_version)


def production_fallbacks(pointer: ServingPointer) -> list[int]:
    """What production falls back to while no replica holds the serving version, in order of preference: the versions
    below serving known to have been promoted, newest first (the gate's anchor, the best version promoted, unless a
    rollback left it; version 0, the base weights, where serving starts), then the version a decision is moving the
    pointer to (``pending_version``: a promotion waiting for the fleet, or a rollback's target). Any other loaded
    version below serving may have been rejected."""
    anchor = pointer.anchor_version
    below = {0} | ({anchor} if anchor is not None and anchor < pointer.version and anchor != pointer.floor else set())
    pending = [pointer.pending_version] if pointer.pending_version is not None else []
    return sorted(below, reverse=True) + [v for v in pending if v not in below]


def session_may_stay(pointer: ServingPointer | None, version: int) -> bool:
    """Whether a session pinned to ``version`` stays on it: released (:func:`released`) or older than serving (it
    served when the session started). A version above serving that is not the canary was rolled back (or never
    promoted): its sessions move to serving at their next call."""
    return pointer is not None and (version <= pointer.version or version == pointer.canary_version)


class VersionRouter:
    """Routes to the serving version (cached for ``ttl_s``), on a replica that acknowledged loading it.

    Without a serving pointer: the newest version a replica acknowledged. When no replica has the serving version
    loaded, the newest loaded version not above it. Without any worker heartbeat, requests go to the plain policy
    model and carry the serving version, else the learner's latest published version (0 before the first).
    ``worker_id`` restricts routing to one replica. ``evaluate`` replicas are never routed to. A ``base_model`` of
    the form ``policy@N`` pins version N: the route is N's name on a replica that acknowledged it (else the name as
    given, which the server refuses).
    """

    def __init__(self, control: ControlPlane, policy: str, base_model: str, worker_id: str | None = None,
                 ttl_s: float = 1.0) -> None:
        self.control, self.policy, self.base_model, self.worker_id, self.ttl_s = (
            control, policy, base_model, worker_id, ttl_s)
        self.serving = ServingControl(control)
        self._cached: tuple[float, Route, bool] | None = None

    async def current(self) -> Route:
        route, _ = await self.current_with_source()
        return route

    async def current_with_source(self) -> tuple[Route, bool]:
        """(route, whether it came from a worker heartbeat)."""
        now = time.monotonic()
        if self._cached and now - self._cached[0] < self.ttl_s:
            return self._cached[1], self._cached[2]
        replicas = [r for r in await self.serving.serve_replicas(self.policy)
                    if self.worker_id is None or r.worker_id == self.worker_id]
        pointer = await self.serving.serving(self.policy)
        _, pinned = parse_model_name(self.base_model, self.policy)
        wanted = pinned if pinned is not None else production_version(pointer, replicas, unpromoted=True)
        candidates = [(v, r.worker_id, name or self.base_model, r.url) for r in replicas
                      for v, name in r.loaded.items()
                      if wanted is None or (v == wanted if pinned is not None else v <= wanted)]
        if pinned is not None and not candidates:
            route, from_worker = Route(self.base_model, pinned), False
        elif candidates:
            version, wid, name, url = max(candidates)
            route, from_worker = Route(name, version, wid, url), True
        else:
            version = pointer.version if pointer is not None else max(0, await self.control.latest_version(self.policy))
            route, from_worker = Route(self.base_model, version), False
        self._cached = (now, route, from_worker)
        return route, from_worker


def replica_origin(url: str) -> str:
    """``scheme://host:port`` of a replica URL: the key requests in flight are counted under."""
    parsed = httpx.URL(url)
    return f"{parsed.scheme}://{parsed.host}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


class Outstanding:
    """Requests in flight per replica (by :func:`replica_origin`), as one gateway sees them."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def started(self, origin: str) -> None:
        self.counts[origin] = self.counts.get(origin, 0) + 1

    def finished(self, origin: str) -> None:
        self.counts[origin] = max(0, self.counts.get(origin, 0) - 1)

    def of(self, url: str) -> int:
        return self.counts.get(replica_origin(url), 0) if url else 0


class _CountedStream(httpx.AsyncByteStream):
    """A response body that reports its end (closed, read whole or failed) once."""

    def __init__(self, inner: httpx.AsyncByteStream, done: Callable[[], None]) -> None:
        self.inner, self._done = inner, done
        self._reported = False

    def _report(self) -> None:
        if not self._reported:
            self._reported = True
            self._done()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            self._report()


class OutstandingTransport(httpx.AsyncBaseTransport):
    """The gateway's upstream transport: counts each replica's requests from sending to the end of the answer's
    body (streamed answers included), for :class:`FleetRouter`'s least-outstanding choice."""

    def __init__(self, outstanding: Outstanding, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.outstanding = outstanding
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = replica_origin(str(request.url))
        self.outstanding.started(origin)
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException:
            self.outstanding.finished(origin)
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(status_code=response.status_code, headers=response.headers,
                              stream=_CountedStream(response.stream, lambda: self.outstanding.finished(origin)),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


def in_canary_share(identity: str, share: float) -> bool:
    """Whether the caller or session ``identity`` belongs to the canary's ``share``: a stable hash of it, uniform on
    [0, 1), below ``share``; every gateway assigns the same identity the same way."""
    digest = hashlib.blake2b(identity.encode(), digest_size=8, person=b"rls-canary").digest()
    return int.from_bytes(digest, "big") / 2 ** 64 < share


def caller_identity(key_id: str | None, user: str | None) -> str | None:
    """What identifies the caller of a request without a session: its API key id and the request's ``user`` field
    (either may be missing; None when both are)."""
    if not key_id and not user:
        return None
    return f"key:{key_id or ''}\x00user:{user or ''}"


def session_replica(session_id: str, replicas: list[ReplicaAck]) -> ReplicaAck:
    """The replica a session's calls go to among ``replicas`` (rendezvous hashing): every gateway picks the same
    one without sharing state, and a replica joining or leaving moves only the sessions it gains or had."""
    def weight(replica: ReplicaAck) -> bytes:
        return hashlib.blake2b(f"{session_id}\x00{replica.worker_id}".encode(), digest_size=8).digest()
    return max(replicas, key=weight)


class VersionNotLoaded(LookupError):
    """No alive replica acknowledged loading the version a request names."""


class NoServingVersion(LookupError):
    """``policy`` names no version: no serving pointer exists yet (nothing was promoted, not even version 0)."""


class VersionForbidden(PermissionError):
    """``policy@N`` names a version that is neither serving nor the canary, and the caller lacks the ``evaluate``
    scope."""


class FleetRouter:
    """The gateway's router: one version per request and per session, sent only to replicas that acknowledged it.

    :meth:`route` takes the version a model name pins (``policy@N``: the serving version or the canary, any other
    with the ``evaluate`` scope), or the version the request's session is pinned to, else picks: the canary for its
    share of sessions and of sessionless callers (:func:`in_canary_share` of the session id, else of
    :func:`caller_identity`), else the serving version (:func:`production_version`; no
    serving pointer: :class:`NoServingVersion`, unless ``serve_unpromoted``); only ``serve`` replicas take requests.
    While no replica holds the serving version, production falls back to a promoted one below it
    (:func:`production_fallbacks`), else :class:`NoServingVersion`; never to a version that may have been rejected.
    A session's version is pinned in Redis (:meth:`ServingControl.pin_session`, expiring ``session_ttl_s`` after its
    last call), so every gateway sends a session's calls to the version it started on, while a replica has it loaded
    and it may still serve (:func:`session_may_stay`: a rollback moves its sessions at their next call). Among the replicas that
    acknowledged the version, a session's calls go to one replica (:func:`session_replica`: its prefix cache) and
    other requests to the one with the fewest requests in flight from this gateway (:attr:`outstanding`, counted by
    :class:`OutstandingTransport`; ties round robin). The pointer and acknowledgements are cached for ``ttl_s``.
    """

    #: which replica addresses may take requests (the gateway's upstream allowlist); a replica whose address it
    #: refuses is left out as if it had sent no heartbeat. None: any
    admit: Callable[[str], bool] | None = None

    def __init__(self, control: ControlPlane, policy: str, base_model: str, ttl_s: float = 0.5,
                 session_ttl_s: float = 3600.0, serve_unpromoted: bool = False) -> None:
        self.serving = ServingControl(control)
        self.policy, self.base_model, self.ttl_s, self.session_ttl_s = policy, base_model, ttl_s, session_ttl_s
        self.serve_unpromoted = serve_unpromoted  # no promotion gate: no pointer means the newest loaded version
        self._snapshot: tuple[float, ServingPointer | None, list[ReplicaAck]] | None = None
        self._turn = itertools.count()
        self._latest = 0
        self.outstanding = Outstanding()

    async def _state(self, fresh: bool = False) -> tuple[ServingPointer | None, list[ReplicaAck]]:
        now = time.monotonic()
        if fresh or self._snapshot is None or now - self._snapshot[0] >= self.ttl_s:
            # the pointer first: a move is confirmed only once replicas acknowledged it, so acknowledgements read
            # after the pointer are at least as new as the move it names (read the other way round, a pointer
            # confirmed in between names a version the older acknowledgements lack)
            pointer = await self.serving.serving(self.policy)
            replicas = await self.serving.serve_replicas(self.policy)  # never an evaluation server
            if self.admit is not None:
                replicas = [r for r in replicas if not r.url or self.admit(r.url)]
            if pointer is None and not replicas:  # nothing acknowledged yet: the learner's latest, as VersionRouter
                self._latest = max(0, await self.serving.control.latest_version(self.policy))
            self._snapshot = (now, pointer, replicas)
        return self._snapshot[1], self._snapshot[2]

    def _on(self, version: int, replicas: list[ReplicaAck], session_id: str | None = None) -> Route | None:
        having = [r for r in replicas if version in r.loaded]
        if not having:
            return None
        if session_id is not None:
            replica = session_replica(session_id, having)
        else:
            start = next(self._turn) % len(having)
            replica = min(having[start:] + having[:start], key=lambda r: self.outstanding.of(r.url))
        return Route(replica.loaded[version] or self.base_model, version, replica.worker_id, replica.url)

    async def route(self, pinned: int | None = None, session_version: int | None = None,
                    session_id: str | None = None, scopes: Collection[str] = (), caller: str | None = None) -> Route:
        """The route of one request (``session_id``: the gateway's scoped session id; ``session_version``: a
        version the caller already knows the session is on; ``scopes``: the caller's key scopes; ``caller``: who
        sent a request without a session, :func:`caller_identity`, for the canary's share). Raises
        :class:`VersionForbidden` for a pinned version that is neither serving nor the canary without the
        ``evaluate`` scope, :class:`VersionNotLoaded` for a pinned version no replica has, and
        :class:`NoServingVersion` when nothing serves yet (no serving pointer)."""
        pointer, replicas = await self._state()
        if pinned is not None:
            if not released(pointer, pinned) and SCOPE_EVALUATE not in scopes:
                raise VersionForbidden(
                    f"version {pinned} of {self.policy!r} is neither serving nor the canary: naming it needs a key "
                    f"with the {SCOPE_EVALUATE!r} scope")
            route = self._on(pinned, replicas)
            if route is None:
                raise VersionNotLoaded(f"version {pinned} of {self.policy!r} is not loaded on any replica")
            return route
        if pointer is None and not self.serve_unpromoted:
            raise NoServingVersion(f"no version of {self.policy!r} serves yet: nothing was promoted (the promotion "
                                   "gate promotes version 0, the base weights, once the learner announced it)")
        if session_version is not None and (self.serve_unpromoted or session_may_stay(pointer, session_version)):
            route = self._on(session_version, replicas, session_id)  # stays on its version while a replica has it
            if route is not None:
                return route
        try:
            fresh = self._pick(pointer, replicas, session_id, caller)
        except NoServingVersion:  # a move landed between the two reads: once more, both read now
            pointer, replicas = await self._state(fresh=True)
            fresh = self._pick(pointer, replicas, session_id, caller)
        if session_id is None:
            return fresh
        held = await self.serving.pin_session(self.policy, session_id, fresh.version, self.session_ttl_s)
        stays = held == fresh.version or self.serve_unpromoted or session_may_stay(pointer, held)
        route = (self._on(held, replicas, session_id) if held != fresh.version else fresh) if stays else None
        if route is None:  # its version is loaded nowhere any more, or was rolled back: moves on, pinned anew
            await self.serving.pin_session(self.policy, session_id, fresh.version, self.session_ttl_s, replace=True)
            return fresh
        return route

    def _pick(self, pointer: ServingPointer | None, replicas: list[ReplicaAck], session_id: str | None,
              caller: str | None = None) -> Route:
        """The route of a request that no version or session pins."""
        identity = f"session:{session_id}" if session_id is not None else caller
        if pointer is not None and pointer.canary_version is not None and pointer.canary_share > 0 \
                and identity is not None and in_canary_share(identity, pointer.canary_share):
            route = self._on(pointer.canary_version, replicas, session_id)
            if route is not None:
                return route
        version = production_version(pointer, replicas, unpromoted=self.serve_unpromoted)
        if version is not None:
            route = self._on(version, replicas, session_id)
            if route is not None:
                return route
            # the serving version on no alive replica: a promoted one (without a gate: the newest loaded below it)
            loaded = {v for r in replicas for v in r.loaded}
            fallbacks = (sorted((v for v in loaded if v <= version), reverse=True)
                         if self.serve_unpromoted or pointer is None else production_fallbacks(pointer))
            for fallback in fallbacks:
                route = self._on(fallback, replicas, session_id)
                if route is not None:
                    return route
            if replicas and not self.serve_unpromoted:
                raise NoServingVersion(f"serving version v{version} of {self.policy!r} is not loaded on any replica "
                                       "yet, nor a version production may fall back to")
        return Route(self.base_model, version if version is not None else self._latest)


class StaticFleet:
    """Replicas named on the command line (``rlstream gateway serve --upstream A --upstream B``), without Redis: each
    serves ``version`` under ``model``. The same choices as :class:`FleetRouter`: a session's calls on one replica
    (:func:`session_replica`), other requests on the one with the fewest in flight; ``policy@N`` for another version
    than ``version`` is loaded nowhere."""

    def __init__(self, urls: list[str], policy: str, model: str, version: int) -> None:
        self.replicas = [ReplicaAck(worker_id=url, version=version, name=model, url=url, loaded={version: model})
                         for url in urls]
        self.policy, self.version = policy, version
        self.outstanding = Outstanding()
        self._turn = itertools.count()

    async def route(self, pinned: int | None = None, session_version: int | None = None,
                    session_id: str | None = None, scopes: Collection[str] = (), caller: str | None = None) -> Route:
        """The route of one request (the arguments as :meth:`FleetRouter.route`; ``scopes`` and ``caller`` change
        nothing: one
        version serves)."""
        if pinned is not None and pinned != self.version:
            raise VersionNotLoaded(f"version {pinned} of {self.policy!r} is not loaded on any replica")
        if session_id is not None:
            replica = session_replica(session_id, self.replicas)
        else:
            start = next(self._turn) % len(self.replicas)
            ordered = self.replicas[start:] + self.replicas[:start]
            replica = min(ordered, key=lambda r: self.outstanding.of(r.url))
        return Route(replica.name, self.version, replica.worker_id, replica.url)
