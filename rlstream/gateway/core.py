"""The gateway's core, shared by every endpoint: the upstream client and its lifecycle, routing (which version and
replica a call goes to), admission (who calls, for which task and session, and whether the call is captured),
capture (calls become trajectories or ``calls`` records through the capture queue) and signing (feedback tokens)."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import math
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import orjson
from httpx_aiohttp import AiohttpTransport
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from rlstream.gateway.auth import (OPEN, PRINCIPAL_KEY, AccessConfig, AuthRefusal, Principal, forbidden, task_for,
                                   unauthorized)
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.feedback import FeedbackIndex
from rlstream.gateway.feedback_tokens import FeedbackGrant, FeedbackSigner, FeedbackTokenError, generate_secret
from rlstream.gateway.limits import LimitStats, RateLimiter, RequestRejected, error_body, malformed_answer
from rlstream.gateway.queue import CaptureQueue, CaptureRefused, Submitter
from rlstream.gateway.sessions import SessionStore, Trajectory, recorded_call
from rlstream.gateway.shared_ids import TRACEPARENT_HEADER, Background, TenantMap, dumps_known, trace_ids
from rlstream.gateway.spool import Spool
from rlstream.gateway.upstreams import UpstreamAllowlist, upstream_default_temperature
from rlstream.rollout.capture import to_message
from rlstream.rollout.routing import (FleetRouter, NoServingVersion, OutstandingTransport, StaticFleet,
                                      VersionForbidden, VersionNotLoaded, caller_identity)
from rlstream.schemas.masking import mask_text
from rlstream.schemas.models import CallEvent, new_id
from rlstream.schemas.sampling import NEUTRAL_TEMPERATURE
from rlstream.schemas.sessions import session_trajectory_id
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.log import get_logger
from rlstream.transport.metrics import MetricsPublisher
from rlstream.transport.serving import parse_model_name

log = get_logger(__name__)

SESSION_HEADER = "x-session-id"
TASK_HEADER = "x-rlstream-task"
FEEDBACK_TOKEN_HEADER = "x-rlstream-feedback-token"
#: set on a request once it was counted against ``token_rpm`` (its token may be verified more than once)
TOKEN_COUNTED_KEY = "rlstream.token_counted"
JSON_CONTENT = {"content-type": "application/json"}
#: ``async () -> (model name to request, policy version)``, e.g. ``VersionRouter.current`` adapted.
RouteSource = Callable[[], Awaitable[tuple[str, int]]]
#: the W3C trace and span ids of the inference call being served (set at admission, read when its ids are signed)
CALL_TRACE: contextvars.ContextVar[list[str]] = contextvars.ContextVar("rlstream_call_trace", default=[])


def openai_error(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    """An error in the OpenAI API's shape (clients parse the body of every error)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status, **extra}},
                        status_code=status)


def request_session(request: Request) -> str | None:
    """The session id a request names, as the client sent it."""
    return request.path_params.get("session_id") or request.headers.get(SESSION_HEADER) or None


def capture_too_large(exc: CaptureRefused) -> RequestRejected:
    """The 413 of a call whose capture Kafka cannot take (its record would be larger than
    ``kafka.max_message_bytes``): never a 2xx for a call that is not captured."""
    return RequestRejected(413, f"this call cannot be captured: {exc}; send a shorter conversation or ask for fewer "
                           "tokens", reason="capture_too_large")


def capture_refused_event(refusal: RequestRejected) -> str:
    """The server-sent error event that ends a stream whose capture Kafka cannot take (:func:`capture_too_large`;
    the OpenAI SDKs raise it)."""
    return "data: " + error_body(refusal.status, refusal.message, refusal.kind).decode() + "\n\n"


def upstream_json(response: httpx.Response, raw: bytes, max_choices: int = 1 << 30) -> dict[str, Any] | Response:
    """The upstream's JSON answer, or the response to hand the client: the upstream's own error as it came, or
    a 502 when a 200 is not JSON or not shaped as a chat completion (:func:`limits.malformed_answer`)."""
    if response.status_code != 200:
        return Response(raw, status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return openai_error(502, "upstream answered with invalid JSON", "upstream_error")
    problem = malformed_answer(payload, max_choices)
    if problem is not None:
        log.warning("malformed upstream answer", problem=problem)
        return openai_error(502, problem, "upstream_error")
    return payload  # type: ignore[no-any-return]


class UpstreamTransport(AiohttpTransport):
    """The transport of the gateway's upstream client: httpx's API over aiohttp's connection pool (httpx_aiohttp).
    httpcore's pool checks every idle connection's socket on each request; under load that was the largest part of
    the gateway's own work (bench/results/2026-11-27-gateway-overhead.md). A password in the upstream URL is already
    the request's Authorization header (httpx's basic auth): aiohttp refuses both, so the URL goes without it."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.userinfo:
            request.url = request.url.copy_with(userinfo=b"")
        return await super().handle_async_request(request)


def json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded with orjson (Starlette's JSONResponse encodes with the standard library's json)."""
    return Response(orjson.dumps(content), status_code=status_code, headers=headers, media_type="application/json")


def upstream_failed(exc: Exception, config: GatewaySettings, what: str = "unreachable") -> JSONResponse:
    """The 502 for an upstream that failed: the client learns the kind of failure, never the upstream's address
    (which may carry credentials); the log gets the details with secrets masked."""
    log.warning(f"upstream {what}", upstream=config.upstream_shown, error=mask_text(str(exc)),
                kind=type(exc).__name__)
    return openai_error(502, f"upstream {what} ({type(exc).__name__})", "upstream_error")


#: seconds between lookups of the upstream's default temperature while it is not known
DEFAULTS_RETRY_S = 30.0


class Gateway:
    """State of one gateway: the upstream client, open sessions, the capture queue; with ``metrics``, the
    gateway's overhead per captured call (``metric_names.GATEWAY_OVERHEAD_S``, Prometheus only).

    With ``fleet`` (it takes precedence over ``route``), the policy's model names address versions (``policy`` the
    serving one, ``policy@N`` version N) and each request and session is pinned to one version, sent to a replica
    that acknowledged loading it (docs/promotion.md).

    With ``control`` (Redis), the ids feedback may name and the stored Responses are shared with every gateway on
    the same Redis (:mod:`rlstream.gateway.shared_ids`); without it they stay in this process."""

    def __init__(self, config: GatewaySettings, publisher: Submitter, route: RouteSource | None = None,
                 client: httpx.AsyncClient | None = None, metrics: MetricsPublisher | None = None,
                 access: AccessConfig | None = None, fleet: FleetRouter | StaticFleet | None = None,
                 control: ControlPlane | None = None) -> None:
        self.config = config
        self.fleet = fleet
        self.access = access if access is not None else AccessConfig()
        self.keys = self.access.key_store()
        secret, previous = self.access.feedback_secret, self.access.feedback_secret_previous
        self.signer = FeedbackSigner(secret.get_secret_value() if secret is not None else generate_secret(),
                                     self.access.feedback_token_ttl_s,
                                     previous.get_secret_value() if previous is not None else None)
        self.upstreams = UpstreamAllowlist.parse(config.upstream_allowlist,
                                                 [str(u) for u in config.upstreams] or [config.upstream_url])
        if isinstance(fleet, FleetRouter):
            fleet.admit = self.upstreams.allows
        self.feedback_index = FeedbackIndex(config.remembered_trajectories)
        #: ids -> trajectory, per tenant, for every gateway (only with Redis: else ``feedback_index`` alone)
        self.shared_ids = TenantMap("ids", config.policy, config.reward_window_s, config.remembered_trajectories,
                                    control)
        #: stored Responses (previous_response_id) and conversations: their items, per tenant
        self.stored = TenantMap("responses", config.policy, config.reward_window_s, config.max_stored_responses,
                                control)
        self.background = Background()
        self.publisher = publisher
        self.route = route
        self.metrics = metrics
        self.sessions = SessionStore(config.session_idle_s, config.remembered_trajectories,
                                     max_open=config.max_open_sessions, max_turns=config.max_session_turns,
                                     max_bytes=config.max_session_bytes, tenant_of=self.tenant_of)
        self.limit_stats = LimitStats()
        self.token_rate = RateLimiter(config.token_rpm)  # per key that caused the tokens
        #: with keys, each tenant's share of the capture queue and spool (one tenant never fills them for all)
        self.capture = CaptureQueue(publisher, config.queue_size, spool_after_s=config.spool_after_s,
                                    tenant_share=config.capture_tenant_share if self.keys.enabled else 1.0)
        self.capture.share_among(self.keys.tenants)
        self.keys.on_change.append(lambda: self.capture.share_among(self.keys.tenants))
        self._client = client
        self._own_client = client is None
        self._urls: dict[str, httpx.URL] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.request_token_data = config.request_token_data
        #: captured turns whose logprobs did not cover every completion token (kept with token ids, no logprobs)
        self.logprobs_incomplete = 0
        #: a session's calls go to ``calls`` and the stream app stitches them (no session held here)
        self.stitch_in_streams = config.session_stitching == "streams"
        self.gateway_id = config.gateway_id or f"{config.host}:{config.port}"
        #: the temperature a request that names none is recorded at (gateway.default_temperature, else the
        #: upstream's generation defaults, looked up at start and again every DEFAULTS_RETRY_S until known)
        self.default_temperature = (config.default_temperature if config.default_temperature is not None
                                    else NEUTRAL_TEMPERATURE)
        self._defaults_known = config.default_temperature is not None
        self._defaults_tried = -math.inf

    # -- lifecycle --
    async def start(self) -> None:
        if self._client is None:
            key = self.config.upstream_key
            headers = {"authorization": f"Bearer {key}"} if key else {}
            # with a fleet, each replica's requests in flight are counted (least outstanding routing)
            transport: httpx.AsyncBaseTransport = UpstreamTransport()
            if self.fleet is not None:
                transport = OutstandingTransport(self.fleet.outstanding, transport)
            self._client = httpx.AsyncClient(timeout=self.config.upstream_timeout_s, headers=headers,
                                             transport=transport)
        if self.config.spool_dir is not None and self.capture.spool is None:
            self.capture.use_spool(await asyncio.to_thread(
                Spool.open, self.config.spool_dir, self.config.spool_max_bytes, self.config.spool_segment_bytes))
        self.capture.start()
        await self.learn_default_temperature()
        self._sweeper = asyncio.create_task(self._sweep(), name="gateway-sessions")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for traj in self.sessions.close_all():
            self.publish(traj)
        await self.background.drain(self.config.drain_timeout_s)
        await self.capture.drain(self.config.drain_timeout_s)
        if self._own_client and self._client is not None:
            await self._client.aclose()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def _sweep(self) -> None:
        period = max(0.05, min(1.0, self.config.session_idle_s / 4))
        while True:
            await asyncio.sleep(period)
            for traj in self.sessions.idle():
                self.publish(traj)
            await self._emit_bounds()
            if not self._defaults_known and time.monotonic() - self._defaults_tried >= DEFAULTS_RETRY_S:
                await self.learn_default_temperature()

    async def learn_default_temperature(self) -> None:
        """Read the upstream's default temperature (:func:`upstream_default_temperature`) into
        :attr:`default_temperature`, unless ``gateway.default_temperature`` set it or it is known already."""
        if self._defaults_known:
            return
        self._defaults_tried = time.monotonic()
        found = await upstream_default_temperature(self.client, self.config.upstream_base)
        if found is not None:
            self.default_temperature, self._defaults_known = found, True
            log.info("requests without a temperature are recorded at the upstream's default",
                     temperature=found, upstream=self.config.upstream_shown)

    async def _emit_bounds(self) -> None:
        """The bounds' running totals to Prometheus (when the gateway has metrics)."""
        if self.metrics is None:
            return
        for reason, count in list(self.limit_stats.rejected.items()):
            await self.metrics.emit(mn.GATEWAY_REQUESTS_REJECTED, count, tags={"reason": reason})
        await self.metrics.emit(mn.GATEWAY_SESSIONS_EVICTED, self.sessions.evicted)
        await self.metrics.emit(mn.GATEWAY_SESSIONS_SPLIT_LONG, self.sessions.splits_long)

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "gateway not started"
        return self._client

    async def overhead(self, route: str, streamed: bool, started: float, upstream_s: float) -> None:
        """Report the time since ``started`` (``time.perf_counter``) that was not spent waiting for the upstream."""
        if self.metrics is not None:
            overhead_s = max(0.0, time.perf_counter() - started - upstream_s)
            await self.metrics.emit(mn.GATEWAY_OVERHEAD_S, overhead_s,
                                    tags={"route": route, "streamed": "true" if streamed else "false"})

    # -- admission --
    def scoped(self, tenant: str, session_id: str) -> str:
        """The gateway's own name of a tenant's session id (two tenants' equal ids never meet; an open gateway
        has one tenant and keeps the id as sent)."""
        return f"{tenant}:{session_id}" if self.keys.enabled else session_id

    def client_session(self, scoped_session: str | None) -> str | None:
        """A scoped session id as its client sent it."""
        if scoped_session is None or not self.keys.enabled:
            return scoped_session
        return scoped_session.split(":", 1)[1]

    def tenant_of(self, scoped_session: str) -> str:
        """The tenant of a scoped session id ('' for an open gateway, which keeps ids as sent)."""
        return scoped_session.split(":", 1)[0] if self.keys.enabled else ""

    def is_policy_model(self, model: str) -> bool:
        return model == self.config.served_model or parse_model_name(model, self.config.policy)[0]

    def admit(self, request: Request, model: str) -> tuple[Principal, str | None, str | None, bool]:
        """(the caller, its task, its scoped session id or None, whether the call is captured) of an inference
        call for ``model``; :class:`AuthRefusal` (403) for a model or a task the caller's key may not use."""
        caller: Principal = request.scope.get(PRINCIPAL_KEY) or OPEN
        policy_models = (self.config.policy, self.config.served_model)
        named, _ = parse_model_name(model, self.config.policy)  # policy@N: a version of the policy
        if not (caller.may_call(model, policy_models) or named and caller.may_call(self.config.policy, policy_models)):
            raise forbidden(f"this API key may not call model {model!r}", "model_not_allowed")
        task = task_for(caller, request.headers.get(TASK_HEADER) or None)
        session_id = request_session(request)
        scoped = self.scoped(caller.tenant, session_id) if session_id else None
        CALL_TRACE.set(trace_ids(request.headers.get(TRACEPARENT_HEADER)))
        return caller, task, scoped, caller.open_access or self.is_policy_model(model)

    # -- routing --
    async def routed(self, model: str, session_id: str | None, caller: Principal,
                     user: object = None) -> tuple[str, int, str] | JSONResponse:
        """:meth:`route_pinned` for ``caller`` (``user``: the request's ``user`` field, which with the key identifies
        a caller without a session for the canary's share), or the error the client gets: 404 for a version no
        replica has, 403 for a version the caller may not name, 503 while nothing serves."""
        identity = caller_identity(caller.key_id, user if isinstance(user, str) else None)
        try:
            return await self.route_pinned(model, session_id, caller.scopes, identity)
        except VersionNotLoaded as exc:
            return openai_error(404, str(exc), "model_not_found")
        except VersionForbidden as exc:
            return openai_error(403, str(exc), "permission_denied")
        except NoServingVersion as exc:
            return openai_error(503, str(exc), "no_serving_version")

    async def route_pinned(self, model: str, session_id: str | None, scopes: frozenset[str] = frozenset(),
                           caller: str | None = None) -> tuple[str, int, str]:
        """(upstream model name, version, upstream base URL ending in /v1) of a call for ``model``: pinned to one
        version (the one ``policy@N`` names, the session's, or a new pick) on a replica that has it loaded.
        Raises :class:`VersionNotLoaded` for ``policy@N`` that no replica has, :class:`VersionForbidden` for a
        ``policy@N`` that neither serves nor is the canary without the ``evaluate`` scope in ``scopes`` (the
        caller's), and :class:`NoServingVersion` while nothing serves (no serving pointer)."""
        _, pinned = parse_model_name(model, self.config.policy)
        if self.fleet is None:
            name, version = await self._route(model)
            return name, version, self.config.upstream_base
        session = self.sessions.open.get(session_id) if session_id is not None else None
        try:
            route = await self.fleet.route(pinned, session.policy_version if session is not None else None,
                                           session_id, scopes=scopes, caller=caller)
        except (VersionNotLoaded, VersionForbidden, NoServingVersion):
            raise
        except Exception as exc:  # Redis unreachable: the request goes out as asked, to the configured upstream
            log.warning("policy version unknown (router failed); request sent as asked", error=str(exc))
            return model, self.config.policy_version, self.config.upstream_base
        base = route.url.rstrip("/") if route.url else self.config.upstream_base
        if route.url and not self.upstreams.allows(base):  # the fleet filters them; never send the key elsewhere
            raise NoServingVersion("no replica on gateway.upstream_allowlist has this version")
        return route.model, route.version, base if base.endswith("/v1") else base + "/v1"

    async def _route(self, model: str) -> tuple[str, int]:
        if self.route is not None and model in (self.config.policy, self.config.served_model):
            try:
                return await self.route()
            except Exception as exc:
                log.warning("policy version unknown (router failed); request sent as asked", error=str(exc))
        return model, self.config.policy_version

    # -- upstream --
    async def send(self, url: str, sent: dict[str, Any], plain: dict[str, Any], stream: bool,
                   rejects: Callable[[int, str], bool]) -> tuple[httpx.Response, bool]:
        """POST ``sent`` (the request asking for token data) to ``url``; an upstream that refuses the token-data
        fields (``rejects(status, text)``) gets ``plain`` instead. Returns the response and whether it refused."""
        response = await self.client.send(self._post(url, sent), stream=stream)
        if sent is not plain and self.request_token_data and response.status_code in (400, 422):
            text = (await response.aread()).decode(errors="replace")
            if rejects(response.status_code, text):
                await response.aclose()
                log.warning("upstream rejects token-data options; capturing without token data", url=url,
                            error=text[:200])
                return await self.client.send(self._post(url, plain), stream=stream), True
        return response, False

    def _post(self, url: str, body: dict[str, Any]) -> httpx.Request:
        """The upstream POST of ``body`` to ``url``: the body encoded with orjson, the URL parsed once per address."""
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= 1024:  # a fleet's addresses come and go: never an unbounded map
                self._urls.clear()
            parsed = self._urls[url] = httpx.URL(url)
        return self.client.build_request("POST", parsed, content=orjson.dumps(body), headers=JSON_CONTENT)

    async def passthrough(self, path: str, body: dict[str, Any]) -> Response:
        """A call for a model that is not the policy's: passed to the upstream as it came, not captured."""
        try:
            upstream = await self.client.send(self.client.build_request("POST", self.config.upstream_base + path,
                                                                        json=body), stream=True)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.config)
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "application/json"),
                                 background=BackgroundTask(upstream.aclose))

    # -- capture --
    def publish(self, traj: Trajectory) -> bool:
        """Queue a whole trajectory for ``trajectories``; False when it was not kept (malformed, too large for
        Kafka, or dropped: logged and counted, never raised)."""
        try:
            return self._queue_trajectory(traj)
        except CaptureRefused:
            return False

    def _queue_trajectory(self, traj: Trajectory) -> bool:
        """:meth:`publish`, raising :class:`CaptureRefused` for a trajectory Kafka cannot take."""
        try:
            event = traj.to_event(run_id=self.config.run_id, policy=self.config.policy,
                                  producer_id=self.config.producer_id)
        except Exception as exc:  # a malformed call must not take the server down
            log.error("trajectory not built", trajectory_id=traj.trajectory_id, error=str(exc))
            return False
        tenant = traj.tenant if traj.tenant is not None else self.tenant_of(traj.session_id or "")
        return self.capture.put(event, tenant)

    def publish_call(self, call: CallEvent) -> bool:
        """Queue one record of a session for ``calls`` (the stream app stitches it); False when it was dropped.
        Raises :class:`RequestRejected` (413) for a record Kafka cannot take."""
        try:
            return self.capture.put(call, call.tenant)
        except CaptureRefused as exc:
            raise capture_too_large(exc) from exc

    def begin(self, session_id: str | None, body: dict[str, Any], prompt_ids: list[int] | None, version: int,
              task: str | None, tenant: str | None = None) -> tuple[Trajectory, dict[str, str]]:
        """The trajectory a call joins (its session's, or a new one) and the response headers that name it;
        ``tenant``: the caller's (its share of the capture queue; default: the session's)."""
        if session_id is not None and self.stitch_in_streams:  # the stitcher decides; the id is derived
            traj = Trajectory(session_id=session_id, policy_version=version, task=task,
                              trajectory_id=session_trajectory_id(session_id), tenant=tenant)
            self.sessions.remember(traj)
            return traj, {"x-rlstream-trajectory-id": traj.trajectory_id, "x-rlstream-policy-version": str(version),
                          "x-rlstream-session-id": session_id}
        messages = []
        with contextlib.suppress(Exception):
            messages = [to_message(m) for m in body.get("messages", [])]
        traj, closed = self.sessions.begin(session_id, prompt_ids, messages, version, task)
        if tenant is not None:
            traj.tenant = tenant
        evicted = self.sessions.take_evicted()
        if evicted:
            log.warning("open sessions at their limit: the least recently active closed and published",
                        count=len(evicted), max_open_sessions=self.config.max_open_sessions)
            for old in evicted:
                self.publish(old)
        if closed is not None:
            log.info("session split: the call does not extend its session's trajectory token for token",
                     session_id=session_id, closed_trajectory_id=closed.trajectory_id,
                     new_trajectory_id=traj.trajectory_id)
            self.publish(closed)
        headers = {"x-rlstream-trajectory-id": traj.trajectory_id, "x-rlstream-policy-version": str(version)}
        if session_id:
            headers["x-rlstream-session-id"] = session_id
        return traj, headers

    def begin_group(self, n: int, version: int, task: str | None,
                    tenant: str | None = None) -> tuple[list[Trajectory], dict[str, str]]:
        """``n`` choices of one prompt outside a session: one trajectory per choice, together one GRPO group (the N
        generations of one prompt), and the response headers that name them."""
        group = new_id()
        trajs = []
        for index in range(n):
            traj = Trajectory(session_id=None, policy_version=version, task=task, choices_group=group,
                              group_size=n, generation_index=index, tenant=tenant)
            self.sessions.remember(traj)
            trajs.append(traj)
        ids = [t.trajectory_id for t in trajs]
        return trajs, {"x-rlstream-trajectory-id": ids[0], "x-rlstream-trajectory-ids": ",".join(ids),
                       "x-rlstream-group-id": group, "x-rlstream-policy-version": str(version)}

    def finish(self, traj: Trajectory, body: dict[str, Any], message: dict[str, Any], prompt_ids: list[int] | None,
               completion_ids: list[int] | None, logprobs: list[float] | None, finish_reason: str | None,
               served: str, version: int | None = None) -> None:
        """Record a completed call in ``traj``: a ``calls`` record of a session stitched in streams, else a turn
        of the trajectory (published once it is whole). Raises :class:`RequestRejected` (413) when the record would
        be larger than Kafka takes: the call is not captured, so it must not be answered 2xx."""
        if completion_ids is not None and logprobs is not None and len(logprobs) != len(completion_ids):
            self.logprobs_incomplete += 1  # e.g. a streamed token that added no text came without its logprob
            log.warning("turn captured without logprobs: they do not cover every completion token",
                        trajectory_id=traj.trajectory_id, tokens=len(completion_ids), logprobs=len(logprobs))
        try:  # the turn carries the version this call was routed to (a session may straddle a reload)
            call = recorded_call(body, message, prompt_ids, completion_ids, logprobs, finish_reason, served,
                                 policy_version=version, default_temperature=self.default_temperature)
        except Exception as exc:
            log.error("call not captured", error=str(exc))
            return
        if traj.session_id is not None and self.stitch_in_streams:
            self.publish_call(CallEvent(
                session_id=traj.session_id, tenant=self.tenant_of(traj.session_id), task=traj.task,
                run_id=self.config.run_id, policy=self.config.policy,
                policy_version=version if version is not None else traj.policy_version,
                request_messages=call.request_messages, response_message=call.response_message, turn=call.turn,
                served_model=call.served_model, gateway_id=self.gateway_id,
                tools=json.dumps(call.tools, sort_keys=True) if call.tools else None))
            return
        if traj.closed and traj.session_id is not None:
            log.warning("call finished after its session trajectory closed; captured alone",
                        trajectory_id=traj.trajectory_id)
            traj = Trajectory(session_id=traj.session_id, policy_version=traj.policy_version, task=traj.task,
                              tenant=traj.tenant)
            self.sessions.remember(traj)
            traj.add(call)
            self._publish_whole(traj)
            return
        traj.add(call)
        if traj.session_id is None:
            traj.closed = True
            self._publish_whole(traj)

    def _publish_whole(self, traj: Trajectory) -> None:
        """Queue a trajectory whose call is being answered: 413 (:class:`RequestRejected`) when Kafka cannot take
        it."""
        try:
            self._queue_trajectory(traj)
        except CaptureRefused as exc:
            raise capture_too_large(exc) from exc

    # -- signing --
    def sign(self, headers: dict[str, str], caller: Principal, session_id: str | None,
             response_id: Any = None) -> dict[str, str]:
        """Add the feedback token(s) of the captured trajectories named in ``headers``, record their owner and the
        ids that name them (the response id of the body, the call's W3C trace and span ids: shared with every
        gateway when it has Redis), and show the session id as the client sent it."""
        ids = headers.get("x-rlstream-trajectory-ids")
        trajectory_ids = ids.split(",") if ids else [headers["x-rlstream-trajectory-id"]]
        tokens = []
        may_reward = "feedback" in caller.scopes  # a token is a grant to reward: only for who may give feedback
        # n > 1: the response id names the whole group (not indexed)
        aliases = [str(a) for a in (response_id, *CALL_TRACE.get()) if a] if not ids else []
        shared: dict[str, str] = {}
        for trajectory_id in trajectory_ids:
            for forgotten in self.feedback_index.own(caller.tenant, trajectory_id):  # the tenant's own oldest
                self.sessions.forget(forgotten)
            self.sessions.claim(trajectory_id)
            known = self.sessions.lookup(trajectory_id)
            if known is not None and self.shared_ids.shared:
                for name in (trajectory_id, *aliases):
                    shared[name] = dumps_known(known)
            if not may_reward:
                continue
            if session_id is not None and not ids and self.stitch_in_streams:  # any gateway routes it to the stitcher
                tokens.append(self.signer.issue(caller.tenant, "session", self.scoped(caller.tenant, session_id),
                                                key_id=caller.key_id))
            else:
                tokens.append(self.signer.issue(caller.tenant, "trajectory", trajectory_id, key_id=caller.key_id,
                                                example_id=known.example_id if known is not None else "",
                                                group_id=known.group_id if known is not None else ""))
        if tokens:
            headers[FEEDBACK_TOKEN_HEADER] = tokens[0]
        if ids and tokens:
            headers["x-rlstream-feedback-tokens"] = ",".join(tokens)
        for alias in aliases:
            self.feedback_index.add_response(caller.tenant, alias, trajectory_ids[0])
        if shared:
            self.background.run(self.shared_ids.put(caller.tenant, shared))
        if session_id is not None:
            headers["x-rlstream-session-id"] = session_id
        return headers

    def grant(self, token: str, request: Request | None = None) -> FeedbackGrant:
        """What a feedback token allows; :class:`AuthRefusal` (401) for a token that is forged, expired, or whose
        key (the one that caused it) is no longer configured in the token's tenant with the feedback scope. With
        ``request``, the request is counted once against ``token_rpm`` of the key that caused the token (429
        beyond)."""
        try:
            grant = self.signer.verify(token)
        except FeedbackTokenError as exc:
            raise unauthorized(str(exc), "feedback_token_expired" if exc.expired else "invalid_feedback_token")
        if grant.key_id and self.keys.enabled and not self.keys.may_reward(grant.key_id, grant.tenant):
            raise unauthorized("feedback token not valid (its API key was revoked or may no longer give feedback)",
                               "feedback_token_revoked")
        if request is not None and not request.scope.get(TOKEN_COUNTED_KEY):
            request.scope[TOKEN_COUNTED_KEY] = True
            wait = self.token_rate.take(grant.key_id)
            if wait is not None:
                raise AuthRefusal(429, f"rate limit of {self.config.token_rpm} feedback requests per minute with "
                                  f"this key's feedback tokens reached; retry in {math.ceil(wait)} s",
                                  "rate_limit_error", "token_rate_limit_exceeded")
        return grant
