"""The gateway's HTTP server (Starlette): the routes of every endpoint module around one :class:`Gateway` core,
its bounds and authentication middleware, and the small service routes (models, sessions, stats, health)."""
from __future__ import annotations

import contextlib
import secrets
from dataclasses import asdict

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rlstream.gateway.auth import OPEN, PRINCIPAL_KEY, AuthMiddleware, AuthRefusal, Principal
from rlstream.gateway.chat import ChatCompletions
from rlstream.gateway.completions import Completions
from rlstream.gateway.core import Gateway, openai_error, upstream_failed
from rlstream.gateway.feedback_api import FeedbackEndpoint
from rlstream.gateway.feedback_shapes import FeedbackShapes
from rlstream.gateway.limits import RequestLimits, RequestRejected, check_id
from rlstream.gateway.messages import Messages
from rlstream.gateway.responses import Responses
from rlstream.gateway.unserved import not_served, public_models
from rlstream.schemas.models import CallEvent, CallKind

__all__ = ["Gateway", "create_app"]


class ServiceRoutes:
    """The gateway's own routes: the upstream's models, sessions opened and ended, stats and health."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def models(self, request: Request) -> Response:
        try:
            response = await self.gw.client.get(self.gw.config.upstream_base + "/models")
        except httpx.HTTPError as exc:
            return upstream_failed(exc, self.gw.config)
        if response.status_code == 200:
            with contextlib.suppress(ValueError, RecursionError):  # the served names, never the server's paths
                return JSONResponse(public_models(response.json()))
        return Response(response.content, status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))

    async def new_session(self, request: Request) -> Response:
        """``POST /v1/sessions``: an unguessable session id for a client that has none of its own."""
        return JSONResponse({"session_id": secrets.token_urlsafe(24)}, status_code=201)

    async def end_session(self, request: Request) -> Response:
        """``POST /v1/sessions/{id}/end``: the session's trajectory is closed and published."""
        gw = self.gw
        session_id = request.path_params["session_id"]
        check_id(session_id, "session id", gw.config.max_id_chars)
        caller: Principal = request.scope.get(PRINCIPAL_KEY) or OPEN
        scoped = gw.scoped(caller.tenant, session_id)
        if gw.stitch_in_streams:  # the stitcher holds the session: the end goes where its calls went
            queued = gw.publish_call(CallEvent(session_id=scoped, kind=CallKind.end, tenant=caller.tenant,
                                               run_id=gw.config.run_id, policy=gw.config.policy,
                                               gateway_id=gw.gateway_id))
            return JSONResponse({"session_id": session_id, "published": queued}, status_code=202 if queued else 503)
        traj = gw.sessions.close(scoped)
        if traj is None:
            known = gw.sessions.lookup(session_id=scoped)
            if known is None:
                return openai_error(404, f"unknown session {session_id!r}", "not_found")
            return JSONResponse({"session_id": session_id, "trajectory_id": known.trajectory_id, "published": False})
        gw.publish(traj)
        return JSONResponse({"session_id": session_id, "trajectory_id": traj.trajectory_id, "published": True})

    async def stats(self, request: Request) -> Response:
        gw = self.gw
        return JSONResponse({"capture": asdict(gw.capture.stats), "queue_depth": gw.capture.queue.qsize(),
                             "spool": gw.capture.figures(),
                             "session_stitching": gw.config.session_stitching,
                             "open_sessions": len(gw.sessions.open),
                             "session_splits": gw.sessions.splits,
                             "sessions_evicted": gw.sessions.evicted,
                             "session_splits_long": gw.sessions.splits_long,
                             "rejected": dict(gw.limit_stats.rejected),
                             "in_flight": gw.limit_stats.in_flight,
                             "session_retokenized": gw.sessions.retokenized,
                             "logprobs_incomplete": gw.logprobs_incomplete,
                             "upstreams_refused": gw.upstreams.refused,
                             "request_token_data": gw.request_token_data,
                             "request_logprobs": gw.request_token_data and gw.config.request_logprobs})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """``GET /ready``: 503 while every request slot is taken (a load balancer sends new requests elsewhere);
        ``/health`` stays 200 (the process is alive)."""
        stats, config = self.gw.limit_stats, self.gw.config
        if stats.in_flight >= config.max_concurrent_requests:
            return JSONResponse({"status": "saturated", "in_flight": stats.in_flight}, status_code=503,
                                headers={"retry-after": "1"})
        return JSONResponse({"status": "ready", "in_flight": stats.in_flight})


def create_app(gateway: Gateway) -> Starlette:
    """The Starlette app of ``gateway`` (its lifespan starts and stops the gateway)."""
    chat, responses, service = ChatCompletions(gateway), Responses(gateway), ServiceRoutes(gateway)
    completions, messages = Completions(gateway), Messages(gateway)
    feedback = FeedbackEndpoint(gateway)
    shapes = FeedbackShapes(gateway, feedback.accept)
    routes = []
    for prefix in ("", "/s/{session_id}"):
        routes += [Route(prefix + "/v1/chat/completions", chat.serve, methods=["POST"]),
                   Route(prefix + "/v1/responses", responses.serve, methods=["POST"]),
                   Route(prefix + "/v1/completions", completions.serve, methods=["POST"]),
                   Route(prefix + "/v1/messages", messages.serve, methods=["POST"]),
                   Route(prefix + "/v1/models", service.models, methods=["GET"])]
    routes += [
        Route("/v1/sessions", service.new_session, methods=["POST"]),
        Route("/v1/conversations", responses.stored.create_conversation, methods=["POST"]),
        Route("/v1/sessions/{session_id}/end", service.end_session, methods=["POST"]),
        Route("/v1/feedback", feedback.serve, methods=["POST"]),
        Route("/api/public/scores", shapes.langfuse_score, methods=["POST"]),
        Route("/api/public/ingestion", shapes.langfuse_ingestion, methods=["POST"]),
        Route("/info", shapes.langsmith_info, methods=["GET"]),
        Route("/api/v1/info", shapes.langsmith_info, methods=["GET"]),
        Route("/feedback", shapes.langsmith_feedback, methods=["POST"]),
        Route("/api/v1/feedback", shapes.langsmith_feedback, methods=["POST"]),
        Route("/feedback/{feedback_id}", shapes.langsmith_update, methods=["PATCH"]),
        Route("/api/v1/feedback/{feedback_id}", shapes.langsmith_update, methods=["PATCH"]),
        Route("/v1/logs", shapes.otlp_logs, methods=["POST"]),
        Route("/rlstream/stats", service.stats, methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/ready", service.ready, methods=["GET"]),
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
                     # the credential first: the bounds then know a request whose credential may sit in its body
                     middleware=[Middleware(AuthMiddleware, keys=gateway.keys, count=gateway.limit_stats.count),
                                 Middleware(RequestLimits, config=gateway.config, stats=gateway.limit_stats)],
                     exception_handlers={RequestRejected: rejected, AuthRefusal: refused, 404: not_served,
                                         405: not_served})
