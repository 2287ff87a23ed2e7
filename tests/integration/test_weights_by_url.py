"""Version weights by URL between a learner and a sync worker that share no path: the learner publishes to an
S3-compatible store (moto's server, started here) or to a directory an HTTP static server serves; the worker (real
Kafka and Redis, a recording server double) downloads each version into its bounded cache, checks every file against
the manifest, and loads the staged copy. A URL outside inference.weights_roots, a corrupted and a truncated download
are refused with a dead letter; a failed download is tried again (bounded)."""
from __future__ import annotations

import asyncio
import http.server
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

from rlstream.inference.sync import InferenceSyncWorker
from rlstream.learner.checkpoint import write_manifest
from rlstream.learner.publish import store_version
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, FileDigest, PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from tests.support.learner_helpers import read_topic
from tests.support.version_helpers import announce_versions, register_committed
from tests.integration.test_inference_untrusted_versions import RecordingBackend, send, wait_for

CODEC = AvroCodec()
BUCKET = "weights"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def learner_version(learner_dir: Path, version: int) -> tuple[Path, dict[str, Any]]:
    """A LoRA version directory as the learner writes it (adapter files, then manifest.json)."""
    directory = learner_dir / f"v{version:06d}"
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(f'{{"r": 2, "version": {version}}}')
    (directory / "adapter_model.safetensors").write_bytes(bytes([version % 256, 7]) * 3000)
    return directory, write_manifest(directory, {"version": version, "kind": "lora"})


def record(cfg: RlstreamConfig, version: int, uri: str, manifest: dict[str, Any], token: int) -> PolicyVersion:
    return PolicyVersion(policy=cfg.policy, version=version, base_model="tiny", kind=WeightsKind.lora, uri=uri,
                         files=[FileDigest(path=f["path"], sha256=f["sha256"], size=f["size"])
                                for f in manifest["files"]], learner_step=version, fencing_token=token)


def worker_config(rl_config: RlstreamConfig, worker_dir: Path, roots: list[str], options: dict[str, Any],
                  cache_bytes: int = 1 << 30) -> RlstreamConfig:
    cfg = rl_config.model_copy(deep=True)
    cfg.learner.output_dir = worker_dir / "no-learner-here"
    cfg.inference.staging_dir = worker_dir / "staging"
    cfg.inference.weights_cache_dir = worker_dir / "cache"
    cfg.inference.weights_cache_bytes = cache_bytes
    cfg.inference.weights_roots = roots
    cfg.inference.weight_store_options = options
    cfg.inference.download_retries = 2
    cfg.inference.retry_backoff_s = 0.05
    cfg.inference.keep_adapters = 1
    return cfg


async def test_versions_published_to_s3_are_downloaded_verified_and_loaded(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path, s3_endpoint: str) -> None:
    learner_dir, worker_dir = tmp_path / "learner-host", tmp_path / "worker-host"
    store = f"s3://{BUCKET}/{rl_config.policy}"
    options = s3_options(s3_endpoint)
    sources, manifests, uris = {}, {}, {}
    for n in (1, 2, 3):
        sources[n], manifests[n] = learner_version(learner_dir, n)
        uris[n] = store_version(sources[n], store, n, options)
        assert uris[n] == f"{store}/v{n:06d}"
    # the cache holds two versions: the third evicts version 1, which the server no longer has loaded
    size = sum(f["size"] for f in manifests[1]["files"])
    cfg = worker_config(rl_config, worker_dir, [store], options, cache_bytes=2 * size + 100)
    control = ControlPlane(cfg.redis.url)
    lease = await control.acquire_lease(cfg.policy, "learner", ttl_s=60)
    assert lease is not None
    outside = record(cfg, 2, f"s3://{BUCKET}/elsewhere/v000002", manifests[2], lease.token)
    store_version(sources[2], f"s3://{BUCKET}/elsewhere", 2, options)  # the bytes are there and match
    announced_outside = await register_committed(control, outside, lease)
    v = {n: record(cfg, n, uris[n], manifests[n], lease.token) for n in (1, 2, 3)}
    await announce_versions(cfg, [v[1]], lease=lease)

    backend = RecordingBackend()
    worker = InferenceSyncWorker(cfg, backend=backend, control=control)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 1), 30, "version 1 loaded", task)
        await send(cfg, created_topics.policy_versions, [announced_outside])
        letters = await read_topic(cfg, created_topics.dlq, DeadLetter, expect=1, timeout_s=30)
        assert worker.state.version == 1
        await announce_versions(cfg, [v[2]], lease=lease)  # control: the same bytes under the root load
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 2), 30, "version 2 loaded", task)
        await announce_versions(cfg, [v[3]], lease=lease)
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 3), 30, "version 3 loaded", task)
    finally:
        stop.set()
        await task
    await control.close()

    assert [letter.error_type for letter in letters] == ["UriOutsideRoots"]
    assert "outside inference.weights_roots" in letters[0].error_message
    assert [name for name, _, _ in backend.loaded] == [f"{cfg.policy}-v{n}" for n in (1, 2, 3)]
    for (_, path, files), n in zip(backend.loaded, (1, 2, 3)):
        assert path.is_relative_to(worker_dir / "staging")  # the verified private copy, not the store
        assert files == {p.name: p.read_bytes() for p in sources[n].iterdir() if p.name != "manifest.json"}
    cache = worker.weights_cache
    assert sorted(cache.versions()) == [2, 3] and cache.size <= cfg.inference.weights_cache_bytes
    assert not any(p.is_relative_to(learner_dir) for p in worker_dir.rglob("*"))


class FaultyStore(http.server.SimpleHTTPRequestHandler):
    """A static file server that serves a file's bytes corrupted or truncated for its first GETs."""

    faults: dict[str, tuple[str, int]] = {}  # url path -> (fault, GETs left with it)
    served: dict[str, int] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.served[self.path] = self.served.get(self.path, 0) + 1
        fault, left = self.faults.get(self.path, ("", 0))
        if not left:
            return super().do_GET()
        self.faults[self.path] = (fault, left - 1)
        data = Path(self.translate_path(self.path)).read_bytes()
        body = data[: len(data) // 2] if fault == "truncated" else bytes([data[0] ^ 0xFF]) + data[1:]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_store(tmp_path: Path) -> Iterator[tuple[Path, str, type[FaultyStore]]]:
    root = tmp_path / "http-root"
    root.mkdir()
    handler = type("Store", (FaultyStore,), {"faults": {}, "served": {}})

    def make(*args: Any, **kwargs: Any) -> FaultyStore:
        return handler(*args, directory=str(root), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


async def test_a_corrupted_or_truncated_download_is_dead_lettered_and_tried_again(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
        http_store: tuple[Path, str, type[FaultyStore]]) -> None:
    root, base, handler = http_store
    store_dir = root / "versions"  # the learner's weight store is a directory; replicas read it over HTTP
    sources, manifests = {}, {}
    for n in (1, 2, 3):
        sources[n], manifests[n] = learner_version(store_dir, n)
    weights = "adapter_model.safetensors"
    handler.faults[f"/versions/v000001/{weights}"] = ("corrupted", 1)  # once: the retry loads it
    handler.faults[f"/versions/v000002/{weights}"] = ("truncated", 99)  # always: given up after the retries
    cfg = worker_config(rl_config, tmp_path / "worker-host", [f"{base}/versions"], {})
    control = ControlPlane(cfg.redis.url)
    lease = await control.acquire_lease(cfg.policy, "learner", ttl_s=60)
    assert lease is not None
    v = {n: record(cfg, n, f"{base}/versions/v{n:06d}", manifests[n], lease.token) for n in (1, 2, 3)}
    await announce_versions(cfg, [v[1]], lease=lease)

    backend = RecordingBackend()
    worker = InferenceSyncWorker(cfg, backend=backend, control=control)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 1), 30, "version 1 loaded", task)
        await announce_versions(cfg, [v[2]], lease=lease)
        letters = await read_topic(cfg, created_topics.dlq, DeadLetter, expect=4, timeout_s=30)
        deadline = time.monotonic() + 5
        while handler.served.get(f"/versions/v000002/{weights}", 0) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert worker.state.version == 1  # the truncated version is never loaded
        await announce_versions(cfg, [v[3]], lease=lease)  # control: the worker goes on with a sound download
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 3), 30, "version 3 loaded", task)
    finally:
        stop.set()
        await task
    await control.close()

    by_version = [(CODEC.decode(d.value, PolicyVersion).version, d) for d in letters]
    assert [(n, d.error_type) for n, d in by_version] == [(1, "DownloadMismatch")] + [(2, "DownloadMismatch")] * 3
    assert "sha256" in by_version[0][1].error_message
    assert all("truncated" in d.error_message for n, d in by_version if n == 2)
    assert handler.served[f"/versions/v000001/{weights}"] == 2  # one corrupted answer, one retry
    assert handler.served[f"/versions/v000002/{weights}"] == 3  # bounded: download_retries=2
    assert [name for name, _, _ in backend.loaded] == [f"{cfg.policy}-v1", f"{cfg.policy}-v3"]
    assert backend.loaded[0][2][weights] == (sources[1] / weights).read_bytes()  # the good bytes, not the corrupted
    assert sorted(worker.weights_cache.versions()) == [1, 3]
