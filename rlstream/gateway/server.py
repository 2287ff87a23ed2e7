"""Running the gateway under uvicorn inside an asyncio program (the CLI and the tests use it)."""
from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any, AsyncIterator, Coroutine, Iterator, TypeVar

import uvicorn

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.limits import uvicorn_options

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed (the gateway extra has it, as uvicorn[standard] would), on
    asyncio's own loop otherwise. Its gain on the gateway's hop was within the noise here (README, Benchmarks)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


@contextlib.asynccontextmanager
async def serving(gateway: Gateway, log_level: str = "warning") -> AsyncIterator[str]:
    """Serve ``gateway`` on its configured host and port while the block runs; yields its base URL."""
    config = uvicorn.Config(create_app(gateway), host=gateway.config.host, port=gateway.config.port,
                            lifespan="on", log_level=log_level, access_log=False, **uvicorn_options(gateway.config))
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the start error
            raise RuntimeError("gateway server stopped while starting")
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{gateway.config.host}:{port}"
    finally:
        server.should_exit = True
        await task


class StoppableServer(uvicorn.Server):
    """A uvicorn server that SIGTERM / SIGINT only ask to stop.

    uvicorn re-raises the signal that stopped it once it has shut down, so that the default action ends the
    process: that would end the gateway before its caller flushes the captured events still in the producer.
    Here the signal stops the server gracefully (a second SIGINT forces it, as in uvicorn) and ``serve`` returns.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        handled = (signal.SIGINT, signal.SIGTERM)
        for sig in handled:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)


async def serve_forever(gateway: Gateway, log_level: str = "info") -> None:
    """Serve ``gateway`` until SIGTERM or SIGINT, then return (after a graceful shutdown)."""
    config = uvicorn.Config(create_app(gateway), host=gateway.config.host, port=gateway.config.port,
                            lifespan="on", log_level=log_level, access_log=gateway.config.access_log,
                            **uvicorn_options(gateway.config))
    await StoppableServer(config).serve()
