"""The gateway's HTTP server (Starlette): OpenAI-compatible routes, capture, sessions and feedback."""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from dataclasses import asdict
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlstream.gateway.auth import (BEARER_TOKEN_KEY, OPEN, PRINCIPAL_KEY, AccessConfig, AuthMiddleware,
                                           AuthRefusal, Principal, forbidden, task_for, unauthorized)
from rlstream.gateway.config import GatewayConfig
from rlstream.gateway.feedback import RANGE_CONTEXT, Feedback, FeedbackIndex, validation_problems
from rlstream.gateway.feedback_shapes import FeedbackShapes
from rlstream.gateway.feedback_tokens import FeedbackSigner, FeedbackTokenError, generate_secret
from rlstream.gateway.filtering import (ClientAsked, client_asked, filter_response, rejects_extensions,
                                                upstream_request)
from rlstream.gateway.limits import (LimitStats, RequestLimits, RequestRejected, check_choices, check_id,
                                             malformed_answer, parse_json)
from rlstream.gateway.queue import CaptureQueue, Submitter
from rlstream.gateway.responses import (ResponsesAsked, ResponsesStreamCapture, filter_response_payload,
                                                recorded_request, rejects_token_options, request_messages,
                                                response_message, response_tokens, responses_asked,
                                                responses_upstream_request)
from rlstream.gateway.responses import finish_reason as responses_finish_reason
from rlstream.gateway.spool import Spool
from rlstream.gateway.unserved import not_served, public_models
from rlstream.gateway.sessions import KnownTrajectory, SessionStore, Trajectory, recorded_call
from rlstream.rollout.capture import to_message, token_data
from rlstream.rollout.routing import (FleetRouter, NoServingVersion, OutstandingTransport, StaticFleet,
                                      VersionForbidden, VersionNotLoaded)
from rlstream.rollout.streaming import StreamAccumulator
from rlstream.transport import metric_names as mn
from rlstream.transport.log import get_logger
from rlstream.transport.metrics import MetricsPublisher
from rlstream.schemas.masking import mask_text
from rlstream.schemas.models import CallEvent, CallKind, RewardEvent, new_id
from rlstream.schemas.sessions import session_trajectory_id
from rlstream.transport.serving import parse_model_name

log = get_logger(__name__)

SESSION_HEADER = "x-session-id"
TASK_HEADER = "x-rlstream-task"
FEEDBACK_TOKEN_HEADER = "x-rlstream-feedback-token"
#: A streamed answer's lines are handed on an event at a time (up to its blank line); an upstream that writes long
#: runs of lines without one is handed on this many lines at a time.
MAX_LINES_PER_WRITE = 16
#: ``async () -> (model name to request, policy version)``, e.g. ``VersionRouter.current`` adapted.
RouteSource = Callable[[], Awaitable[tuple[str, int]]]


def openai_error(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status, **extra}},
                        status_code=status)


def request_session(request: Request) -> str | None:
    """The session id a request names, as the client sent it."""
    return request.path_params.get("session_id") or request.headers.get(SESSION_HEADER) or None


def requested_choices(body: dict[str, Any]) -> int:
    """The ``n`` a chat request asks for (1 when absent or not a positive integer: the upstream judges it)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def upstream_json(response: httpx.Response, raw: bytes, max_choices: int = 1 << 30) -> dict[str, Any] | Response:
    """The upstream's JSON answer, or the response to hand the client: the upstream's own error as it came, or
    a 502 when a 200 is not JSON or not shaped as a chat completion (:func:`limits.malformed_answer`)."""
    if response.status_code != 200:
        return Response(raw, status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError):
        return openai_error(502, "upstream answered with invalid JSON", "upstream_error")
    problem = malformed_answer(payload, max_choices)
    if problem is not None:
        log.warning("malformed upstream answer", problem=problem)
        return openai_error(502, problem, "upstream_error")
    return payload  # type: ignore[no-any-return]


def upstream_failed(exc: Exception, config: GatewayConfig, what: str = "unreachable") -> JSONResponse:
    """The 502 for an upstream that failed: the client learns the kind of failure, never the upstream's address
    (which may carry credentials); the log gets the details with secrets masked."""
    log.warning(f"upstream {what}", upstream=config.upstream_shown, error=mask_text(str(exc)),
                kind=type(exc).__name__)
    return openai_error(502, f"upstream {what} ({type(exc).__name__})", "upstream_error")


class Gateway:
    """State of one gateway: the upstream client, open sessions, the capture queue; with ``metrics``, the
    gateway's overhead per captured call (``metric_names.GATEWAY_OVERHEAD_S``, Prometheus only).

    With ``fleet`` (it takes precedence over ``route``), the policy's model names address versions (``policy`` the
    serving one, ``policy@N`` version N) and each request and session is pinned to one version, sent to a replica
    that acknowledged loading it (docs/promotion.md)."""

    def __init__(self, config: GatewayConfig, publisher: Submitter, route: RouteSource | None = None,
                 client: httpx.AsyncClient | None = None, metrics: MetricsPublisher | None = None,
                 access: AccessConfig | None = None, fleet: FleetRouter | StaticFleet | None = None) -> None:
        self.config = config
        self.fleet = fleet
        self.access = access if access is not None else AccessConfig()
        self.keys = self.access.key_store()
        secret = self.access.feedback_secret
        self.signer = FeedbackSigner(secret.get_secret_value() if secret is not None else generate_secret(),
                                     self.access.feedback_token_ttl_s)
        self.feedback_index = FeedbackIndex(config.remembered_trajectories)
        self.publisher = publisher
        self.route = route
        self.metrics = metrics
        self.sessions = SessionStore(config.session_idle_s, config.remembered_trajectories,
                                     max_open=config.max_open_sessions, max_turns=config.max_session_turns,
                                     max_bytes=config.max_session_bytes)
        self.limit_stats = LimitStats()
        self.capture = CaptureQueue(publisher, config.queue_size, spool_after_s=config.spool_after_s)
        self._client = client
        self._own_client = client is None
        self._sweeper: asyncio.Task[None] | None = None
        self.request_token_data = config.request_token_data
        #: a session's calls go to ``calls`` and the stream app stitches them (no session held here)
        self.stitch_in_streams = config.session_stitching == "streams"
        self.gateway_id = config.gateway_id or f"{config.host}:{config.port}"

    # -- lifecycle --
    async def start(self) -> None:
        if self._client is None:
            key = self.config.upstream_key
            headers = {"authorization": f"Bearer {key}"} if key else {}
            # with a fleet, each replica's requests in flight are counted (least outstanding routing)
            transport = OutstandingTransport(self.fleet.outstanding) if self.fleet is not None else None
            self._client = httpx.AsyncClient(timeout=self.config.upstream_timeout_s, headers=headers,
                                             transport=transport)
        if self.config.spool_dir is not None and self.capture.spool is None:
            self.capture.use_spool(await asyncio.to_thread(
                Spool.open, self.config.spool_dir, self.config.spool_max_bytes, self.config.spool_segment_bytes))
        self.capture.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="gateway-sessions")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for traj in self.sessions.close_all():
            self.publish(traj)
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

    # -- capture --
    def publish(self, traj: Trajectory) -> None:
        try:
            event = traj.to_event(run_id=self.config.run_id, policy=self.config.policy,
                                  producer_id=self.config.producer_id)
        except Exception as exc:  # a malformed call must not take the server down
            log.error("trajectory not built", trajectory_id=traj.trajectory_id, error=str(exc))
            return
        self.capture.put(event)

    def publish_call(self, call: CallEvent) -> bool:
        """Queue one record of a session for ``calls`` (the stream app stitches it); False when it was dropped."""
        return self.capture.put(call)

    def _tenant_of(self, scoped_session: str) -> str:
        """The tenant of a scoped session id ('' for an open gateway, which keeps ids as sent)."""
        return scoped_session.split(":", 1)[0] if self.keys.enabled else ""

    async def _route_pinned(self, model: str, session_id: str | None,
                            scopes: frozenset[str] = frozenset()) -> tuple[str, int, str]:
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
                                           session_id, scopes=scopes)
        except (VersionNotLoaded, VersionForbidden, NoServingVersion):
            raise
        except Exception as exc:  # Redis unreachable: the request goes out as asked, to the configured upstream
            log.warning("policy version unknown (router failed); request sent as asked", error=str(exc))
            return model, self.config.policy_version, self.config.upstream_base
        base = route.url.rstrip("/") if route.url else self.config.upstream_base
        return route.model, route.version, base if base.endswith("/v1") else base + "/v1"

    async def _route(self, model: str) -> tuple[str, int]:
        if self.route is not None and model in (self.config.policy, self.config.served_model):
            try:
                return await self.route()
            except Exception as exc:
                log.warning("policy version unknown (router failed); request sent as asked", error=str(exc))
        return model, self.config.policy_version

    def _begin(self, session_id: str | None, body: dict[str, Any], prompt_ids: list[int] | None, version: int,
               task: str | None) -> tuple[Trajectory, dict[str, str]]:
        if session_id is not None and self.stitch_in_streams:  # the stitcher decides; the id is derived
            traj = Trajectory(session_id=session_id, policy_version=version, task=task,
                              trajectory_id=session_trajectory_id(session_id))
            self.sessions.remember(traj)
            return traj, {"x-rlstream-trajectory-id": traj.trajectory_id, "x-rlstream-policy-version": str(version),
                          "x-rlstream-session-id": session_id}
        messages = []
        with contextlib.suppress(Exception):
            messages = [to_message(m) for m in body.get("messages", [])]
        traj, closed = self.sessions.begin(session_id, prompt_ids, messages, version, task)
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

    def _finish(self, traj: Trajectory, body: dict[str, Any], message: dict[str, Any], prompt_ids: list[int] | None,
                completion_ids: list[int] | None, logprobs: list[float] | None, finish_reason: str | None,
                served: str, version: int | None = None) -> None:
        try:  # the turn carries the version this call was routed to (a session may straddle a reload)
            call = recorded_call(body, message, prompt_ids, completion_ids, logprobs, finish_reason, served,
                                 policy_version=version)
        except Exception as exc:
            log.error("call not captured", error=str(exc))
            return
        if traj.session_id is not None and self.stitch_in_streams:
            self.publish_call(CallEvent(
                session_id=traj.session_id, tenant=self._tenant_of(traj.session_id), task=traj.task,
                run_id=self.config.run_id, policy=self.config.policy,
                policy_version=version if version is not None else traj.policy_version,
                request_messages=call.request_messages, response_message=call.response_message, turn=call.turn,
                served_model=call.served_model, gateway_id=self.gateway_id))
            return
        if traj.closed and traj.session_id is not None:
            log.warning("call finished after its session trajectory closed; captured alone",
                        trajectory_id=traj.trajectory_id)
            traj = Trajectory(session_id=traj.session_id, policy_version=traj.policy_version, task=traj.task)
            self.sessions.remember(traj)
            traj.add(call)
            self.publish(traj)
            return
        traj.add(call)
        if traj.session_id is None:
            traj.closed = True
            self.publish(traj)

    def _begin_choices(self, n: int, version: int, task: str | None) -> tuple[list[Trajectory], dict[str, str]]:
        """``n > 1``: one trajectory per choice, together one GRPO group (the N generations of one prompt)."""
        group = new_id()
        trajs = []
        for index in range(n):
            traj = Trajectory(session_id=None, policy_version=version, task=task, choices_group=group,
                              group_size=n, generation_index=index)
            self.sessions.remember(traj)
            trajs.append(traj)
        ids = [t.trajectory_id for t in trajs]
        return trajs, {"x-rlstream-trajectory-id": ids[0], "x-rlstream-trajectory-ids": ",".join(ids),
                       "x-rlstream-group-id": group, "x-rlstream-policy-version": str(version)}

    def _capture_choices(self, body: dict[str, Any], payload: dict[str, Any], version: int, task: str | None,
                         served: str) -> dict[str, str]:
        """The choices of a whole (not streamed) ``n > 1`` answer, captured as one group."""
        choices = payload.get("choices") or []
        trajs, headers = self._begin_choices(len(choices), version, task)
        for index, (traj, choice) in enumerate(zip(trajs, choices)):
            prompt_ids, completion_ids, logprobs = token_data(payload, choice_index=index)
            self._finish(traj, body, choice.get("message") or {"role": "assistant"}, prompt_ids, completion_ids,
                         logprobs, choice.get("finish_reason"), served, version)
        return headers

    async def _overhead(self, route: str, streamed: bool, started: float, upstream_s: float) -> None:
        """Report the time since ``started`` (``time.perf_counter``) that was not spent waiting for the upstream."""
        if self.metrics is not None:
            overhead_s = max(0.0, time.perf_counter() - started - upstream_s)
            await self.metrics.emit(mn.GATEWAY_OVERHEAD_S, overhead_s,
                                    tags={"route": route, "streamed": "true" if streamed else "false"})

    # -- upstream --
    async def _send(self, body: dict[str, Any], stream: bool, base: str | None = None) -> httpx.Response:
        url = (base or self.config.upstream_base) + "/chat/completions"
        sent = upstream_request(body, self.request_token_data, self.config.request_logprobs)
        request = self.client.build_request("POST", url, json=sent)
        response = await self.client.send(request, stream=stream)
        if self.request_token_data and response.status_code in (400, 422):
            text = (await response.aread()).decode(errors="replace")
            if rejects_extensions(response.status_code, text):
                await response.aclose()
                log.warning("upstream rejects token-data options; capturing without token data", error=text[:200])
                self.request_token_data = False
                request = self.client.build_request("POST", url, json=upstream_request(body, False))
                response = await self.client.send(request, stream=stream)
        return response

    # -- callers --
    def _scoped(self, tenant: str, session_id: str) -> str:
        """The gateway's own name of a tenant's session id (two tenants' equal ids never meet; an open gateway
        has one tenant and keeps the id as sent)."""
        return f"{tenant}:{session_id}" if self.keys.enabled else session_id

    def _is_policy_model(self, model: str) -> bool:
        return model == self.config.served_model or parse_model_name(model, self.config.policy)[0]

    def _admit(self, request: Request, model: str) -> tuple[Principal, str | None, str | None, bool]:
        """(the caller, its task, its scoped session id or None, whether the call is captured) of an inference
        call for ``model``; :class:`AuthRefusal` (403) for a model or a task the caller's key may not use."""
        caller: Principal = request.scope.get(PRINCIPAL_KEY) or OPEN
        policy_models = (self.config.policy, self.config.served_model)
        named, _ = parse_model_name(model, self.config.policy)  # policy@N: a version of the policy
        if not (caller.may_call(model, policy_models) or named and caller.may_call(self.config.policy, policy_models)):
            raise forbidden(f"this API key may not call model {model!r}", "model_not_allowed")
        task = task_for(caller, request.headers.get(TASK_HEADER) or None)
        session_id = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER) or None
        scoped = self._scoped(caller.tenant, session_id) if session_id else None
        return caller, task, scoped, caller.open_access or self._is_policy_model(model)

    def _sign(self, headers: dict[str, str], caller: Principal, session_id: str | None,
              response_id: Any = None) -> dict[str, str]:
        """Add the feedback token(s) of the captured trajectories named in ``headers``, record their owner (and
        the response id of the body), and show the session id as the client sent it."""
        ids = headers.get("x-rlstream-trajectory-ids")
        trajectory_ids = ids.split(",") if ids else [headers["x-rlstream-trajectory-id"]]
        tokens = []
        for trajectory_id in trajectory_ids:
            self.feedback_index.own(caller.tenant, trajectory_id)
            if session_id is not None and not ids and self.stitch_in_streams:  # any gateway routes it to the stitcher
                tokens.append(self.signer.issue(caller.tenant, "session", self._scoped(caller.tenant, session_id)))
            else:
                tokens.append(self.signer.issue(caller.tenant, "trajectory", trajectory_id))
        headers[FEEDBACK_TOKEN_HEADER] = tokens[0]
        if ids:  # n > 1: the response id names the whole group, no one trajectory (not indexed)
            headers["x-rlstream-feedback-tokens"] = ",".join(tokens)
        elif response_id is not None:
            self.feedback_index.add_response(caller.tenant, response_id, trajectory_ids[0])
        if session_id is not None:
            headers["x-rlstream-session-id"] = session_id
        return headers

    async def _passthrough(self, path: str, body: dict[str, Any]) -> Response:
        """A call for a model that is not the policy's: passed to the upstream as it came, not captured."""
        try:
            upstream = await self.client.send(self.client.build_request("POST", self.config.upstream_base + path,
                                                                        json=body), stream=True)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.config)
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "application/json"),
                                 background=BackgroundTask(upstream.aclose))

    # -- routes --
    async def chat_completions(self, request: Request) -> Response:
        started = time.perf_counter()
        body = parse_json(await request.body(), self.config.max_json_depth)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return openai_error(400, "a chat completion request is a JSON object with a 'messages' list")
        check_choices(body, self.config.max_choices)
        caller, task, session_id, captured = self._admit(request, str(body.get("model", "")))
        if not captured:
            return await self._passthrough("/chat/completions", body)
        asked = client_asked(body)
        try:
            model, version, base = await self._route_pinned(str(body.get("model", "")), session_id, caller.scopes)
        except VersionNotLoaded as exc:
            return openai_error(404, str(exc), "model_not_found")
        except VersionForbidden as exc:
            return openai_error(403, str(exc), "permission_denied")
        except NoServingVersion as exc:
            return openai_error(503, str(exc), "no_serving_version")
        upstream_body = {**body, "model": model}
        stream = bool(body.get("stream"))
        upstream_started = time.perf_counter()
        try:
            response = await self._send(upstream_body, stream, base)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.config)
        if stream and response.status_code == 200:
            return await self._stream(response, body, asked, session_id, task, version, model, started,
                                      upstream_started, caller)
        raw = await response.aread() if stream else response.content
        upstream_s = time.perf_counter() - upstream_started
        if response.status_code != 200:
            await response.aclose()
        payload = upstream_json(response, raw, self.config.max_choices)
        if isinstance(payload, Response):
            return payload
        try:
            prompt_ids, completion_ids, logprobs = token_data(payload)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            log.warning("upstream token data unreadable; captured without it", error=str(exc))
            prompt_ids = completion_ids = logprobs = None
        choices = payload.get("choices") or []
        if len(choices) > 1 and session_id is None:
            headers = self._capture_choices(body, payload, version, task, model)
        else:
            if len(choices) > 1:
                log.warning("n > 1 inside a session: the session keeps the first choice", session_id=session_id,
                            choices=len(choices))
            traj, headers = self._begin(session_id, body, prompt_ids, version, task)
            if choices:
                self._finish(traj, body, choices[0].get("message") or {"role": "assistant"}, prompt_ids,
                             completion_ids, logprobs, choices[0].get("finish_reason"), model, version)
        out = filter_response(payload, asked)
        if "model" in out and out.get("model") == model:
            out["model"] = body.get("model", model)
        answer = JSONResponse(out, headers=self._sign(headers, caller, request_session(request), payload.get("id")))
        await self._overhead("chat_completions", False, started, upstream_s)
        return answer

    async def responses(self, request: Request) -> Response:
        """``/v1/responses``, streamed or not, passed to the upstream (where it has the API) and recorded like a chat
        call, with the exact prompt and completion token ids and logprobs vLLM returns (``responses.py``)."""
        started = time.perf_counter()
        body = parse_json(await request.body(), self.config.max_json_depth)
        if not isinstance(body, dict):
            return openai_error(400, "a Responses request is a JSON object")
        try:
            messages = request_messages(body)
        except ValueError as exc:
            return openai_error(400, str(exc))
        caller, task, session_id, captured = self._admit(request, str(body.get("model", "")))
        if not captured:
            return await self._passthrough("/responses", body)
        try:
            model, version, base = await self._route_pinned(str(body.get("model", "")), session_id, caller.scopes)
        except VersionNotLoaded as exc:
            return openai_error(404, str(exc), "model_not_found")
        except VersionForbidden as exc:
            return openai_error(403, str(exc), "permission_denied")
        except NoServingVersion as exc:
            return openai_error(503, str(exc), "no_serving_version")
        stream = bool(body.get("stream"))
        upstream_started = time.perf_counter()
        try:
            upstream = await self._send_responses({**body, "model": model}, stream, base)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.config)
        if upstream.status_code == 404:
            await upstream.aclose()
            return openai_error(404, "the upstream has no Responses API", "not_found_error")
        recorded = recorded_request(body, messages)
        asked = responses_asked(body)
        if stream and upstream.status_code == 200:
            return await self._stream_responses(upstream, request, recorded, asked, caller, session_id, task,
                                                version, model, started, upstream_started)
        raw = await upstream.aread() if stream else upstream.content
        await upstream.aclose()
        upstream_s = time.perf_counter() - upstream_started
        payload = upstream_json(upstream, raw, self.config.max_choices)
        if isinstance(payload, Response):
            return payload
        tokens = response_tokens(payload)
        traj, headers = self._begin(session_id, recorded, tokens.prompt_ids, version, task)
        self._finish(traj, recorded, response_message(payload), tokens.prompt_ids, tokens.completion_ids,
                     tokens.logprobs, responses_finish_reason(payload), model, version)
        payload = filter_response_payload(payload, asked)
        if payload.get("model") == model:
            payload["model"] = body.get("model", model)
        answer = JSONResponse(payload, headers=self._sign(headers, caller, request_session(request), payload.get("id")))
        await self._overhead("responses", False, started, upstream_s)
        return answer

    async def _send_responses(self, body: dict[str, Any], stream: bool, base: str) -> httpx.Response:
        """Send a Responses request asking for token data; an upstream that refuses the token-data fields gets the
        request as the client sent it (and capture goes on without token data)."""
        url = base + "/responses"
        sent = responses_upstream_request(body, self.request_token_data, self.config.request_logprobs)
        response = await self.client.send(self.client.build_request("POST", url, json=sent), stream=stream)
        if sent is not body and self.request_token_data and response.status_code in (400, 422):
            text = (await response.aread()).decode(errors="replace")
            if rejects_token_options(response.status_code, text):
                await response.aclose()
                log.warning("upstream rejects Responses token-data options; capturing without token data",
                            error=text[:200])
                response = await self.client.send(self.client.build_request("POST", url, json=body),
                                                  stream=stream)
        return response

    async def _stream_responses(self, response: httpx.Response, request: Request, recorded: dict[str, Any],
                                asked: ResponsesAsked, caller: Principal, session_id: str | None, task: str | None,
                                version: int, model: str, started: float, upstream_started: float) -> Response:
        """Pass a streamed Responses answer on event by event while following it; the call is recorded from its
        final event (``response.completed``), which carries the token ids."""
        lines = response.aiter_lines()
        capture = ResponsesStreamCapture(asked, model, str(recorded.get("model") or model))
        pending: list[str] = []
        try:  # up to the first event (response.created): its response id is indexed for feedback
            async for line in lines:
                pending.append(capture.render(line))
                if capture.response_id is not None:
                    break
        except httpx.HTTPError as exc:
            await response.aclose()
            return upstream_failed(exc, self.config, "stream failed")
        upstream_s = time.perf_counter() - upstream_started
        traj, headers = self._begin(session_id, recorded, None, version, task)
        headers = self._sign(headers, caller, request_session(request), capture.response_id)

        async def events() -> AsyncIterator[str]:
            try:
                yield "".join(pending)
                await self._overhead("responses", True, started, upstream_s)
                event: list[str] = []
                async for line in lines:
                    event.append(capture.render(line))
                    if not line or len(event) >= MAX_LINES_PER_WRITE:
                        yield "".join(event)
                        event.clear()
                if event:
                    yield "".join(event)
            finally:
                await response.aclose()
                tokens = capture.tokens()
                if capture.final is not None and tokens is not None:
                    self._finish(traj, recorded, response_message(capture.final), tokens.prompt_ids,
                                 tokens.completion_ids, tokens.logprobs, responses_finish_reason(capture.final),
                                 model, version)
                elif capture.events:
                    log.warning("streamed Responses call ended without its final event; not captured",
                                trajectory_id=traj.trajectory_id)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def _stream(self, response: httpx.Response, body: dict[str, Any], asked: ClientAsked,
                      session_id: str | None, task: str | None, version: int, model: str, started: float,
                      upstream_started: float, caller: Principal = OPEN) -> Response:
        """Pass a streamed answer on while accumulating it; the overhead reported is the time up to handing on the
        first event, less the upstream's time to it (``started``, ``upstream_started``: ``time.perf_counter``)."""
        lines = response.aiter_lines()
        pending: list[str] = []
        first: dict[str, Any] | None = None
        try:  # read up to the first event: its prompt token ids decide the session trajectory
            async for line in lines:
                pending.append(line)
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    with contextlib.suppress(json.JSONDecodeError):
                        first = json.loads(line[5:])
                    break
        except httpx.HTTPError as exc:
            await response.aclose()
            return upstream_failed(exc, self.config, "stream failed")
        upstream_s = time.perf_counter() - upstream_started
        prompt_ids = (first or {}).get("prompt_token_ids")
        n = requested_choices(body)
        if n > 1 and session_id is None:  # the headers go out first: the group's trajectories exist up front
            trajs, headers = self._begin_choices(n, version, task)
        else:
            if n > 1:
                log.warning("n > 1 inside a session: the session keeps the first choice", session_id=session_id,
                            choices=n)
            traj, headers = self._begin(session_id, body, prompt_ids, version, task)
            trajs = [traj]
        accumulators = [StreamAccumulator(prompt_ids, choice_index=index) for index in range(len(trajs))]
        client_model = body.get("model", model)
        client_session = session_id.split(":", 1)[1] if session_id and self.keys.enabled else session_id
        headers = self._sign(headers, caller, client_session, (first or {}).get("id"))

        def render(line: str) -> str | None:
            if not line.startswith("data:"):
                return line + "\n"
            data = line[5:].strip()
            if data == "[DONE]" or not data:
                return line + "\n"
            try:
                chunk = json.loads(data)
            except (ValueError, RecursionError):
                return line + "\n"
            if not isinstance(chunk, dict):
                return line + "\n"
            for acc in accumulators:
                try:
                    acc.add(chunk)
                except (TypeError, ValueError, AttributeError) as exc:  # handed on as it came, not captured
                    log.warning("malformed upstream stream chunk not captured", error=str(exc))
            out = filter_response(chunk, asked)
            if out.get("model") == model:
                out["model"] = client_model
            return "data: " + json.dumps(out, separators=(",", ":")) + "\n"

        async def events() -> AsyncIterator[str]:
            try:
                for index, line in enumerate(pending):
                    text = render(line)
                    if text is not None:
                        yield text
                    if index == len(pending) - 1:  # the first event is handed on
                        await self._overhead("chat_completions", True, started, upstream_s)
                event: list[str] = []
                async for line in lines:
                    text = render(line)
                    if text is not None:
                        event.append(text)
                    # a blank line ends a server-sent event: it goes on whole, in one write instead of one per line
                    if not line or len(event) >= MAX_LINES_PER_WRITE:
                        yield "".join(event)
                        event.clear()
                if event:
                    yield "".join(event)
            finally:
                await response.aclose()
                for traj, acc in zip(trajs, accumulators):
                    if acc.chunks:
                        self._finish(traj, body, acc.message(), acc.prompt_ids, acc.completion_ids(),
                                     acc.logprobs(), acc.finish_reason, model, version)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def models(self, request: Request) -> Response:
        try:
            response = await self.client.get(self.config.upstream_base + "/models")
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.config)
        if response.status_code == 200:
            with contextlib.suppress(ValueError, RecursionError):  # the served names, never the server's paths
                return JSONResponse(public_models(response.json()))
        return Response(response.content, status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))

    async def end_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        check_id(session_id, "session id", self.config.max_id_chars)
        caller: Principal = request.scope.get(PRINCIPAL_KEY) or OPEN
        scoped = self._scoped(caller.tenant, session_id)
        if self.stitch_in_streams:  # the stitcher holds the session: the end goes where its calls went
            queued = self.publish_call(CallEvent(session_id=scoped, kind=CallKind.end, tenant=caller.tenant,
                                                 run_id=self.config.run_id, policy=self.config.policy,
                                                 gateway_id=self.gateway_id))
            return JSONResponse({"session_id": session_id, "published": queued}, status_code=202 if queued else 503)
        traj = self.sessions.close(scoped)
        if traj is None:
            known = self.sessions.lookup(session_id=scoped)
            if known is None:
                return openai_error(404, f"unknown session {session_id!r}", "not_found")
            return JSONResponse({"session_id": session_id, "trajectory_id": known.trajectory_id, "published": False})
        self.publish(traj)
        return JSONResponse({"session_id": session_id, "trajectory_id": traj.trajectory_id, "published": True})

    async def new_session(self, request: Request) -> Response:
        """``POST /v1/sessions``: an unguessable session id for a client that has none of its own."""
        return JSONResponse({"session_id": secrets.token_urlsafe(24)}, status_code=201)

    async def feedback(self, request: Request) -> Response:
        """A reward for a trajectory (by its id, the response id of its body, its session, or the feedback token
        alone), from the holder of its feedback token or a key with the feedback scope of the same tenant. Another
        tenant's trajectory answers exactly as one that does not exist."""
        raw = parse_json(await request.body(), self.config.max_json_depth)
        try:
            fb = Feedback.model_validate(raw, context={RANGE_CONTEXT: self.access.reward_range})
        except ValidationError as exc:
            problems = validation_problems(exc.errors())
            text = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
            return openai_error(422, f"invalid feedback: {text}", problems=problems)
        return self.accept_feedback(request, fb)

    def accept_feedback(self, request: Request, fb: Feedback) -> Response:
        """Publish the RewardEvent of a validated feedback (``/v1/feedback`` and the observability tools' shapes,
        ``feedback_shapes.py``), under the same rules: the feedback token, or a key of the trajectory's tenant."""
        token = request.headers.get(FEEDBACK_TOKEN_HEADER) or fb.feedback_token or request.scope.get(
            BEARER_TOKEN_KEY)
        caller: Principal | None = request.scope.get(PRINCIPAL_KEY, OPEN)
        granted: str | None = None  # the trajectory a token names
        if token:
            try:
                grant = self.signer.verify(token)
            except FeedbackTokenError as exc:
                raise unauthorized(str(exc), "feedback_token_expired" if exc.expired else "invalid_feedback_token")
            tenant = grant.tenant
            if grant.kind == "trajectory":
                granted = grant.target_id
            elif self.stitch_in_streams:  # a session token: the stitcher knows the session's latest trajectory
                return self._session_feedback(grant.target_id, fb)
            else:  # a session token (its id already scoped): the session's latest trajectory
                latest = self.sessions.lookup(session_id=grant.target_id)
                granted = latest.trajectory_id if latest is not None else ""
        elif caller is None:
            raise unauthorized("feedback needs the response's feedback token (x-rlstream-feedback-token) or an API "
                               "key with the feedback scope", "missing_api_key")
        else:
            tenant = caller.tenant
        if granted is None and not (fb.trajectory_id or fb.response_id or fb.session_id):
            problem = "name trajectory_id, response_id or session_id, or send the response's feedback token"
            return openai_error(422, f"invalid feedback: {problem}", problems=[{"field": "(body)",
                                                                               "problem": problem}])
        if self.stitch_in_streams and granted is None and fb.session_id and not (fb.trajectory_id or fb.response_id):
            return self._session_feedback(self._scoped(tenant, fb.session_id), fb)
        known = self._feedback_target(fb, tenant, granted)
        if known is None:
            what = (f"trajectory {fb.trajectory_id!r}" if fb.trajectory_id else f"response {fb.response_id!r}"
                    if fb.response_id else f"session {fb.session_id!r}" if fb.session_id else "trajectory")
            return openai_error(404, f"unknown {what}", "not_found")
        still_open = self.sessions.open_trajectory(known.trajectory_id)
        if still_open is not None:  # it will carry the reward itself too
            still_open.reward, still_open.reward_components = fb.reward, dict(fb.components)
        event = RewardEvent(trajectory_id=known.trajectory_id, group_id=known.group_id, example_id=known.example_id,
                            run_id=self.config.run_id, reward=fb.reward, components=dict(fb.components),
                            feedback_id=fb.feedback_id)
        queued = self.capture.put(event)
        return JSONResponse({"trajectory_id": known.trajectory_id, "queued": queued},
                            status_code=202 if queued else 503)

    def _session_feedback(self, scoped_session: str, fb: Feedback) -> Response:
        """A reward for a session's latest trajectory, through ``calls``: the stream app's stitcher gives it to the
        open trajectory, or publishes the RewardEvent of the last one, or keeps it for the first one."""
        queued = self.publish_call(CallEvent(
            session_id=scoped_session, kind=CallKind.feedback, tenant=self._tenant_of(scoped_session),
            run_id=self.config.run_id, policy=self.config.policy, reward=fb.reward,
            reward_components=dict(fb.components), feedback_id=fb.feedback_id, gateway_id=self.gateway_id))
        client_session = scoped_session.split(":", 1)[1] if self.keys.enabled else scoped_session
        return JSONResponse({"session_id": client_session, "queued": queued}, status_code=202 if queued else 503)

    def _feedback_target(self, fb: Feedback, tenant: str, granted: str | None) -> KnownTrajectory | None:
        """The trajectory ``fb`` rewards, when it exists and belongs to ``tenant`` (and is the one a token
        grants); None otherwise, whichever the reason."""
        if fb.trajectory_id:
            trajectory_id: str | None = fb.trajectory_id
        elif fb.response_id:
            trajectory_id = self.feedback_index.response(tenant, fb.response_id)
        elif fb.session_id:
            known = self.sessions.lookup(session_id=self._scoped(tenant, fb.session_id))
            trajectory_id = known.trajectory_id if known is not None else None
        else:
            trajectory_id = granted
        if trajectory_id is None or (granted is not None and trajectory_id != granted):
            return None
        owner = self.feedback_index.owner(trajectory_id)
        if owner is not None and owner != tenant or owner is None and self.keys.enabled:
            return None
        return self.sessions.lookup(trajectory_id)

    async def stats(self, request: Request) -> Response:
        return JSONResponse({"capture": asdict(self.capture.stats), "queue_depth": self.capture.queue.qsize(),
                             "spool": self.capture.figures(),
                             "session_stitching": self.config.session_stitching,
                             "open_sessions": len(self.sessions.open),
                             "session_splits": self.sessions.splits,
                             "sessions_evicted": self.sessions.evicted,
                             "session_splits_long": self.sessions.splits_long,
                             "rejected": dict(self.limit_stats.rejected),
                             "in_flight": self.limit_stats.in_flight,
                             "session_retokenized": self.sessions.retokenized,
                             "request_token_data": self.request_token_data,
                             "request_logprobs": self.request_token_data and self.config.request_logprobs})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


def create_app(gateway: Gateway) -> Starlette:
    """The Starlette app of ``gateway`` (its lifespan starts and stops the gateway)."""
    routes = []
    shapes = FeedbackShapes(gateway)
    for prefix in ("", "/s/{session_id}"):
        routes += [Route(prefix + "/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
                   Route(prefix + "/v1/responses", gateway.responses, methods=["POST"]),
                   Route(prefix + "/v1/models", gateway.models, methods=["GET"])]
    routes += [
        Route("/v1/sessions", gateway.new_session, methods=["POST"]),
        Route("/v1/sessions/{session_id}/end", gateway.end_session, methods=["POST"]),
        Route("/v1/feedback", gateway.feedback, methods=["POST"]),
        Route("/api/public/scores", shapes.langfuse_score, methods=["POST"]),
        Route("/feedback", shapes.langsmith_feedback, methods=["POST"]),
        Route("/api/v1/feedback", shapes.langsmith_feedback, methods=["POST"]),
        Route("/feedback/{feedback_id}", shapes.langsmith_update, methods=["PATCH"]),
        Route("/api/v1/feedback/{feedback_id}", shapes.langsmith_update, methods=["PATCH"]),
        Route("/v1/logs", shapes.otlp_logs, methods=["POST"]),
        Route("/rlstream/stats", gateway.stats, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
    ]

    async def rejected(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestRejected)
        gateway.limit_stats.count(exc.reason)
        answer = openai_error(exc.status, exc.message, exc.kind)
        if exc.close:  # the body was not read whole: the connection cannot carry another request
            answer.headers["connection"] = "close"
        return answer

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, AuthRefusal)
        gateway.limit_stats.count(exc.code)
        return Response(exc.body(), status_code=exc.status, media_type="application/json")

    return Starlette(routes=routes, lifespan=gateway.lifespan,
                     middleware=[Middleware(RequestLimits, config=gateway.config, stats=gateway.limit_stats),
                                 Middleware(AuthMiddleware, keys=gateway.keys, count=gateway.limit_stats.count)],
                     exception_handlers={RequestRejected: rejected, AuthRefusal: refused, 404: not_served,
                                         405: not_served})
