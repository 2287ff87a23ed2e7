"""The gateway's HTTP server (Starlette): OpenAI-compatible routes, capture, sessions and feedback."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import asdict
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlstream.rollout.gateway.config import GatewayConfig
from rlstream.rollout.gateway.filtering import (ClientAsked, client_asked, filter_response, rejects_extensions,
                                                upstream_request)
from rlstream.rollout.gateway.limits import (LimitStats, RequestLimits, RequestRejected, check_choices, check_id,
                                             malformed_answer, parse_json)
from rlstream.rollout.gateway.queue import CaptureQueue, Submitter
from rlstream.rollout.gateway.responses import request_messages, response_message
from rlstream.rollout.gateway.spool import Spool
from rlstream.rollout.gateway.sessions import SessionStore, Trajectory, recorded_call
from rlstream.rollout.capture import to_message, token_data
from rlstream.rollout.streaming import StreamAccumulator
from rlstream.transport import metric_names as mn
from rlstream.transport.log import get_logger
from rlstream.transport.metrics import MetricsPublisher
from rlstream.schemas.masking import mask_text
from rlstream.schemas.models import RewardEvent, new_id

log = get_logger(__name__)

SESSION_HEADER = "x-session-id"
TASK_HEADER = "x-rlstream-task"
#: A streamed answer's lines are handed on an event at a time (up to its blank line); an upstream that writes long
#: runs of lines without one is handed on this many lines at a time.
MAX_LINES_PER_WRITE = 16
#: ``async () -> (model name to request, policy version)``, e.g. ``VersionRouter.current`` adapted.
RouteSource = Callable[[], Awaitable[tuple[str, int]]]


def openai_error(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status, **extra}},
                        status_code=status)


class Feedback(BaseModel):
    """Body of ``POST /v1/feedback``."""

    model_config = ConfigDict(extra="forbid")
    trajectory_id: str | None = None
    session_id: str | None = None
    reward: float
    components: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_id(self) -> "Feedback":
        if not (self.trajectory_id or self.session_id):
            raise ValueError("give trajectory_id or session_id")
        return self


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
    gateway's overhead per captured call (``metric_names.GATEWAY_OVERHEAD_S``, Prometheus only)."""

    def __init__(self, config: GatewayConfig, publisher: Submitter, route: RouteSource | None = None,
                 client: httpx.AsyncClient | None = None, metrics: MetricsPublisher | None = None) -> None:
        self.config = config
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

    # -- lifecycle --
    async def start(self) -> None:
        if self._client is None:
            key = self.config.upstream_key
            headers = {"authorization": f"Bearer {key}"} if key else {}
            self._client = httpx.AsyncClient(timeout=self.config.upstream_timeout_s, headers=headers)
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

    async def _route(self, model: str) -> tuple[str, int]:
        if self.route is not None and model in (self.config.policy, self.config.served_model):
            try:
                return await self.route()
            except Exception as exc:
                log.warning("policy version unknown (router failed); request sent as asked", error=str(exc))
        return model, self.config.policy_version

    def _begin(self, session_id: str | None, body: dict[str, Any], prompt_ids: list[int] | None, version: int,
               task: str | None) -> tuple[Trajectory, dict[str, str]]:
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
                served: str) -> None:
        try:
            call = recorded_call(body, message, prompt_ids, completion_ids, logprobs, finish_reason, served)
        except Exception as exc:
            log.error("call not captured", error=str(exc))
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
                         logprobs, choice.get("finish_reason"), served)
        return headers

    async def _overhead(self, route: str, streamed: bool, started: float, upstream_s: float) -> None:
        """Report the time since ``started`` (``time.perf_counter``) that was not spent waiting for the upstream."""
        if self.metrics is not None:
            overhead_s = max(0.0, time.perf_counter() - started - upstream_s)
            await self.metrics.emit(mn.GATEWAY_OVERHEAD_S, overhead_s,
                                    tags={"route": route, "streamed": "true" if streamed else "false"})

    # -- upstream --
    async def _send(self, body: dict[str, Any], stream: bool) -> httpx.Response:
        url = self.config.upstream_base + "/chat/completions"
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

    # -- routes --
    async def chat_completions(self, request: Request) -> Response:
        started = time.perf_counter()
        body = parse_json(await request.body(), self.config.max_json_depth)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return openai_error(400, "a chat completion request is a JSON object with a 'messages' list")
        check_choices(body, self.config.max_choices)
        session_id = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER) or None
        task = request.headers.get(TASK_HEADER) or None
        asked = client_asked(body)
        model, version = await self._route(str(body.get("model", "")))
        upstream_body = {**body, "model": model}
        stream = bool(body.get("stream"))
        upstream_started = time.perf_counter()
        try:
            response = await self._send(upstream_body, stream)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.config)
        if stream and response.status_code == 200:
            return await self._stream(response, body, asked, session_id, task, version, model, started,
                                      upstream_started)
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
                             completion_ids, logprobs, choices[0].get("finish_reason"), model)
        out = filter_response(payload, asked)
        if "model" in out and out.get("model") == model:
            out["model"] = body.get("model", model)
        answer = JSONResponse(out, headers=headers)
        await self._overhead("chat_completions", False, started, upstream_s)
        return answer

    async def responses(self, request: Request) -> Response:
        """``/v1/responses`` passed to the upstream (where it has the API) and recorded like a chat call (no token
        data: the Responses API has no token-id extension). Streamed responses are passed through, not recorded."""
        started = time.perf_counter()
        body = parse_json(await request.body(), self.config.max_json_depth)
        if not isinstance(body, dict):
            return openai_error(400, "a Responses request is a JSON object")
        try:
            messages = request_messages(body)
        except ValueError as exc:
            return openai_error(400, str(exc))
        session_id = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER) or None
        task = request.headers.get(TASK_HEADER) or None
        model, version = await self._route(str(body.get("model", "")))
        url = self.config.upstream_base + "/responses"
        stream = bool(body.get("stream"))
        upstream_started = time.perf_counter()
        try:
            upstream = await self.client.send(self.client.build_request("POST", url, json={**body, "model": model}),
                                              stream=stream)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.config)
        upstream_s = time.perf_counter() - upstream_started
        if upstream.status_code == 404:
            await upstream.aclose()
            return openai_error(404, "the upstream has no Responses API", "not_found_error")
        if stream:
            log.warning("streamed Responses call passed through without capture")
            return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type", "text/event-stream"),
                                     background=BackgroundTask(upstream.aclose))
        payload = upstream_json(upstream, upstream.content, self.config.max_choices)
        if isinstance(payload, Response):
            return payload
        chat_body = {"model": body.get("model", model), "messages": messages}
        traj, headers = self._begin(session_id, chat_body, None, version, task)
        status = payload.get("status")
        self._finish(traj, chat_body, response_message(payload), None, None, None,
                     "stop" if status in (None, "completed") else str(status), model)
        if payload.get("model") == model:
            payload["model"] = body.get("model", model)
        answer = JSONResponse(payload, headers=headers)
        await self._overhead("responses", False, started, upstream_s)
        return answer

    async def _stream(self, response: httpx.Response, body: dict[str, Any], asked: ClientAsked,
                      session_id: str | None, task: str | None, version: int, model: str, started: float,
                      upstream_started: float) -> Response:
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
                                     acc.logprobs(), acc.finish_reason, model)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def models(self, request: Request) -> Response:
        try:
            response = await self.client.get(self.config.upstream_base + "/models")
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.config)
        return Response(response.content, status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))

    async def end_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        check_id(session_id, "session id", self.config.max_id_chars)
        traj = self.sessions.close(session_id)
        if traj is None:
            known = self.sessions.lookup(session_id=session_id)
            if known is None:
                return openai_error(404, f"unknown session {session_id!r}", "not_found")
            return JSONResponse({"session_id": session_id, "trajectory_id": known.trajectory_id, "published": False})
        self.publish(traj)
        return JSONResponse({"session_id": session_id, "trajectory_id": traj.trajectory_id, "published": True})

    async def feedback(self, request: Request) -> Response:
        raw = parse_json(await request.body(), self.config.max_json_depth)
        try:
            fb = Feedback.model_validate(raw)
        except ValidationError as exc:
            problems = [{"field": ".".join(str(p) for p in e["loc"]) or "(body)", "problem": e["msg"]}
                        for e in exc.errors()]
            text = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
            return openai_error(422, f"invalid feedback: {text}", problems=problems)
        known = self.sessions.lookup(fb.trajectory_id, fb.session_id)
        if known is None:
            what = f"trajectory {fb.trajectory_id!r}" if fb.trajectory_id else f"session {fb.session_id!r}"
            return openai_error(404, f"unknown {what}", "not_found")
        still_open = self.sessions.open_trajectory(known.trajectory_id)
        if still_open is not None:  # it will carry the reward itself too
            still_open.reward, still_open.reward_components = fb.reward, dict(fb.components)
        event = RewardEvent(trajectory_id=known.trajectory_id, group_id=known.group_id, example_id=known.example_id,
                            run_id=self.config.run_id, reward=fb.reward, components=dict(fb.components))
        queued = self.capture.put(event)
        return JSONResponse({"trajectory_id": known.trajectory_id, "queued": queued},
                            status_code=202 if queued else 503)

    async def stats(self, request: Request) -> Response:
        return JSONResponse({"capture": asdict(self.capture.stats), "queue_depth": self.capture.queue.qsize(),
                             "spool": self.capture.figures(),
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
    for prefix in ("", "/s/{session_id}"):
        routes += [Route(prefix + "/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
                   Route(prefix + "/v1/responses", gateway.responses, methods=["POST"]),
                   Route(prefix + "/v1/models", gateway.models, methods=["GET"])]
    routes += [
        Route("/v1/sessions/{session_id}/end", gateway.end_session, methods=["POST"]),
        Route("/v1/feedback", gateway.feedback, methods=["POST"]),
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

    return Starlette(routes=routes, lifespan=gateway.lifespan,
                     middleware=[Middleware(RequestLimits, config=gateway.config, stats=gateway.limit_stats)],
                     exception_handlers={RequestRejected: rejected})
