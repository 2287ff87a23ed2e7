"""``rlstream console``: the read-only web page of a running stack (docs/console.md).

A starlette app serves the page (``static/``: HTML, JavaScript, CSS and the uPlot charts library, shipped in the
wheel: no CDN, no build step) and its JSON (``/api/...``), built from :class:`~rlstream.ops.console.state.ConsoleState`.
It binds loopback by default; any other address needs API keys, checked by the gateway's own machinery
(:class:`~rlstream.gateway.auth.AuthMiddleware`): the data paths need a key with the ``admin`` scope, the page itself
and its static files carry no data and need none (the page asks for the key when the data paths answer 401).
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, MutableMapping

from rlstream.gateway.auth import AuthMiddleware, KeyStore, inline_keys_from_env, is_loopback
from rlstream.ops.console.state import ConsoleFeed, ConsoleState
from rlstream.schemas.config import RlstreamConfig
from rlstream.transport.log import get_logger

log = get_logger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
#: the console's port when none is given
DEFAULT_PORT = 8790
#: paths that need a key when keys are configured (everything else is the page and its static files)
DATA_PREFIX = "/api/"

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


class ConsoleStartError(ValueError):
    """The console cannot start as asked; the message says what to change."""


@dataclass(frozen=True)
class ConsoleOptions:
    """Where the console listens and who may read it."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_keys: list[str] = field(default_factory=list)
    api_keys_file: Path | None = None


def key_store(options: ConsoleOptions) -> KeyStore:
    """The keys of ``--api-key``, ``RLSTREAM_GATEWAY_API_KEYS`` and ``--api-keys-file`` (the gateway's formats);
    :class:`ConsoleStartError` when the console would bind a non-loopback address without one."""
    try:
        keys = KeyStore([*options.api_keys, *inline_keys_from_env()], options.api_keys_file)
    except Exception as exc:  # a missing, unparsable or exposed keys file
        raise ConsoleStartError(f"API keys not usable: {exc}") from None
    if not keys.enabled and not is_loopback(options.host):
        raise ConsoleStartError(
            f"the console on {options.host} needs an admin key: give --api-key / --api-keys-file (or "
            "RLSTREAM_GATEWAY_API_KEYS), or bind 127.0.0.1 (the default)")
    return keys


@dataclass
class DataAuth:
    """ASGI: the data paths go through the gateway's :class:`AuthMiddleware` (a key with the ``admin`` scope when
    keys are configured); the page and its static files do not."""

    app: ASGIApp
    keys: KeyStore

    def __post_init__(self) -> None:
        self.guarded = AuthMiddleware(self.app, self.keys)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")).startswith(DATA_PREFIX):
            await self.guarded(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def build_app(cfg: RlstreamConfig, keys: KeyStore, state: ConsoleState | None = None,
              follow: bool = True) -> Any:
    """The console's ASGI app over ``state`` (a new one for ``cfg`` when not given); with ``follow`` its lifespan
    runs the :class:`ConsoleFeed` that keeps it current."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    state = state or ConsoleState(policy=cfg.policy, run_id=cfg.run_id)

    async def index(_: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-store"})

    async def health(_: Request) -> Response:
        return JSONResponse({"ok": True})

    async def overview(_: Request) -> Response:
        return JSONResponse(state.overview())

    async def samples(request: Request) -> Response:
        try:
            version = int(request.path_params["version"])
        except ValueError:
            return JSONResponse({"error": "the version is a number"}, status_code=400)
        return JSONResponse({"version": version, "trajectories": state.version_samples(version)})

    async def compare(request: Request) -> Response:
        q = request.query_params
        try:
            a, b = int(q["a"]), int(q["b"])
            example = q["example"]
        except (KeyError, ValueError):
            return JSONResponse({"error": "give example, a and b (two version numbers)"}, status_code=400)
        return JSONResponse(state.compare(example, a, b))

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        if follow:
            feed = ConsoleFeed(cfg, state)
            tasks = [asyncio.create_task(feed.follow_topics(stop)), asyncio.create_task(feed.poll_control(stop))]
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    routes = [Route("/", index), Route("/health", health), Route("/api/state", overview),
              Route("/api/versions/{version}/samples", samples), Route("/api/compare", compare),
              Mount("/static", StaticFiles(directory=STATIC_DIR), name="static")]
    return DataAuth(Starlette(routes=routes, lifespan=lifespan), keys)


def console_url(host: str, port: int) -> str:
    """The address a person opens (``http://host:port/``; IPv6 in brackets)."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/"


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), the one the console serves on; :class:`ConsoleStartError`
    naming the address and what to change when it cannot be bound (in use, not this machine's, not permitted)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise ConsoleStartError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}: "
                                "give --host an address of this machine") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConsoleStartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}: choose another --port "
                                "(0 picks a free one) or --host") from None
    return sock


def run_console(cfg: RlstreamConfig, options: ConsoleOptions, say: Callable[[str], None] = print) -> None:
    """Serve the console until SIGINT/SIGTERM; :class:`ConsoleStartError` before serving when it cannot start
    (no key off loopback, unusable keys, an address it cannot listen on)."""
    import uvicorn

    keys = key_store(options)
    sock = listening_socket(options.host, options.port)
    port = sock.getsockname()[1]
    app = build_app(cfg, keys)
    say(f"console {console_url(options.host, port)} (policy {cfg.policy}, run {cfg.run_id}; read-only"
        + (", admin key required)" if keys.enabled else ", loopback only, no key)"))
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=port, log_level="warning",
                                          access_log=False, lifespan="on"))
    server.run(sockets=[sock])
