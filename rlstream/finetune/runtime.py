"""What one ``rlstream finetune`` run stands on: broker and Redis, topics, a vLLM server, the streams worker
(a child process whose online filters are relaxed, so that the epoch curriculum decides), an in-process
inference sync worker, the learner lease, and a reader of the ``groups`` topic.

Nothing here trains or generates; the epoch engine (:mod:`rlstream.finetune.engine`) uses these handles.
"""
from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
from aiokafka import AIOKafkaProducer

from rlstream.transport.control import ControlPlane, Lease, LeaseLost
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.ops.infra import LocalStack
from rlstream.ops.interrupts import terminate_as_interrupt
from rlstream.transport.kafka import create_topics, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.metrics import MetricsPublisher
from rlstream.transport.topic_reader import Decoded, TopicReader, open_reader, partitions_of
from rlstream.ops.supervisor import Supervisor, rlstream_command
from rlstream.ops.vllm import VllmServer, start_vllm_server
from rlstream.schemas.codec import AvroCodec, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.masking import public_config_text, secret_env
from rlstream.schemas.models import TrajectoryGroup, TrajectorySource
from rlstream.schemas.topics import TopicNames

log = get_logger(__name__)
SERVICE = "finetune"
DEFAULT_RUN_ID = "run-0"


class FinetuneError(RuntimeError):
    """The run cannot go on (no endpoint, lease held by another learner, a dead streams worker...)."""


def with_section(cfg: RlstreamConfig, section: str, **values: Any) -> RlstreamConfig:
    """A copy of ``cfg`` with ``values`` set in one section (validated; the environment is not re-read)."""
    current = getattr(cfg, section)
    updated = type(current).model_validate({**current.model_dump(), **values})
    return cfg.model_copy(update={section: updated})


def fresh_run_id(cfg: RlstreamConfig) -> RlstreamConfig:
    """Keep a run_id the user chose; replace the default one with a new ``finetune-<time>-<id>``."""
    if cfg.run_id != DEFAULT_RUN_ID:
        return cfg
    return cfg.model_copy(update={"run_id": f"finetune-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"})


# --- synchronous setup: infrastructure, vLLM, the streams child -----------------------------------------
@dataclass
class Infrastructure:
    """Processes this run started (and must stop) plus the addresses it uses."""

    cfg: RlstreamConfig
    server_url: str
    stack: LocalStack | None = None
    vllm: VllmServer | None = None
    supervisor: Supervisor | None = None

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop_all()
        if self.vllm is not None:
            self.vllm.stop()
        if self.stack is not None:
            self.stack.stop()


def provide_services(cfg: RlstreamConfig, root: Path) -> tuple[RlstreamConfig, LocalStack | None]:
    """Broker and Redis from the config/environment, else a LocalStack started for this run."""
    if cfg.kafka.bootstrap_servers and cfg.redis.url:
        return cfg, None
    stack = LocalStack.start(root / "infra")
    log.info("started a local broker/redis for the run", kafka=stack.bootstrap, redis=stack.redis_url)
    if not cfg.kafka.bootstrap_servers:
        cfg = with_section(cfg, "kafka", bootstrap_servers=stack.bootstrap)
    if not cfg.redis.url:
        cfg = with_section(cfg, "redis", url=stack.redis_url)
    return cfg, stack


def server_root(endpoint: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port``."""
    return endpoint.rstrip("/").removesuffix("/v1")


def wait_endpoint(url: str, timeout_s: float) -> None:
    """Wait until an OpenAI-compatible server answers ``/health`` (or ``/v1/models``)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(url + path, timeout=5.0).status_code == 200:
                    return
                last = f"{path}: HTTP status not 200"
            except httpx.HTTPError as exc:
                last = f"{path}: {exc}"
        time.sleep(1.0)
    raise FinetuneError(f"endpoint {url} did not answer within {timeout_s:.0f} s ({last})")


def provide_vllm(cfg: RlstreamConfig, endpoint: str | None, workdir: Path,
                 timeout_s: float) -> tuple[str, VllmServer | None]:
    """The vLLM server URL: ``endpoint`` when given, else a server started on ``learner.model``."""
    if endpoint:
        url = server_root(endpoint)
        wait_endpoint(url, timeout_s)
        return url, None
    if not cfg.learner.model:
        raise FinetuneError("without --endpoint, finetune starts vLLM on learner.model: set learner.model")
    server = start_vllm_server(Path(cfg.learner.model), served_model_name=cfg.rollout.model,
                               max_lora_rank=cfg.learner.lora.r, workdir=workdir, timeout_s=max(timeout_s, 60.0))
    return server.url, server


def streams_child_config(cfg: RlstreamConfig, output_dir: Path) -> RlstreamConfig:
    """The streams worker's config: its own app id, and its online filters relaxed (the epoch curriculum
    decides): no staleness limit, no variance floor, no online curriculum; short group timeout."""
    ft = cfg.finetuning
    cfg = with_section(cfg, "streams", app_id=f"{cfg.streams.app_id}-finetune-{cfg.run_id}",
                       data_dir=str(output_dir / "streams"), max_policy_lag=1_000_000, min_reward_diff=0.0,
                       curriculum=cfg.streams.curriculum.model_copy(update={"enabled": False}),
                       group_timeout_s=ft.group_timeout_s, tick_interval_s=min(cfg.streams.tick_interval_s, 1.0),
                       min_group_size=min(cfg.streams.min_group_size, ft.num_generations))
    return cfg


def start_streams_worker(cfg: RlstreamConfig, output_dir: Path, supervisor: Supervisor) -> Path:
    """Write the child's config (without secrets: they reach the child through its environment) and start
    ``rlstream streams worker`` on it."""
    child = streams_child_config(cfg, output_dir)
    path = output_dir / "streams-config.yaml"
    path.write_text(public_config_text(child))
    supervisor.spawn("streams", rlstream_command("streams", "worker", "-c", str(path),
                                                 "--worker-id", f"finetune-{cfg.run_id}"), env=secret_env(child))
    return path


def prepare(cfg: RlstreamConfig, endpoint: str | None, endpoint_timeout_s: float) -> Infrastructure:
    """Everything outside this process: services, topics, vLLM, the streams worker."""
    output_dir = Path(cfg.finetuning.output_dir).resolve()
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    # every process started here dies with this one however it ends (rlstream.ops.children.spawn); a SIGTERM
    # while starting stops them in order, as Ctrl-C does
    with terminate_as_interrupt():
        cfg, stack = provide_services(cfg, output_dir)
        infra = Infrastructure(cfg=cfg, server_url="", stack=stack)
        try:
            asyncio.run(create_topics(cfg.kafka, cfg.topics))
            infra.server_url, infra.vllm = provide_vllm(cfg, endpoint, output_dir / "vllm", endpoint_timeout_s)
            infra.supervisor = Supervisor(output_dir / "logs")
            start_streams_worker(cfg, output_dir, infra.supervisor)
        except BaseException:
            infra.stop()
            raise
    return infra


# --- the groups topic -----------------------------------------------------------------------------------
@dataclass
class CollectedGroup:
    group: TrajectoryGroup
    partition: int
    offset: int


class GroupCollector:
    """Reads ``groups`` from where it stood when the run began and keeps this run's groups by group_id."""

    def __init__(self, cfg: RlstreamConfig, codec: AvroCodec, producer: AIOKafkaProducer) -> None:
        self.cfg = cfg
        self.codec = codec
        self.producer = producer
        self.topics = TopicNames.from_config(cfg.topics)
        self.buffer: dict[str, CollectedGroup] = {}
        self.positions: dict[str, tuple[int, int]] = {}
        self.duplicates = 0
        self._consumer: Any = None
        self._reader: TopicReader[TrajectoryGroup] | None = None

    async def start(self) -> None:
        self._consumer = await open_reader(self.cfg.kafka)
        self._reader = TopicReader(self._consumer, self.codec, TrajectoryGroup, dead_letters=DeadLetterSink(
            self.producer, self.codec, self.topics.dlq, SERVICE, best_effort=True))
        tps = await partitions_of(self._consumer, self.topics.groups)
        self._consumer.assign(tps)
        await self._consumer.seek_to_end(*tps)
        for tp in tps:  # pin the start now: groups published from here on belong to this run
            await self._consumer.position(tp)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def poll(self, timeout_ms: int = 500) -> None:
        assert self._reader is not None, "start() first"
        for item in await self._reader.fetch(timeout_ms=timeout_ms, max_records=500):
            self._take(item)

    def _take(self, item: Decoded[TrajectoryGroup]) -> None:
        group, source = item.event, item.source
        if group.run_id != self.cfg.run_id or any(t.source == TrajectorySource.validation for t in group.trajectories):
            return  # another run's, or validation trajectories (never trained on)
        if group.group_id in self.buffer or group.group_id in self.positions:
            self.duplicates += 1
            log.warning("duplicate group ignored", group_id=group.group_id)
            return
        self.buffer[group.group_id] = CollectedGroup(group, source.partition, source.offset)
        self.positions[group.group_id] = (source.partition, source.offset)

    async def collect(self, candidates: set[str], expected: set[str], timeout_s: float,
                      alive: Callable[[], None] | None = None) -> list[CollectedGroup]:
        """Wait until every ``expected`` group has arrived (or ``timeout_s``); return the arrived
        ``candidates`` (and drop them from the buffer)."""
        deadline = time.monotonic() + timeout_s
        while not expected.issubset(self.buffer) and time.monotonic() < deadline:
            if alive is not None:
                alive()
            await self.poll()
        missing = expected - set(self.buffer)
        if missing:
            log.warning("groups missing after the wait; the epoch goes on without them", missing=len(missing),
                        examples=sorted(missing)[:5])
        return [self.buffer.pop(gid) for gid in sorted(candidates) if gid in self.buffer]


# --- the in-process part --------------------------------------------------------------------------------
#: the modules the run's learner and sync worker import on its event loop (torch behind them)
LEARNER_MODULES = ("rlstream.learner.publish", "rlstream.learner.checkpoint", "rlstream.learner.loop",
                   "rlstream.learner.policy", "rlstream.learner.step", "rlstream.learner.batch",
                   "rlstream.inference.sync", "rlstream.inference.vllm_backend")


async def import_learner_modules() -> None:
    """Import :data:`LEARNER_MODULES` off the event loop. Done before the learner lease is taken: an import on the
    event loop holds up the lease's renewal, and on a loaded machine importing torch takes longer
    than the lease lives."""
    for name in LEARNER_MODULES:
        await asyncio.to_thread(importlib.import_module, name)


@dataclass
class FinetuneContext:
    """The run's handles: control plane, producers, metrics, lease, sync worker and groups reader."""

    cfg: RlstreamConfig
    server_url: str
    output_dir: Path = field(init=False)
    worker_id: str = field(init=False)
    codec: AvroCodec = field(init=False)
    topics: TopicNames = field(init=False)
    control: ControlPlane | None = None
    producer: AIOKafkaProducer | None = None
    announcer: Any = None  # rlstream.learner.publish.Announcer: transactional, one id per policy (fences a zombie)
    metrics: MetricsPublisher | None = None
    rollout_metrics: MetricsPublisher | None = None
    collector: GroupCollector | None = None
    lease: Lease | None = None
    supervisor: Supervisor | None = None
    lease_lost: str | None = None
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _sync_backend: Any = None
    _sync_worker: Any = None

    def __post_init__(self) -> None:
        self.output_dir = Path(self.cfg.finetuning.output_dir).resolve()
        self.worker_id = f"finetune-{self.cfg.run_id}"
        self.codec = codec_for(self.cfg)
        self.topics = TopicNames.from_config(self.cfg.topics)

    @property
    def base_url(self) -> str:
        return f"{self.server_url}/v1"

    @property
    def learner_holder(self) -> str:
        return f"finetune:{self.cfg.run_id}"

    async def open(self) -> None:
        """Control plane, producer, metrics, lease, sync worker (waits for its first heartbeat), groups reader."""
        cfg = self.cfg
        self.control = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
        self.producer = make_producer(cfg.kafka)
        await self.producer.start()
        self.metrics = MetricsPublisher(self.producer, self.codec, self.topics.metrics, source=SERVICE,
                                        run_id=cfg.run_id, prometheus_port=cfg.learner.prometheus_port)
        self.rollout_metrics = MetricsPublisher(self.producer, self.codec, self.topics.metrics, source="rollout",
                                                run_id=cfg.run_id)
        await import_learner_modules()
        self.lease = await self.control.acquire_lease(cfg.policy, self.learner_holder, cfg.learner.lease_ttl_s)
        if self.lease is None:
            holder = await self.control.lease_holder(cfg.policy)
            raise FinetuneError(f"the learner lease of policy {cfg.policy!r} is held by {holder}: another learner "
                                "trains this policy; stop it or use another policy name")
        self._tasks.append(asyncio.create_task(self._keep_lease()))
        from rlstream.learner.publish import Announcer

        self.announcer = Announcer.for_policy(cfg.kafka, cfg.policy)
        await self.announcer.producer.start()
        latest = await self.control.latest_version(cfg.policy)
        if latest > 0:
            log.warning("policy already has versions; this run continues their numbering and vLLM serves the "
                        "newest one until this run publishes", policy=cfg.policy, latest=latest)
        self._start_sync_worker()
        await self._refuse_foreign_adapters(latest)
        await self.wait_loaded(max(0, latest), timeout_s=cfg.finetuning.load_timeout_s)
        self.collector = GroupCollector(cfg, self.codec, self.producer)
        await self.collector.start()

    def _start_sync_worker(self) -> None:
        from rlstream.inference.sync import InferenceSyncWorker
        from rlstream.inference.vllm_backend import VllmBackend

        # the trainer writes its versions under finetuning.output_dir: the sync worker may load from there only
        roots = [*self.cfg.inference.weights_roots, str(self.output_dir / "versions")]
        sync_cfg = with_section(self.cfg, "inference", url=self.server_url, worker_id=self.worker_id,
                                served_model=self.cfg.rollout.model, weights_roots=roots)
        key = self.cfg.inference.api_key
        self._sync_backend = VllmBackend(self.server_url, self.cfg.inference.request_timeout_s,
                                         key.get_secret_value() if key is not None else None)
        assert self.control is not None
        worker = InferenceSyncWorker(sync_cfg, self._sync_backend, self.control)
        self._sync_worker = worker
        self._tasks.append(asyncio.create_task(worker.run(self._stop)))

    async def _refuse_foreign_adapters(self, latest: int) -> None:
        """Stop at once when the vLLM server already holds adapters of this policy that this control plane did not
        publish (another run with the same policy name and another Redis): vLLM would refuse this run's
        versions under the same names."""
        from rlstream.inference.sync import adapter_version

        try:
            names = await self._sync_backend.models()
        except Exception as exc:  # a server that does not list its models: the loads will tell
            log.warning("could not list the vLLM server's models", error=str(exc))
            return
        foreign = sorted(v for v in (adapter_version(self.cfg.policy, n) for n in names) if v is not None and v > latest)
        if foreign:
            raise FinetuneError(
                f"the vLLM server {self.server_url} already serves adapters {self.cfg.policy}-v{foreign[0]}.. of policy "
                f"{self.cfg.policy!r} that this run's Redis does not know (another run used the same policy name): "
                "vLLM would refuse this run's versions under those names; use another policy name, or the Redis of "
                "that run")

    def load_failure(self, version: int) -> str | None:
        """Why this run's sync worker could not load ``version`` (vLLM's own answer included), None if it did not
        fail."""
        if self._sync_worker is None:
            return None
        failed = self._sync_worker.failed.get(version)
        return failed[1] if failed else None

    async def _keep_lease(self) -> None:
        assert self.control is not None and self.lease is not None
        ttl = self.cfg.learner.lease_ttl_s
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=ttl / 3)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self.control.renew_lease(self.cfg.policy, self.lease, ttl)
            except LeaseLost as exc:
                self.lease_lost = str(exc)
                log.error("learner lease lost; this run will not publish again", error=str(exc))
                return
            except Exception as exc:
                log.warning("lease renewal failed; retrying", error=str(exc))

    def check_alive(self) -> None:
        """Raise when a background part of the run died (streams worker, sync worker)."""
        if self.supervisor is not None:
            dead = self.supervisor.dead()
            if dead:
                child = dead[0]
                raise FinetuneError(f"the {child.name} worker exited with code {child.proc.returncode}; "
                                    f"log {child.log_file}")
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise FinetuneError(f"a background task failed: {task.exception()!r}")

    async def loaded_version(self) -> int:
        assert self.control is not None
        info = (await self.control.workers(self.cfg.policy)).get(self.worker_id)
        return int(info["version"]) if info and "version" in info else -1

    async def wait_loaded(self, version: int, timeout_s: float) -> bool:
        """Wait until this run's sync worker reports ``version`` (or newer) loaded; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if await self.loaded_version() >= version:
                return True
            failure = self.load_failure(version)
            if failure is not None:
                log.error("vLLM did not load the version", version=version, error=failure)
                return False
            await asyncio.sleep(0.2)
        log.error("vLLM did not load the version in time", version=version, timeout_s=timeout_s,
                  loaded=await self.loaded_version())
        return False

    async def close(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.collector is not None:
            await self.collector.stop()
        if self._sync_backend is not None:
            await self._sync_backend.close()
        if self.control is not None:
            if self.lease is not None and self.lease_lost is None:
                try:
                    await self.control.release_lease(self.cfg.policy, self.lease)
                except Exception as exc:
                    log.warning("lease not released", error=str(exc))
            await self.control.close()
        if self.announcer is not None:
            try:
                await self.announcer.producer.stop()
            except Exception as exc:  # a fenced producer may fail to close cleanly
                log.warning("announcing producer stop failed", error=str(exc))
        if self.producer is not None:
            await self.producer.stop()
        if self.metrics is not None and self.metrics.prometheus is not None:
            from rlstream.transport.metrics import stop_prometheus

            stop_prometheus(self.metrics.prometheus)
