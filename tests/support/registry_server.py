"""A Confluent-compatible schema registry for the tests: confluent-kafka's own registry store behind its REST API.

No registry server installs here (no Karapace, no Confluent platform), so the tests serve confluent-kafka's
in-process registry (``MockSchemaRegistryClient``: ids, subjects, versions) over HTTP with starlette and uvicorn,
with basic auth and, optionally, TLS. It speaks the endpoints a serializer uses: register a schema under a subject,
fetch a schema by id, list subjects and a subject's versions."""
from __future__ import annotations

import base64
import subprocess
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rlstream.ops.ports import free_port

JSON_TYPE = "application/vnd.schemaregistry.v1+json"


@dataclass(frozen=True)
class TlsFiles:
    certificate: Path
    key: Path


def self_signed_certificate(directory: Path) -> TlsFiles:
    """A certificate for 127.0.0.1 (its own CA), made with the openssl command."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "registry.pem", directory / "registry.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return TlsFiles(cert, key)


class RegistryServer:
    """Serves one fresh registry on a free loopback port until :meth:`stop`."""

    def __init__(self, user: str, password: str, tls: TlsFiles | None = None) -> None:
        self.store = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
        self.expected_auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.requests: Counter[str] = Counter()  # "METHOD status" per answered request
        self.port = free_port()
        self.tls = tls
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        app = Starlette(routes=[
            Route("/subjects/{subject}/versions", self.register, methods=["POST"]),
            Route("/subjects/{subject}/versions", self.versions, methods=["GET"]),
            Route("/schemas/ids/{schema_id:int}", self.schema_by_id, methods=["GET"]),
            Route("/subjects", self.subjects, methods=["GET"]),
        ])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                ssl_certfile=str(tls.certificate) if tls else None,
                                ssl_keyfile=str(tls.key) if tls else None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="registry-server", daemon=True)

    def start(self) -> "RegistryServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test registry did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def _answer(self, request: Request, body: object, status: int = 200) -> JSONResponse:
        self.requests[f"{request.method} {status}"] += 1
        return JSONResponse(body, status_code=status, media_type=JSON_TYPE)

    def _refused(self, request: Request) -> JSONResponse | None:
        if request.headers.get("authorization") != self.expected_auth:
            return self._answer(request, {"error_code": 401, "message": "Unauthorized"}, 401)
        return None

    async def register(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        body = await request.json()
        schema = Schema(body["schema"], body.get("schemaType", "AVRO"))
        schema_id = self.store.register_schema(request.path_params["subject"], schema)
        return self._answer(request, {"id": schema_id})

    async def schema_by_id(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            schema = self.store.get_schema(request.path_params["schema_id"])
        except SchemaRegistryError:
            return self._answer(request, {"error_code": 40403, "message": "Schema not found"}, 404)
        return self._answer(request, {"schema": schema.schema_str, "schemaType": schema.schema_type or "AVRO"})

    async def subjects(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        return self._answer(request, self.store.get_subjects())

    async def versions(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        return self._answer(request, self.store.get_versions(request.path_params["subject"]))

    def subject_of(self, schema_id: int) -> list[str]:
        """The subjects under which ``schema_id`` is registered."""
        return sorted(s for s in self.store.get_subjects()
                      if any(self.store.get_version(s, v).schema_id == schema_id for v in self.store.get_versions(s)))
