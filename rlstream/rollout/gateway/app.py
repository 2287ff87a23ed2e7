"""The gateway's HTTP server (Starlette): OpenAI-compatible routes, capture, sessions and feedback."""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import asdict
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlstream.rollout.gateway.config import GatewayConfig
from rlstream.rollout.gateway.filtering import (ClientAsked, client_asked, filter_response, rejects_extensions,
                                                upstream_request)
from rlstream.rollout.gateway.queue import CaptureQueue, Submitter
from rlstream.rollout.gateway.sessions import SessionStore, Trajectory, recorded_call
from rlstream.rollout.capture import to_message, token_data
from rlstream.transport.log import get_logger
from rlstream.schemas.models import RewardEvent

log = get_logger(__name__)

SESSION_HEADER = "x-session-id"
TASK_HEADER = "x-rlstream-task"
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


class Gateway:
    """State of one gateway: the upstream client, open sessions, the capture queue."""

    def __init__(self, config: GatewayConfig, publisher: Submitter, route: RouteSource | None = None,
                 client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.publisher = publisher
        self.route = route
        self.sessions = SessionStore(config.session_idle_s, config.remembered_trajectories)
        self.capture = CaptureQueue(publisher, config.queue_size)
        self._client = client
        self._own_client = client is None
        self._sweeper: asyncio.Task[None] | None = None
        self.request_token_data = config.request_token_data

    # -- lifecycle --
    async def start(self) -> None:
        if self._client is None:
            headers = {"authorization": f"Bearer {self.config.upstream_api_key}"} if self.config.upstream_api_key else {}
            self._client = httpx.AsyncClient(timeout=self.config.upstream_timeout_s, headers=headers)
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
        if closed is not None:
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

    # -- upstream --
    async def _send(self, body: dict[str, Any], stream: bool) -> httpx.Response:
        url = self.config.upstream_base + "/chat/completions"
        request = self.client.build_request("POST", url, json=upstream_request(body, self.request_token_data))
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
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return openai_error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return openai_error(400, "a chat completion request is a JSON object with a 'messages' list")
        session_id = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER) or None
        task = request.headers.get(TASK_HEADER) or None
        asked = client_asked(body)
        model, version = await self._route(str(body.get("model", "")))
        upstream_body = {**body, "model": model}
        stream = bool(body.get("stream"))
        try:
            response = await self._send(upstream_body, stream)
        except httpx.HTTPError as exc:
            return openai_error(502, f"upstream {self.config.upstream_base} unreachable: {exc}", "upstream_error")
        if stream and response.status_code == 200:
            return await self._stream(response, body, asked, session_id, task, version, model)
        raw = await response.aread() if stream else response.content
        if response.status_code != 200:
            await response.aclose()
            return Response(raw, status_code=response.status_code,
                            media_type=response.headers.get("content-type", "application/json"))
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            return openai_error(502, "upstream answered with invalid JSON", "upstream_error")
        prompt_ids, completion_ids, logprobs = token_data(payload)
        traj, headers = self._begin(session_id, body, prompt_ids, version, task)
        choices = payload.get("choices") or []
        if choices:
            self._finish(traj, body, choices[0].get("message") or {"role": "assistant"}, prompt_ids,
                         completion_ids, logprobs, choices[0].get("finish_reason"), model)
        out = filter_response(payload, asked)
        if "model" in out and out.get("model") == model:
            out["model"] = body.get("model", model)
        return JSONResponse(out, headers=headers)

    async def _stream(self, response: httpx.Response, body: dict[str, Any], asked: ClientAsked,
                      session_id: str | None, task: str | None, version: int, model: str) -> Response:
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
            return openai_error(502, f"upstream stream failed: {exc}", "upstream_error")
        prompt_ids = (first or {}).get("prompt_token_ids")
        traj, headers = self._begin(session_id, body, prompt_ids, version, task)
        acc = _StreamAccumulator(prompt_ids)
        client_model = body.get("model", model)

        def render(line: str) -> str | None:
            if not line.startswith("data:"):
                return line + "\n"
            data = line[5:].strip()
            if data == "[DONE]" or not data:
                return line + "\n"
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                return line + "\n"
            acc.add(chunk)
            out = filter_response(chunk, asked)
            if out.get("model") == model:
                out["model"] = client_model
            return "data: " + json.dumps(out, separators=(",", ":")) + "\n"

        async def events() -> AsyncIterator[str]:
            try:
                for line in pending:
                    text = render(line)
                    if text is not None:
                        yield text
                async for line in lines:
                    text = render(line)
                    if text is not None:
                        yield text
            finally:
                await response.aclose()
                if acc.chunks:
                    self._finish(traj, body, acc.message(), acc.prompt_ids, acc.completion_ids(), acc.logprobs(),
                                 acc.finish_reason, model)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def models(self, request: Request) -> Response:
        try:
            response = await self.client.get(self.config.upstream_base + "/models")
        except httpx.HTTPError as exc:
            return openai_error(502, f"upstream {self.config.upstream_base} unreachable: {exc}", "upstream_error")
        return Response(response.content, status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))

    async def end_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        traj = self.sessions.close(session_id)
        if traj is None:
            known = self.sessions.lookup(session_id=session_id)
            if known is None:
                return openai_error(404, f"unknown session {session_id!r}", "not_found")
            return JSONResponse({"session_id": session_id, "trajectory_id": known.trajectory_id, "published": False})
        self.publish(traj)
        return JSONResponse({"session_id": session_id, "trajectory_id": traj.trajectory_id, "published": True})

    async def feedback(self, request: Request) -> Response:
        try:
            raw = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return openai_error(400, f"request body is not valid JSON: {exc}")
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
                             "open_sessions": len(self.sessions.open),
                             "request_token_data": self.request_token_data})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


class _StreamAccumulator:
    """The first choice of a streamed chat completion, put back together from its chunks."""

    def __init__(self, prompt_ids: list[int] | None) -> None:
        self.prompt_ids = [int(t) for t in prompt_ids] if prompt_ids is not None else None
        self.chunks = 0
        self.role = "assistant"
        self.content: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.token_ids: list[int] = []
        self.saw_token_ids = False
        self._logprobs: list[float] = []
        self.saw_logprobs = False
        self.finish_reason: str | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if self.prompt_ids is None and chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = [int(t) for t in chunk["prompt_token_ids"]]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            self.chunks += 1
            delta = choice.get("delta") or {}
            self.role = delta.get("role") or self.role
            if delta.get("content"):
                self.content.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                slot = self.tool_calls.setdefault(int(call.get("index", 0)), {
                    "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if choice.get("token_ids") is not None:
                self.saw_token_ids = True
                self.token_ids.extend(int(t) for t in choice["token_ids"])
            content = (choice.get("logprobs") or {}).get("content")
            if content:
                self.saw_logprobs = True
                self._logprobs.extend(float(item["logprob"]) for item in content)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def message(self) -> dict[str, Any]:
        text = "".join(self.content)
        out: dict[str, Any] = {"role": self.role, "content": text if text or not self.tool_calls else None}
        if self.tool_calls:
            out["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return out

    def completion_ids(self) -> list[int] | None:
        return self.token_ids if self.saw_token_ids else None

    def logprobs(self) -> list[float] | None:
        return self._logprobs if self.saw_logprobs else None


def create_app(gateway: Gateway) -> Starlette:
    """The Starlette app of ``gateway`` (its lifespan starts and stops the gateway)."""
    routes = []
    for prefix in ("", "/s/{session_id}"):
        routes += [Route(prefix + "/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
                   Route(prefix + "/v1/models", gateway.models, methods=["GET"])]
    routes += [
        Route("/v1/sessions/{session_id}/end", gateway.end_session, methods=["POST"]),
        Route("/v1/feedback", gateway.feedback, methods=["POST"]),
        Route("/rlstream/stats", gateway.stats, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=gateway.lifespan)
