"""The sync worker treats PolicyVersion records as untrusted: a uri outside inference.weights_roots (absolute, ``..``
or symlink escape), a file not in the manifest, a huge version jump and a stale fencing token are each dead-lettered
with the reason and counted, the loaded version stays, the Redis pointer never moves back, and the worker goes on.
The uri and manifest cases are registered as announced by the learner (a learner announcing a bad directory): the
directory checks hold even then. What the (fake) server loads is the verified staged copy, not the announced
directory."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rlstream.inference.manifest import digest_files
from rlstream.inference.sync import InferenceSyncWorker
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, MetricEvent, PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_producer
from tests.support.learner_helpers import read_topic
from tests.support.version_helpers import announce_versions, register_committed

CODEC = AvroCodec()


class RecordingBackend:
    """A server double: records what it was asked to load (the refusal paths never reach it)."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, Path, dict[str, bytes]]] = []

    async def load_lora(self, name: str, path: Path) -> None:
        self.loaded.append((name, Path(path), {p.name: p.read_bytes() for p in Path(path).iterdir()}))

    async def unload_lora(self, name: str) -> None:
        pass

    async def load_full(self, weights_dir: Path, rollback_dir: Path | None = None) -> None:  # pragma: no cover
        raise AssertionError("no full version in this test")


def make_version_dir(directory: Path, seed: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(f'{{"r": 2, "seed": {seed}}}')
    (directory / "adapter_model.safetensors").write_bytes(bytes(range(256)) * (seed + 1))
    return directory


def record(cfg: RlstreamConfig, version: int, uri: str, files_of: Path, token: int) -> PolicyVersion:
    return PolicyVersion(policy=cfg.policy, version=version, base_model="tiny", kind=WeightsKind.lora, uri=uri,
                         files=digest_files(files_of), learner_step=version, fencing_token=token)


async def send(cfg: RlstreamConfig, topic: str, versions: list[PolicyVersion | bytes]) -> None:
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for v in versions:
            value = v if isinstance(v, bytes) else CODEC.encode(v)
            await producer.send_and_wait(topic, value, key=cfg.policy.encode())
    finally:
        await producer.stop()


async def wait_for(predicate, timeout_s: float, what: str, task: asyncio.Task) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert not task.done(), f"the worker stopped: {task.exception() if task.done() else ''}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_untrusted_version_records_are_dead_lettered_and_the_worker_goes_on(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path) -> None:
    cfg = rl_config.model_copy(deep=True)
    cfg.inference.staging_dir = tmp_path / "staging"
    versions_root = Path(cfg.learner.output_dir) / "versions"
    outside = tmp_path / "elsewhere"

    good1 = make_version_dir(versions_root / "v000001", 1)
    good2 = make_version_dir(versions_root / "v000002", 2)
    escaped = make_version_dir(outside / "v000002", 3)  # a valid manifest, but outside every root
    (versions_root / "link").symlink_to(escaped, target_is_directory=True)
    extra = make_version_dir(versions_root / "v000003-extra", 4)
    control = ControlPlane(cfg.redis.url)
    fenced_out = await control.acquire_lease(cfg.policy, "fenced-out learner", ttl_s=60)
    assert fenced_out is not None
    await control.release_lease(cfg.policy, fenced_out)
    lease = await control.acquire_lease(cfg.policy, "learner", ttl_s=60)
    assert lease is not None
    token = lease.token
    extra_record = record(cfg, 3, str(extra), extra, token=token)  # manifest computed before the extra file
    (extra / "evil.py").write_text("import os\n")

    v1 = record(cfg, 1, str(good1), good1, token=token)
    await announce_versions(cfg, [v1], lease=lease)
    assert await control.publish_latest(cfg.policy, 1, v1.uri, "digest-1", lease)

    backend = RecordingBackend()
    worker = InferenceSyncWorker(cfg, backend=backend, control=control)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    bad = {
        "absolute": record(cfg, 2, str(escaped), escaped, token=token),
        "dotdot": record(cfg, 2, str(versions_root / ".." / ".." / "elsewhere" / "v000002"), escaped, token=token),
        "symlink": record(cfg, 2, str(versions_root / "link"), escaped, token=token),
        "extra": extra_record,
        "jump": record(cfg, 2 ** 62, str(good2), good2, token=token),
        "stale": record(cfg, 2, str(good2), good2, token=fenced_out.token),
    }
    announced = {name: await register_committed(control, bad[name], lease)
                 for name in ("absolute", "dotdot", "symlink", "extra")}
    expected = {"absolute": "UriOutsideRoots", "dotdot": "UriOutsideRoots", "symlink": "UriOutsideRoots",
                "extra": "FileNotInManifest", "jump": "VersionJump", "stale": "StaleFencingToken"}
    try:
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 1), 30, "version 1 loaded", task)
        await send(cfg, created_topics.policy_versions, [announced.get(name, v) for name, v in bad.items()])
        letters = await read_topic(cfg, created_topics.dlq, DeadLetter, expect=len(bad), timeout_s=30)
        assert worker.state.version == 1
        # the worker goes on: the next genuine version is loaded
        v2 = record(cfg, 2, str(good2), good2, token=token)
        await announce_versions(cfg, [v2], lease=lease)
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 2), 30, "version 2 loaded", task)
    finally:
        stop.set()
        await task
    assert int((await control.latest(cfg.policy))["version"]) == 1  # the worker never moves the pointer
    await control.close()

    assert len(letters) == len(bad)
    by_version_reason = [(CODEC.decode(d.value, PolicyVersion), d) for d in letters]
    for (name, sent), (got, letter) in zip(bad.items(), by_version_reason):
        assert got.version == sent.version and got.uri == sent.uri and got.fencing_token == sent.fencing_token, name
        assert letter.error_type == expected[name], (name, letter.error_type, letter.error_message)
        assert letter.service == f"inference:{cfg.inference.worker_id}"
    messages = {name: letter.error_message for name, (_, letter) in zip(bad, by_version_reason)}
    assert "outside inference.weights_roots" in messages["absolute"] and str(outside) in messages["symlink"]
    assert "evil.py" in messages["extra"] and "max_version_jump" in messages["jump"]
    assert f"fencing token {fenced_out.token}" in messages["stale"]

    # what was loaded: the staged, verified copies (never the announced directories), byte for byte
    assert [name for name, _, _ in backend.loaded] == [f"{cfg.policy}-v1", f"{cfg.policy}-v2"]
    for (_, path, files), source in zip(backend.loaded, (good1, good2)):
        assert path.parent == cfg.inference.staging_dir and not path.is_relative_to(versions_root)
        assert files == {p.name: p.read_bytes() for p in source.iterdir()}
    assert [v for v, _ in worker.refused] == [2, 2, 2, 3, 2 ** 62, 2]

    metrics = await read_topic(cfg, created_topics.metrics, MetricEvent, expect=1000, timeout_s=5)
    reasons = sorted(m.tags["reason"] for m in metrics if m.name == mn.INFERENCE_VERSION_REFUSED)
    assert reasons == sorted(["uri_outside_roots"] * 3 + ["file_not_in_manifest", "version_jump",
                                                          "stale_fencing_token"])


async def test_a_configured_weights_root_is_allowed(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                    tmp_path: Path) -> None:
    """Negative control: the same out-of-learner directory is adopted once it lies under a configured root."""
    cfg = rl_config.model_copy(deep=True)
    cfg.inference.staging_dir = tmp_path / "staging"
    cfg.inference.weights_roots = [tmp_path / "elsewhere"]
    directory = make_version_dir(tmp_path / "elsewhere" / "v1", 1)
    await announce_versions(cfg, [record(cfg, 1, str(directory), directory, token=0)])
    control = ControlPlane(cfg.redis.url)
    backend = RecordingBackend()
    worker = InferenceSyncWorker(cfg, backend=backend, control=control)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 1), 30, "version 1 loaded", task)
    finally:
        stop.set()
        await task
        await control.close()
    assert worker.refused == [] and len(backend.loaded) == 1


async def test_pickle_files_hard_links_and_oversized_versions_are_dead_lettered(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path) -> None:
    """Versions announced by the learner whose files break the weights rules: refused with the reason, never
    staged or loaded; the next clean version is loaded (the negative control of each rule)."""
    import os

    cfg = rl_config.model_copy(deep=True)
    cfg.inference.staging_dir = tmp_path / "staging"
    cfg.inference.max_version_bytes = 4096
    versions_root = Path(cfg.learner.output_dir) / "versions"
    pickled = make_version_dir(versions_root / "v000001", 1)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    linked = make_version_dir(versions_root / "v000002", 2)
    secret = tmp_path / "elsewhere.safetensors"
    secret.write_bytes(b"a file outside every root")
    os.link(secret, linked / "extra.safetensors")
    oversized = make_version_dir(versions_root / "v000003", 20)  # 21 x 256 bytes > 4096
    clean = make_version_dir(versions_root / "v000004", 4)
    bad = {"pickle": record(cfg, 1, str(pickled), pickled, token=0),
           "hard_link": record(cfg, 2, str(linked), linked, token=0),
           "too_large": record(cfg, 3, str(oversized), oversized, token=0)}
    leases = await announce_versions(cfg, list(bad.values()))
    control = ControlPlane(cfg.redis.url)
    backend = RecordingBackend()
    worker = InferenceSyncWorker(cfg, backend=backend, control=control)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        letters = await read_topic(cfg, created_topics.dlq, DeadLetter, expect=len(bad), timeout_s=30)
        assert worker.state.version == 0 and backend.loaded == []
        await announce_versions(cfg, [record(cfg, 4, str(clean), clean, token=0)], lease=leases[cfg.policy])
        await wait_for(lambda: asyncio.sleep(0, worker.state.version == 4), 30, "version 4 loaded", task)
    finally:
        stop.set()
        await task
        await control.close()
    got = sorted((CODEC.decode(d.value, PolicyVersion).version, d.error_type) for d in letters)
    assert got == [(1, "FileTypeNotAllowed"), (2, "HardLinkRefused"), (3, "VersionTooLarge")]
    assert [name for name, _, _ in backend.loaded] == [f"{cfg.policy}-v4"]
    assert not any(p.name.endswith(("-v1", "-v2", "-v3")) for p in cfg.inference.staging_dir.iterdir())
    metrics = await read_topic(cfg, created_topics.metrics, MetricEvent, expect=1000, timeout_s=5)
    reasons = sorted(m.tags["reason"] for m in metrics if m.name == mn.INFERENCE_VERSION_REFUSED)
    assert reasons == ["file_type_not_allowed", "hard_link", "version_too_large"]
