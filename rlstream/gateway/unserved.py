"""What the gateway answers for routes it does not serve, and the model list it shows clients.

Every path the gateway has no route for (``/v1/embeddings``, anything else) is answered with an OpenAI-style JSON
error (``{"error": {...}}``, 404 or 405), never a plain-text page: OpenAI clients parse the body of every error. They
are not passed to the upstream: a call for the policy's model would reach it uncaptured.
"""
from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

#: Routes of the OpenAI API the gateway does not serve, with the reason its 404 gives.
UNSERVED_ROUTES: dict[str, str] = {
    "/v1/embeddings": "embeddings are not served by the capture gateway; call an embeddings server directly",
}


def _route_of(path: str) -> str:
    """``path`` without a ``/s/{session}`` prefix."""
    if path.startswith("/s/"):
        rest = path[3:].split("/", 1)
        return "/" + rest[1] if len(rest) == 2 else path
    return path


async def not_served(request: Request, exc: Exception) -> Response:
    """The OpenAI-style JSON answer for a path or method without a route (Starlette's 404 / 405)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    route = _route_of(request.url.path)
    if status == 405:
        message, kind = f"method {request.method} is not allowed on {route}", "invalid_request_error"
    else:
        message = UNSERVED_ROUTES.get(route.rstrip("/"), f"no route {route} on the capture gateway")
        kind = "not_found_error"
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status, headers=headers)


def public_models(payload: Any) -> Any:
    """vLLM's model list without the server's file-system paths: each model's ``root`` (vLLM puts the model's
    directory, or a LoRA adapter's, there) becomes the model's served name."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return payload
    for model in payload["data"]:
        if isinstance(model, dict) and "root" in model:
            model["root"] = model.get("id")
    return payload
