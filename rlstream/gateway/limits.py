"""Bounds on what one client can make the gateway hold or do; each is answered with a 4xx, never a 500.

* :class:`RequestLimits` (ASGI middleware, inside Starlette's error handling): the request line and headers
  (``max_header_bytes``), the session id (``/s/{id}/`` or ``X-Session-Id``) and task (``X-Rlstream-Task``): length and
  characters, requests at once (``max_concurrent_requests``: 503 with ``Retry-After``), the body: a declared
  ``Content-Length`` over ``max_body_bytes`` is answered 413 before anything is read, a body that grows past it while
  read is cut off with 413, a body not received whole within ``body_read_timeout_s`` with 408 (a client trickling a
  half-sent request holds a connection that long, no longer). Either body error closes the connection. It runs
  after the authentication middleware: a request whose credential may sit in its body (a feedback path without a key
  in its headers) has the small ``token_body_max_bytes`` cap and a pool of its own (``token_concurrent_requests``),
  so unauthenticated requests never take the slots of authenticated ones.
* :func:`parse_json`: a body's JSON with NaN / Infinity and lone surrogates refused and its nesting at most
  ``max_json_depth``, checked by a scan of the bytes before the parse.
* :class:`GuardedHttpToolsProtocol`: uvicorn's httptools protocol with a deadline for the request line and headers
  (``header_read_timeout_s``) and a cap on their size; h11 has its own (``h11_max_incomplete_event_size``).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, MutableMapping

import orjson

from rlstream.gateway.auth import PRINCIPAL_KEY
from rlstream.gateway.config import GatewaySettings
from rlstream.schemas.sampling import TemperatureRange, temperature_problem
from rlstream.transport.log import get_logger

log = get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Characters a session id or task name may have (what ends up in Kafka keys, headers and metadata).
ID_CHARS = re.compile(r"[A-Za-z0-9._:@+=~-]+")
SESSION_PATH = re.compile(r"^/s/([^/]*)/")
SESSION_HEADER = b"x-session-id"
TASK_HEADER = b"x-rlstream-task"
#: Not counted against ``max_concurrent_requests`` (liveness and readiness probes must answer under load).
UNCOUNTED_PATHS = frozenset({"/health", "/ready"})


class RequestRejected(Exception):
    """A request outside the bounds: answered ``status`` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", reason: str = "",
                 close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.reason = reason or kind
        self.close = close  # the body was not read whole: the connection cannot be reused


def error_body(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> bytes:
    """An OpenAI-style error body."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status, **extra}}).encode()


def check_id(value: str, what: str, max_chars: int) -> None:
    """Raise :class:`RequestRejected` (400) unless ``value`` is a usable session id / task name."""
    if len(value) > max_chars:
        raise RequestRejected(400, f"{what} longer than {max_chars} characters", reason="bad_id")
    if not ID_CHARS.fullmatch(value):
        raise RequestRejected(400, f"{what} may only have letters, digits and ._:@+=~-", reason="bad_id")


@dataclass
class LimitStats:
    """Requests answered by a bound, by reason (``GET /rlstream/stats``, metric ``gateway/requests_rejected``)."""

    rejected: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    #: requests in flight whose credential may sit in the body (their own pool)
    token_in_flight: int = 0

    def count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


class RateLimiter:
    """Requests per minute for each of a bounded set of names (a token bucket each, full at the start)."""

    def __init__(self, rpm: int) -> None:
        self.rpm = rpm
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (tokens, when refilled)

    def take(self, name: str, now: float | None = None) -> float | None:
        """Count one request of ``name``: None when allowed, else the seconds until one is."""
        now = time.monotonic() if now is None else now
        tokens, refilled = self._buckets.get(name, (float(self.rpm), now))
        tokens = min(float(self.rpm), tokens + (now - refilled) * self.rpm / 60.0)
        if tokens < 1.0:
            self._buckets[name] = (tokens, now)
            return (1.0 - tokens) * 60.0 / self.rpm
        self._buckets[name] = (tokens - 1.0, now)
        return None


class RequestLimits:
    """ASGI middleware enforcing the request bounds of a :class:`GatewaySettings` (see the module docstring)."""

    def __init__(self, app: ASGIApp, config: GatewaySettings, stats: LimitStats) -> None:
        self.app, self.config, self.stats = app, config, stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the auth middleware ran first: None marks a request whose credential may sit in its body
        unproven = PRINCIPAL_KEY in scope and scope[PRINCIPAL_KEY] is None
        cap = self.config.token_body_max_bytes if unproven else self.config.max_body_bytes
        try:
            declared = self._check_head(scope, cap)
        except RequestRejected as exc:
            await self._reject(exc, send)
            return
        counted = scope.get("path") not in UNCOUNTED_PATHS
        pool, size = ("token_in_flight", self.config.token_concurrent_requests) if unproven else (
            "in_flight", self.config.max_concurrent_requests)
        if counted and getattr(self.stats, pool) >= size:
            await self._reject(RequestRejected(503, "too many requests at once; retry shortly", "server_overloaded",
                                               reason="overloaded_token" if unproven else "overloaded"),
                               send, retry_after=True)
            return
        if counted:
            setattr(self.stats, pool, getattr(self.stats, pool) + 1)
        guard = _BodyGuard(receive, self.config, declared, cap)
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, guard.receive, tracked_send)
        except RequestRejected as exc:  # raised past Starlette's handlers (e.g. from a background read)
            if started:
                raise
            await self._reject(exc, send)
        finally:
            if counted:
                setattr(self.stats, pool, getattr(self.stats, pool) - 1)

    def _check_head(self, scope: Scope, cap: int) -> int | None:
        """Header-level bounds; the declared Content-Length (None when absent)."""
        config = self.config
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        declared: int | None = None
        for name, value in scope.get("headers") or ():
            size += len(name) + len(value) + 4
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise RequestRejected(400, "Content-Length is not a number", reason="bad_header") from None
                if declared < 0:
                    raise RequestRejected(400, "Content-Length is negative", reason="bad_header")
            elif name == SESSION_HEADER:
                check_id(value.decode("latin-1"), "X-Session-Id", config.max_id_chars)
            elif name == TASK_HEADER:
                check_id(value.decode("latin-1"), "X-Rlstream-Task", config.max_id_chars)
        if size > config.max_header_bytes:
            raise RequestRejected(431, f"request line and headers larger than {config.max_header_bytes} bytes",
                                  reason="headers_too_large")
        match = SESSION_PATH.match(scope.get("path") or "")
        if match is not None:
            check_id(match.group(1), "session id", config.max_id_chars)
        if declared is not None and declared > cap:
            raise RequestRejected(413, f"request body larger than {cap} bytes", reason="body_too_large", close=True)
        return declared

    async def _reject(self, exc: RequestRejected, send: Send, retry_after: bool = False) -> None:
        self.stats.count(exc.reason)
        body = error_body(exc.status, exc.message, exc.kind)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if retry_after:
            headers.append((b"retry-after", b"1"))
        if exc.close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _BodyGuard:
    """``receive`` with the body's size and read deadline enforced."""

    def __init__(self, receive: Receive, config: GatewaySettings, declared: int | None, cap: int) -> None:
        self._receive, self.config, self.declared, self.cap = receive, config, declared, cap
        self.deadline = time.monotonic() + config.body_read_timeout_s
        self.read = 0
        self.done = declared == 0

    async def receive(self) -> Message:
        if self.done:  # the body is read: what comes now is a disconnect, waited for without a deadline
            return await self._receive()
        try:
            async with asyncio.timeout(max(self.deadline - time.monotonic(), 0.0)):  # no task per read, as wait_for
                message = await self._receive()
        except TimeoutError:
            raise RequestRejected(408, f"request body not received within {self.config.body_read_timeout_s:g} s",
                                  "timeout", reason="body_timeout", close=True) from None
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.cap:
                raise RequestRejected(413, f"request body larger than {self.cap} bytes", reason="body_too_large",
                                      close=True)
            if not message.get("more_body", False):
                self.done = True
        return message


#: brackets kept (either kind as ``[`` / ``]``: a mismatch is the parser's to refuse), everything else deleted
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")


#: a run of openings or of closings
_RUN = re.compile(rb"\[+|\]+")
#: passes that remove innermost pairs before the runs are counted (each lowers the depth by one and removes the
#: short runs, so that few runs are left to count)
_PAIR_PASSES = 6


def nests_deeper(raw: bytes, limit: int) -> bool:
    """True when arrays and objects nest more than ``limit`` deep in the JSON text ``raw``, from its bytes, without
    parsing it (byte operations at C speed, then a count of the runs of brackets that are left): strings are cut
    out, innermost pairs of brackets removed a few times (each time the depth drops by one), then the runs of
    openings and closings left are summed. Unbalanced brackets are not valid JSON: the parser answers them."""
    if b'"' in raw:  # backslashes only occur in strings: escaped ones, then escaped quotes, go before the split
        raw = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[0::2])
    brackets = raw.translate(_AS_SQUARE, _NOT_BRACKET)
    if b"[" * (limit + 1) in brackets:  # a run of openings: too deep at once
        return True
    for _ in range(min(limit, _PAIR_PASSES)):
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets) or not inner:  # unbalanced, or nothing nests deeper
            return False
        brackets, limit = inner, limit - 1
    depth = 0
    for run in _RUN.findall(brackets):
        depth += len(run) if run[0] == 0x5B else -len(run)  # 0x5B: "["
        if depth > limit:
            return True
        if depth < 0:
            return False
    return False


def parse_json(raw: bytes, max_depth: int) -> Any:
    """``raw`` as JSON (orjson); :class:`RequestRejected` (400) when it nests deeper than ``max_depth`` (checked on
    the bytes before the parse), is not valid JSON or UTF-8, holds NaN or Infinity (also as a number too large for a
    float, such as 1e400), or a lone surrogate (``"\\ud800"``): orjson refuses the last three as RFC 8259 does."""
    # fewer brackets than the limit cannot nest deeper (a C-speed count spares most bodies the scan)
    if raw.count(b"[") + raw.count(b"{") > max_depth and nests_deeper(raw, max_depth):
        raise RequestRejected(400, f"request body nests deeper than {max_depth} levels", reason="bad_json")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestRejected(400, f"request body is not valid JSON: {exc}", reason="bad_json") from None


@dataclass(frozen=True)
class RequestShape:
    """What one endpoint's request body must be, and how its errors name it."""

    name: str  # "a chat completion request"
    turns: str | None = None  # the key of its list of turns, bounded by gateway.max_messages
    turns_required: bool = False  # the body must carry that list
    turn_noun: str = "messages"  # what the turns are called in an error
    required: str | None = None  # a key the body must have ("prompt")
    choices: bool = False  # ``n`` is bounded by gateway.max_choices
    prompts: bool = False  # a list of prompts multiplies the choices (Completions): n x prompts is bounded too

    def description(self) -> str:
        with_list = f" with a '{self.turns}' list" if self.turns_required else ""
        with_key = f" with a '{self.required}'" if self.required else ""
        return f"{self.name} is a JSON object{with_list}{with_key}"


def checked_body(raw: bytes, shape: RequestShape, config: GatewaySettings) -> dict[str, Any]:
    """``raw`` parsed and held to ``shape`` and the gateway's bounds: JSON depth, the number of turns, ``n`` and
    ``temperature``. Raises :class:`RequestRejected` (400) otherwise; each endpoint renders it in its API's shape."""
    body = parse_json(raw, config.max_json_depth)
    if (not isinstance(body, dict) or (shape.turns_required and not isinstance(body.get(shape.turns or ""), list))
            or (shape.required is not None and shape.required not in body)):
        raise RequestRejected(400, shape.description(), reason="bad_request")
    turns = body.get(shape.turns) if shape.turns else None
    if isinstance(turns, list) and len(turns) > config.max_messages:
        raise RequestRejected(400, f"{shape.name} has at most {config.max_messages} {shape.turn_noun} "
                              "(gateway.max_messages)", reason="too_many_messages")
    if shape.choices:
        check_choices(body, config.max_choices, prompt_count(body) if shape.prompts else 1)
    check_temperature(body, config.temperature_range)
    return body


def check_choices(body: dict[str, Any], max_choices: int, prompts: int = 1) -> None:
    """Raise :class:`RequestRejected` (400) for an ``n`` that is not a whole number in ``[1, max_choices]``, or for
    ``n`` x ``prompts`` (a Completions list of prompts) above ``max_choices``. A whole float (``8.0``) is replaced
    by its integer in ``body``, as vLLM reads it, so that every later count (the rate limit's, a stream's choices)
    sees the choices the upstream makes."""
    n = body.get("n")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, (int, float)) or n != int(n) or not 1 <= n <= max_choices:
            raise RequestRejected(400, f"n must be a whole number from 1 to {max_choices} (the largest group the "
                                  "trainer accepts)", reason="bad_n")
        body["n"] = int(n)
    if prompts > 1 and requested_choices(body) * prompts > max_choices:
        raise RequestRejected(400, f"n x prompts asks for {requested_choices(body) * prompts} choices, at most "
                              f"{max_choices} (the largest group the trainer accepts)", reason="bad_n")


def requested_choices(body: dict[str, Any]) -> int:
    """The ``n`` a request asks for (1 when absent or not a positive integer: the upstream judges it)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def prompt_count(body: dict[str, Any]) -> int:
    """How many prompts a Completions request carries: one per item of a list of texts or of token-id lists; one
    for a text or a single token-id list."""
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


def check_temperature(body: dict[str, Any], allowed: tuple[float, float]) -> None:
    """Raise :class:`RequestRejected` (400) for a ``temperature`` the learner may not train on: not a number,
    negative, or sampled outside ``allowed`` (``streams.temperature_range``; below vLLM's greedy threshold a call is
    greedy and fine). The stream app applies the same rule (:mod:`rlstream.schemas.sampling`)."""
    t = body.get("temperature")
    if t is None:
        return
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise RequestRejected(400, "temperature must be a number", reason="bad_temperature")
    problem = temperature_problem(float(t), TemperatureRange(*allowed))
    if problem:
        raise RequestRejected(400, problem, reason="bad_temperature")


# -- the connection: a deadline and a size cap for the request line and headers --------------------------------
def guarded_protocol(config: GatewaySettings) -> type:
    """uvicorn's httptools protocol with ``header_read_timeout_s`` and ``max_header_bytes`` enforced before the app
    sees the request (uvicorn itself waits for headers for ever and does not cap them under httptools)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    missing = [name for name in ("on_message_begin", "on_headers_complete", "data_received", "connection_lost",
                                 "connection_made", "send_400_response") if not hasattr(HttpToolsProtocol, name)]
    if missing:  # checked at start-up: a uvicorn without these hooks gets no guard, loudly
        raise RuntimeError(f"uvicorn's HttpToolsProtocol lacks {missing}; cannot guard slow or large headers")
    timeout_s, max_bytes = config.header_read_timeout_s, config.max_header_bytes

    class GuardedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True   # between the start of a request (or of the connection) and the end of its headers
        _head_bytes = 0   # bytes received while in the head

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a connection that never sends a whole request line and headers is closed

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = asyncio.get_running_loop().call_later(timeout_s, self._head_overdue)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_overdue(self) -> None:
            self._head_timer = None
            log.warning("request headers not received in time; connection closed", timeout_s=timeout_s,
                        client=str(self.client))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            # httptools buffers an unfinished header line whole: the cap is on the bytes, checked per read
            if self._in_head and self._head_bytes > max_bytes and not self.transport.is_closing():
                log.warning("request headers too large; connection closed", max_bytes=max_bytes,
                            client=str(self.client))
                self.send_400_response(f"Request line and headers larger than {max_bytes} bytes.")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0
            if self._head_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol


def uvicorn_options(config: GatewaySettings) -> dict[str, Any]:
    """The uvicorn settings that bound slow and large requests at the connection."""
    options: dict[str, Any] = {"timeout_keep_alive": config.keep_alive_timeout_s,
                               "h11_max_incomplete_event_size": config.max_header_bytes}
    try:
        import httptools  # noqa: F401
    except ImportError:
        options["http"] = "h11"
    else:
        options["http"] = guarded_protocol(config)
    return options


# -- the upstream's answers ------------------------------------------------------------------------------------
def malformed_answer(payload: Any, max_choices: int) -> str | None:
    """Why a chat completion from the upstream cannot be handed on (answered 502), or None when its shape is
    usable: an object whose ``choices`` (if any) is a list of at most ``max_choices`` objects, each with an object
    ``message`` (if any)."""
    if not isinstance(payload, dict):
        return "the upstream's answer is not a JSON object"
    choices = payload.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        return "the upstream's choices are not a list"
    if len(choices) > max_choices:
        return f"the upstream answered {len(choices)} choices (at most {max_choices})"
    for choice in choices:
        if not isinstance(choice, dict):
            return "an upstream choice is not an object"
        if choice.get("message") is not None and not isinstance(choice["message"], dict):
            return "an upstream choice's message is not an object"
    return None
