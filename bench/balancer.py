"""A round-robin TCP load balancer for the gateway fleet benchmark and tests: each new connection goes to the next
backend that accepts it (a backend that refuses, e.g. a killed gateway, is skipped as a load balancer's health check
would)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class RoundRobinProxy:
    """Listens on 127.0.0.1 and pipes each connection to the next of ``backends`` ((host, port) pairs)."""

    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self.next = 0
        self.connections: list[int] = [0] * len(backends)  # connections handed to each backend
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def _pick(self) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
        for _ in range(len(self.backends)):
            index = self.next % len(self.backends)
            self.next += 1
            host, port = self.backends[index]
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                continue
            return index, reader, writer
        raise ConnectionError("no backend accepts connections")

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            index, reader, writer = await self._pick()
        except ConnectionError:
            client_writer.close()
            return
        self.connections[index] += 1
        await asyncio.gather(self._pipe(client_reader, writer), self._pipe(reader, client_writer))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["RoundRobinProxy"]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
