"""TLS test support: a throwaway CA with a server certificate, a TLS-terminating Kafka proxy in front of the local
broker, and a redis-server that speaks only TLS and asks for a password.

The local broker (noida-db) has no TLS listener and advertises its own ``host:port`` in every Metadata and
FindCoordinator answer, so a plain TLS tunnel would only carry the bootstrap connection: the client would then
connect to the advertised plaintext address. :class:`KafkaTlsProxy` rewrites the advertised address in those two
answers to its own (same host string, only the 4-byte port changes, so no length field moves), which makes the
proxy the address of every connection the client opens.
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import struct
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from rlstream.ops.children import spawn
from rlstream.ops.infra import redis_binary
from rlstream.ops.ports import free_port, port_open
from rlstream.ops.processes import stop_pid

LOOPBACK = "127.0.0.1"
_METADATA, _FIND_COORDINATOR = 3, 10  # Kafka API keys whose answers carry broker addresses


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a CA and of a server certificate it signed (for 127.0.0.1 and localhost)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(self.server_cert), str(self.server_key))
        return context


def make_tls_files(directory: Path, name: str = "test") -> TlsFiles:
    """A new self-signed CA and a server certificate it signs (SAN: IP 127.0.0.1, DNS localhost), as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5), not_valid_after=now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rlstream {name} CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
                   .issuer_name(ca_name).public_key(server_key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK)),
                                                               x509.DNSName("localhost")]), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .sign(ca_key, hashes.SHA256()))
    files = TlsFiles(directory / f"{name}-ca.pem", directory / f"{name}-server.pem", directory / f"{name}-server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(server_key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    files.server_key.chmod(0o600)
    return files


class KafkaTlsProxy:
    """A TLS listener on ``127.0.0.1:<port>`` that forwards every connection in clear to the broker, rewriting the
    broker's advertised address in Metadata and FindCoordinator answers to its own. Runs its own event loop in a
    thread, so that the test's ``asyncio.run`` calls and child processes can all use it."""

    def __init__(self, broker: str, tls: TlsFiles) -> None:
        host, _, port = broker.rpartition(":")
        self.broker_host, self.broker_port = host, int(port)
        self.tls = tls
        self.port = free_port()
        self.handshakes = 0  # TLS sessions established
        self.failed_handshakes = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kafka-tls-proxy", daemon=True)
        self._listener: socket.socket
        self._tasks: set[asyncio.Future[None]] = set()

    @property
    def bootstrap(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> "KafkaTlsProxy":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._listener.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _listen(self) -> None:
        self._listener = socket.create_server((LOOPBACK, self.port))
        self._listener.setblocking(False)
        self._accepting = asyncio.ensure_future(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._listener)
            task = asyncio.ensure_future(self._handshake(connection))
            self._tasks.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._tasks.discard)

    async def _handshake(self, connection: socket.socket) -> None:
        """TLS on the accepted socket from its first byte, then the proxying; a failed handshake is counted."""
        loop = asyncio.get_running_loop()
        client_in = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(client_in)
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, connection,
                                                              ssl=self.tls.server_context(), ssl_handshake_timeout=10)
        except (OSError, asyncio.TimeoutError):  # ssl.SSLError is an OSError
            self.failed_handshakes += 1  # a client that does not speak TLS, or does not trust the certificate
            connection.close()
            return
        self.handshakes += 1
        await self._serve(client_in, asyncio.StreamWriter(transport, protocol, client_in, loop))

    async def _serve(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            broker_in, broker_out = await asyncio.open_connection(self.broker_host, self.broker_port)
        except OSError:
            client_out.close()
            return
        api_of: dict[int, int] = {}  # correlation id -> API key of the request in flight
        advertised = self.broker_host.encode() + struct.pack(">i", self.broker_port)
        ours = self.broker_host.encode() + struct.pack(">i", self.port)

        async def requests() -> None:
            while frame := await _read_frame(client_in):
                api_key, _version, correlation = struct.unpack(">hhi", frame[4:12])
                api_of[correlation] = api_key
                broker_out.write(frame)
                await broker_out.drain()

        async def responses() -> None:
            while frame := await _read_frame(broker_in):
                (correlation,) = struct.unpack(">i", frame[4:8])
                if api_of.pop(correlation, None) in (_METADATA, _FIND_COORDINATOR):
                    frame = frame.replace(advertised, ours)
                client_out.write(frame)
                await client_out.drain()

        pumps = [asyncio.ensure_future(requests()), asyncio.ensure_future(responses())]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
                self._tasks.discard(pump)
            for writer in (client_out, broker_out):
                writer.close()


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """One Kafka frame (4-byte size, then the body), or None at the end of the stream."""
    try:
        head = await reader.readexactly(4)
        (size,) = struct.unpack(">i", head)
        return head + await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        return None


@dataclass
class TlsRedis:
    """A redis-server listening only with TLS (``--port 0``) and requiring a password."""

    port: int
    password: str
    pid: int
    tls: TlsFiles

    def url(self, password: str | None = None, scheme: str = "rediss") -> str:
        """A URL to it, trusting the test CA (``ssl_ca_certs``); ``password`` overrides the right one."""
        secret = self.password if password is None else password
        auth = f":{secret}@" if secret else ""
        query = f"?ssl_ca_certs={self.tls.ca_cert}" if scheme == "rediss" else ""
        return f"{scheme}://{auth}{LOOPBACK}:{self.port}/0{query}"

    def stop(self) -> None:
        stop_pid(self.pid, timeout_s=10)


def start_tls_redis(directory: Path, tls: TlsFiles, password: str, timeout_s: float = 20.0) -> TlsRedis:
    """Start redis-server with TLS only on a free loopback port (no client certificates asked), ``--requirepass``."""
    import time

    port = free_port()
    log_file = directory / "redis-tls.log"
    cmd = [redis_binary(), "--port", "0", "--tls-port", str(port), "--bind", LOOPBACK,
           "--tls-cert-file", str(tls.server_cert), "--tls-key-file", str(tls.server_key),
           "--tls-ca-cert-file", str(tls.ca_cert), "--tls-auth-clients", "no", "--requirepass", password,
           "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(directory)]
    with log_file.open("ab") as log:
        proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not port_open(LOOPBACK, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server with TLS did not start: {log_file.read_text()[-2000:]}")
        time.sleep(0.05)
    return TlsRedis(port=port, password=password, pid=proc.pid, tls=tls)
