"""End an exactly_once worker the moment its broker goes away, before it can resume a transaction there.

A transactional producer that keeps sending after the broker restarted continues a transaction the broker may no
longer know. Apache Kafka keeps transaction state in ``__transaction_state``, so it fences or finishes such a
transaction; the embedded broker (noida-db) keeps none across a SIGKILL. It accepts the resumed writes, answers the
commit with success and writes no marker, and the partition's last stable offset then stays behind those records
forever: read_committed consumers (the next recovery, the learner) stall on it, and a later producer with the
same transactional id cannot unblock it (tests/integration/test_broker_transaction_restart.py shows it). A worker
that is gone before the broker is back has no such writes: the restarted broker aborts the transaction that was
open in its log, and the worker's successor resumes from the committed state.

:class:`BrokerConnectionWatch` holds one idle TCP connection to the first bootstrap broker. Kafka brokers never
write unprompted, so the connection ends only when the broker process dies or closes it. When it ends, the watch
connects again at once: refused means the broker is down (restarting or gone) and the worker must exit; accepted
means the broker closed an idle connection (``connections.max.idle.ms``) and the watch goes on. A broker that
restarts faster than one reconnect (a few milliseconds) would go unnoticed; a supervised restart takes far longer.
Turn it off (``streams.exit_on_broker_loss``) with brokers that keep transaction state across restarts.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from rlstream.transport.log import get_logger

log = get_logger(__name__)

BROKER_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: a supervisor should start the worker again


def first_bootstrap_address(bootstrap_servers: str) -> tuple[str, int]:
    """``host:port`` of the first entry of a Kafka ``bootstrap_servers`` string (an optional ``scheme://``)."""
    first = bootstrap_servers.split(",")[0].strip()
    if "://" in first:
        first = first.split("://", 1)[1]
    host, sep, port = first.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"bootstrap server {first!r} is not host:port")
    return host.strip("[]"), int(port)


class BrokerConnectionWatch:
    """Calls ``on_loss(reason)`` once when the broker at ``address`` stops listening."""

    def __init__(self, address: tuple[str, int], on_loss: Callable[[str], object],
                 connect_timeout_s: float = 10.0) -> None:
        self.address = address
        self.on_loss = on_loss
        self.connect_timeout_s = connect_timeout_s
        self.connected = asyncio.Event()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = self.address
        return await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout_s)

    async def run(self) -> None:
        """Watch until the broker is lost (then call ``on_loss`` and return)."""
        host, port = self.address
        while True:
            try:
                reader, writer = await self._connect()
            except (ConnectionError, OSError) as exc:  # refused or unreachable: the broker is not there
                if self.connected.is_set():
                    self.on_loss(f"broker {host}:{port} is down: {exc}")
                    return
                await asyncio.sleep(0.5)  # not up yet at start: the worker's own clients wait for it too
                continue
            except asyncio.TimeoutError:  # a slow accept (a busy machine) is not a lost broker
                continue
            self.connected.set()
            try:
                while await reader.read(4096):  # a broker never writes unprompted; data would be a protocol oddity
                    pass
            except (ConnectionError, OSError):
                pass  # reset: the same as an end of stream, decided by the reconnect
            finally:
                writer.close()
            log.info("broker connection ended; checking whether the broker is still up", broker=f"{host}:{port}")
