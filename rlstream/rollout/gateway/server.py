"""Running the gateway under uvicorn inside an asyncio program (the CLI and the tests use it)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import uvicorn

from rlstream.rollout.gateway.app import Gateway, create_app


@contextlib.asynccontextmanager
async def serving(gateway: Gateway, log_level: str = "warning") -> AsyncIterator[str]:
    """Serve ``gateway`` on its configured host and port while the block runs; yields its base URL."""
    config = uvicorn.Config(create_app(gateway), host=gateway.config.host, port=gateway.config.port,
                            lifespan="on", log_level=log_level, access_log=False)
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


async def serve_forever(gateway: Gateway, log_level: str = "info") -> None:
    config = uvicorn.Config(create_app(gateway), host=gateway.config.host, port=gateway.config.port,
                            lifespan="on", log_level=log_level)
    await uvicorn.Server(config).serve()
