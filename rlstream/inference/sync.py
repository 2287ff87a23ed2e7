"""The inference sync worker: keeps one vLLM server on the policy versions it should hold.

It reads ``policy-versions`` from the beginning (the topic keeps every version), catches up to
the newest version of its policy, loads it, then loads each newer version as it is announced:

* the record is untrusted: one the fenced learner did not announce (transport/trusted_versions.py: a foreign or
  stale fencing token, a version more than ``inference.max_version_jump`` above the newest trusted one, no
  committed announcement of these bytes in Redis), a ``uri`` outside ``inference.weights_roots`` (plus
  ``<learner.output_dir>/versions`` and ``inference.weights_root``; symlinks and ``..`` resolved first), a
  directory holding files the manifest does not list, a file that is not safetensors, JSON or a tokenizer file, a
  hard link and a version over ``inference.max_version_bytes`` are refused: dead-lettered with the reason, counted
  in ``inference/version_refused`` (tag ``reason``), and the worker goes on;
* a version whose ``uri`` is a URL (a remote weight store: ``s3://``, ``gs://``, ``http(s)://``) must lie under a URL
  prefix of ``inference.weights_roots``; its manifest's files are downloaded into a bounded cache
  (``inference.weights_cache_dir``, ``inference.weights_cache_bytes``; rlstream/inference/weights_cache.py), hashed
  as they are written; a corrupted or truncated download is dead-lettered and tried again
  ``inference.download_retries`` times. The cached copy then goes through the staging below;
* the files are then copied into a private staging directory (``inference.staging_dir``), hashed as they are
  copied; a sha256 or size mismatch is refused (never loaded) and reported. vLLM loads the staged copy, so what
  was verified is what is loaded;
* LoRA versions are loaded under a new adapter name per version (``<policy>-v<version>``) and
  adapters beyond ``keep_adapters`` are unloaded;
* full versions go through pause -> reload_weights -> reset prefix cache -> resume. A server holds one set of full
  weights, so which full version it holds depends on the replica (:func:`loads_on_announcement`,
  :func:`full_version_for_serve`): an ``evaluate`` replica (``inference.role``) and a ``serve`` replica with
  ``inference.full_weights_follow: newest`` load every newer announced version; a ``serve`` replica with
  ``full_weights_follow: serving`` loads only what the serving pointer asks for (pending first, else the canary on
  the replicas it runs on and serving on the others; an older version on a rollback, from its trusted record), and
  keeps the base weights while
  there is no pointer, so a candidate the gate rejects never answers its production requests;
* a failed load is retried ``load_retries`` times with backoff, then reported; the worker stays on
  the version it had (the server is never left half-loaded);
* a version's files are never deleted while a request may still name it: an adapter beyond ``keep_adapters`` is
  unloaded first, and its staged files stay until the server no longer lists it (``/v1/models``) and
  ``inference.trim_grace_s`` has passed since (rlstream/inference/retention.py): vLLM reads them again for a request
  that was already queued, and files deleted under it kill the engine. Full weights are read once, by the reload, so
  their staged copy goes as soon as another version replaces them.

The worker also keeps the versions the fleet is asked to serve loaded (docs/promotion.md): the serving version, a
``pending_version`` a promotion or rollback waits for (an older version is loaded again from its trusted record) and
the canary; these are never unloaded to make room for new candidates.

With its heartbeat (``rlstream:{policy}:worker:{id}``) the worker acknowledges what its server actually has loaded,
read back from ``/v1/models`` (versions, the name each is requested by, the versions that failed to load, the
server's URL): the fleet switch and the routers go by it (rlstream/transport/serving.py). A server that does not
answer gets no heartbeat: after ``inference.heartbeat_ttl_s`` the replica counts as down. The worker also checks
the server's health (vLLM's ``/health``, every ``inference.health_interval_s``; rlstream/inference/health.py): after
``inference.health_failures`` failures in a row the replica leaves routing at once (``inference/engine_down``,
``inference/engine_up`` 0), and it comes back only once the server answers again (its supervisor restarts a dead one:
rlstream/ops/vllm.py) and has every version it held loaded again (:meth:`InferenceSyncWorker.recover`). Failures are
reported in the log, as a ``inference/load_failed`` metric (``inference/fleet_load_failed`` while a version the
fleet is asked to serve failed), as a dead letter on ``dlq`` (with the raw PolicyVersion record) and as
``last_error`` fields of the worker's Redis hash.
"""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from aiokafka import AIOKafkaProducer

from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane, worker_key
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.kafka import make_consumer, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.metrics import MetricsPublisher
from rlstream.transport.serving import ROLE_EVALUATE, ReplicaAck, ServingControl, WantedVersions
from rlstream.transport.topic_reader import Decoded, SourceRecord, TopicReader, caught_up, wait_for_partitions
from rlstream.transport.trusted_versions import TrustedVersions, UntrustedVersionRecord
from rlstream.inference.health import HealthChange, HealthTracker
from rlstream.inference.manifest import ManifestError, UntrustedVersion, rollback_dir, stage, verify
from rlstream.inference.retention import RetiredFiles, deletable
from rlstream.inference.weights_cache import WeightsCache
from rlstream.transport.weight_store import DownloadMismatch, check_url_under_roots, is_remote
from rlstream.inference.vllm_backend import BackendError, VllmBackend
from rlstream.schemas.codec import AvroCodec, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, MetricEvent, PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames

log = get_logger(__name__)



class LoadRefused(RuntimeError):
    """A version that must not be loaded (bad manifest, unsupported kind)."""


@dataclass
class LoadedState:
    version: int
    name: str
    kind: str
    weights_dir: Path | None = None


def adapter_name(policy: str, version: int) -> str:
    """The LoRA adapter name of one version (new per version: vLLM refuses reusing a name)."""
    return f"{policy}-v{version}"


def adapter_version(policy: str, name: str) -> int | None:
    """The version of an adapter name of ``policy`` (:func:`adapter_name`), None for any other name."""
    prefix = f"{policy}-v"
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def loads_on_announcement(role: str, full_weights_follow: str, kind: WeightsKind) -> bool:
    """Whether a replica loads a newly announced version as soon as it is announced: every LoRA version (each under
    its own adapter name), and every full version on an ``evaluate`` replica or a ``serve`` replica following
    ``newest``; a ``serve`` replica following ``serving`` loads a full version only when the serving pointer asks
    for it (:func:`full_version_for_serve`)."""
    return kind == WeightsKind.lora or role == ROLE_EVALUATE or full_weights_follow != "serving"


def full_version_for_serve(full_weights_follow: str, newest_announced: int | None, wanted: WantedVersions,
                           worker_id: str | None = None) -> int | None:
    """The full-weights version a ``serve`` replica holds (one set of full weights per server); None: keep what is
    loaded (the base weights before any version).

    ``newest``: the newest announced version. ``serving``: the version the serving pointer asks for: the pending one
    (a promotion or rollback waiting for the fleet, older than serving on a rollback), else the canary on the replicas
    the canary runs on (``wanted.canary_workers``: its share of the fleet) and the serving version on every other;
    None while the pointer asks for nothing (no pointer yet)."""
    if full_weights_follow != "serving":
        return newest_announced
    if wanted.pending is not None:
        return wanted.pending
    if wanted.canary is not None and worker_id is not None and worker_id in wanted.canary_workers:
        return wanted.canary
    return wanted.serving


def adapters_to_unload(adapters: list[str], keep_versions: set[int], keep_adapters: int) -> list[str]:
    """The oldest adapters (``<policy>-v<N>``, oldest first in ``adapters``) beyond ``keep_adapters``, leaving out
    those whose version is in ``keep_versions`` (served, pending, canary, or held for an evaluation)."""
    others = [n for n in adapters if InferenceSyncWorker._adapter_version(n) not in keep_versions]
    return others[:max(0, len(others) - keep_adapters)]


def waits_for_evaluation(role: str, held_versions: set[int], loaded_version: int) -> bool:
    """Whether a newer candidate waits instead of loading: on an ``evaluate`` replica while an evaluation holds the
    version it has loaded (a hold on another version is stale and ignored)."""
    return role == ROLE_EVALUATE and loaded_version in held_versions


def url_without_credentials(url: str) -> str:
    """``url`` without a user or password (what a replica shows in Redis; routers bring their own API key)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


#: Seconds before a version the fleet is asked to serve is loaded again after its load failed.
WANTED_RETRY_S = 10.0
#: Seconds between two reads of the serving pointer by the worker's loop.
SERVING_POLL_S = 1.0
#: Seconds one health check of the server may take before it counts as failed.
HEALTH_TIMEOUT_S = 5.0


class InferenceSyncWorker:
    """Loads every new PolicyVersion of ``cfg.policy`` into one vLLM server."""

    def __init__(
        self,
        cfg: RlstreamConfig,
        backend: VllmBackend,
        control: ControlPlane,
        producer: AIOKafkaProducer | None = None,
        codec: AvroCodec | None = None,
    ) -> None:
        self.cfg = cfg
        self.icfg = cfg.inference
        self.backend = backend
        self.control = control
        self.codec = codec or codec_for(cfg)
        self.codec.ensure_registered([MetricEvent.avro_name, DeadLetter.avro_name])  # a registry problem stops it now
        self.topics = TopicNames.from_config(cfg.topics)
        self.producer = producer or make_producer(cfg.kafka)
        self.metrics = MetricsPublisher(self.producer, self.codec, self.topics.metrics,
                                        source=f"inference:{self.icfg.worker_id}", run_id=cfg.run_id,
                                        prometheus_port=self.icfg.prometheus_port)
        # undecodable records and refused/failed versions; a failed send is logged, the worker goes on
        self.dead_letters = DeadLetterSink(self.producer, self.codec, self.topics.dlq,
                                           service=f"inference:{self.icfg.worker_id}", best_effort=True)
        self.state = LoadedState(version=0, name=self.icfg.served_model, kind="base")
        self.adapters: deque[str] = deque()
        self.failures = 0
        self.refused: list[tuple[int, str]] = []
        self.trust = TrustedVersions(control, self.icfg.max_version_jump)  # which records count
        self.staging_root = Path(self.icfg.staging_dir) if self.icfg.staging_dir else \
            Path(tempfile.mkdtemp(prefix=f"rlstream-staging-{self.icfg.worker_id}-"))
        self._staged: dict[int, Path] = {}  # version -> its staged copy
        self._weights_cache: WeightsCache | None = None  # versions downloaded by URL
        self._lora_staged: set[int] = set()  # the staged copies that are LoRA versions
        self._retired: dict[int, RetiredFiles] = {}  # unloaded LoRA versions whose files wait (retention.py)
        self.health = HealthTracker(self.icfg.health_failures)
        self.engine_down = False  # out of routing: no heartbeat until recover() has the server's versions back
        self._recover = False
        self._loaded_event = asyncio.Event()
        self.serving = ServingControl(control)
        self.known: dict[int, tuple[PolicyVersion, SourceRecord | None]] = {}  # trusted records of our policy
        self.failed: dict[int, tuple[float, str]] = {}  # version -> (monotonic time, error) of its last failed load
        self.wanted: set[int] = set()  # serving, pending and canary versions (kept loaded)
        self.pointer_wants = WantedVersions()  # the same, each on its own
        self._unknown_wanted: set[int] = set()  # versions the pointer asks for with no trusted record here (logged)
        # the newest candidate announced while the gate evaluates the loaded version (evaluate replicas)
        self._waiting: tuple[PolicyVersion, SourceRecord | None] | None = None
        self._serving_read_at = 0.0
        self._fleet_failures_emitted = 0
        self.replica_url = url_without_credentials(str(self.icfg.url))

    @property
    def follows_serving(self) -> bool:
        """A serve replica whose full weights follow the serving pointer (``inference.full_weights_follow``)."""
        return self.icfg.role != ROLE_EVALUATE and self.icfg.full_weights_follow == "serving"

    def _loads_now(self, version: PolicyVersion) -> bool:
        return loads_on_announcement(self.icfg.role, self.icfg.full_weights_follow, version.kind)

    @property
    def weights_roots(self) -> list[Path]:
        """Where a version's ``uri`` may lie: ``inference.weights_roots``, the learner's versions directory and
        ``inference.weights_root``."""
        roots = [Path(r) for r in self.icfg.weights_roots if not is_remote(str(r))]
        roots.append(Path(self.cfg.learner.output_dir) / "versions")
        if self.icfg.weights_root is not None:
            roots.append(Path(self.icfg.weights_root))
        return roots

    # -- the loop ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Catch up, load the newest version, then follow the topic until ``stop`` is set."""
        stop = stop or asyncio.Event()
        # announcements are transactional: an aborted (fenced) one is never read
        consumer = make_consumer(self.cfg.kafka, group_id=None, isolation_level="read_committed")
        await self.producer.start()
        await consumer.start()
        reader = TopicReader(consumer, self.codec, PolicyVersion, dead_letters=self.dead_letters)
        heartbeat = asyncio.create_task(self._heartbeat_loop(stop))
        health = asyncio.create_task(self._health_loop(stop))
        try:
            await self._catch_up(reader)
            while not stop.is_set():
                for item in await reader.fetch(timeout_ms=500, max_records=100):
                    await self.handle(item)
                if self._recover:
                    await self.recover()
                if not self.engine_down:
                    await self.follow_serving()
                    await self._load_waiting()
        finally:
            stop.set()
            heartbeat.cancel()
            health.cancel()
            await asyncio.gather(heartbeat, health, return_exceptions=True)
            await consumer.stop()
            await self.producer.stop()

    async def _catch_up(self, reader: TopicReader[PolicyVersion]) -> None:
        """Read the topic up to its current end; load only the newest valid version of our policy."""
        consumer = reader.consumer
        tps = await wait_for_partitions(consumer, self.topics.policy_versions, timeout_s=30.0)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        newest: list[Decoded[PolicyVersion]] = []
        while not await caught_up(consumer, ends):
            for item in await reader.fetch(*tps, timeout_ms=500):
                if item.event.policy == self.cfg.policy and await self._trusted(item.event, item.source):
                    newest.append(item)
        newest.sort(key=lambda item: item.event.version, reverse=True)
        held_back = [item.event.version for item in newest if not self._loads_now(item.event)]
        if held_back:
            log.info("full-weights candidates not loaded on this serve replica: it loads the version the serving "
                     "pointer asks for (inference.full_weights_follow: serving)", versions=held_back[:10],
                     count=len(held_back))
        for item in (item for item in newest if self._loads_now(item.event)):  # newest first; else an older one
            if item.event.version <= self.state.version:
                break
            if await self.sync(item.event, item.source):
                break
        await self.follow_serving(force=True)
        await self._heartbeat()
        log.info("sync worker caught up", policy=self.cfg.policy, loaded_version=self.state.version,
                 name=self.state.name, seen=len(newest))

    async def handle(self, item: Decoded[PolicyVersion]) -> None:
        """Load one announced version when it is of our policy and newer than the loaded one."""
        version = item.event
        if version.policy != self.cfg.policy:
            return
        if not await self._trusted(version, item.source):
            return
        if version.version <= self.state.version:
            log.info("version not newer than the loaded one; skipped", version=version.version,
                     loaded=self.state.version)
            return
        if not self._loads_now(version):
            wants = self.pointer_wants
            log.info("full-weights candidate not loaded on this serve replica: it loads only the versions the serving "
                     "pointer asks for (inference.full_weights_follow: serving); the gate evaluates candidates on an "
                     "evaluate replica", version=version.version, loaded=self.state.version, serving=wants.serving,
                     pending=wants.pending, canary=wants.canary)
            return
        if version.kind == WeightsKind.full and await self._evaluation_holds():  # an adapter replaces nothing
            if self._waiting is None or version.version > self._waiting[0].version:
                self._waiting = (version, item.source)
            log.info("newer candidate waits: the gate is evaluating the loaded version", version=version.version,
                     loaded=self.state.version)
            return
        if self.engine_down:  # recover() loads the newest version once the server is back
            log.info("the server is down; the version loads once it is back", version=version.version)
            return
        await self.sync(version, item.source)

    async def _evaluation_holds(self) -> bool:
        """Whether the gate holds this (evaluate) replica's loaded version for an evaluation; False when Redis cannot
        say (a candidate then loads as it would without a gate)."""
        if self.icfg.role != ROLE_EVALUATE:
            return False
        try:
            held = await self.serving.evaluation_holds(self.cfg.policy, self.icfg.worker_id)
        except Exception as exc:  # noqa: BLE001 - Redis unreachable: never stall loading on it
            log.warning("cannot read the evaluation hold; loading", error=str(exc))
            return False
        return waits_for_evaluation(self.icfg.role, held, self.state.version)

    async def _load_waiting(self) -> None:
        """Load the candidate that waited for an evaluation once the hold is gone."""
        if self._waiting is None or await self._evaluation_holds():
            return
        version, record = self._waiting
        self._waiting = None
        if version.version > self.state.version:
            await self.sync(version, record)

    async def _trusted(self, version: PolicyVersion, record: SourceRecord) -> bool:
        """Whether the fenced learner announced this record (see transport/trusted_versions.py); a refused one is
        reported and dead-lettered."""
        delay = 0.5
        while True:
            try:
                await self.trust.check(version, record.value)
                self.known[version.version] = (version, record)
                return True
            except UntrustedVersionRecord as exc:
                await self._report(version, record, exc, refused=True)
                return False
            except Exception as exc:  # noqa: BLE001 - Redis unreachable: nothing is loaded until it can be checked
                log.warning("cannot check a policy version against the control plane; retrying",
                            version=version.version, error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    # -- loading ----------------------------------------------------------------------------
    async def sync(self, version: PolicyVersion, record: SourceRecord | None = None) -> bool:
        """Verify and load one version; True when it is now served. Failures are reported, not raised."""
        started = time.monotonic()
        try:
            if is_remote(version.uri):
                source_dir = await self._download(version, record)
                if source_dir is None:
                    return False
            else:
                source_dir = verify(version, self.icfg.weights_root, roots=self.weights_roots, hash_files=False,
                                    max_bytes=self.icfg.max_version_bytes)
            weights_dir = await asyncio.to_thread(stage, version, source_dir, self.staging_root,
                                                  adapter_name(version.policy, version.version),
                                                  max_bytes=self.icfg.max_version_bytes)
        except ManifestError as exc:
            await self._report(version, record, exc, refused=True)
            return False
        self._staged[version.version] = weights_dir
        self._retired.pop(version.version, None)
        if version.kind == WeightsKind.lora:
            self._lora_staged.add(version.version)
        attempts = self.icfg.load_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                await self._load(version, weights_dir)
                break
            except BackendError as exc:
                log.warning("load failed", version=version.version, attempt=attempt, of=attempts, error=str(exc))
                if attempt == attempts:
                    await self._report(version, record, exc, refused=False)
                    self._drop_staged()
                    return False
                await asyncio.sleep(self.icfg.retry_backoff_s * 2 ** (attempt - 1))
        self._drop_staged()
        self.failed.pop(version.version, None)
        await self._heartbeat()
        seconds = time.monotonic() - started
        await self.metrics.emit(mn.INFERENCE_LOADED_VERSION, self.state.version, step=version.version,
                                tags={"worker": self.icfg.worker_id, "kind": version.kind.value})
        await self.metrics.emit(mn.INFERENCE_LOAD_SECONDS, seconds, step=version.version,
                                tags={"worker": self.icfg.worker_id})
        log.info("version loaded", policy=version.policy, version=version.version, kind=version.kind.value,
                 name=self.state.name, seconds=round(seconds, 3))
        self._loaded_event.set()
        return True

    @property
    def weights_cache(self) -> WeightsCache:
        """The bounded cache of versions downloaded by URL (``inference.weights_cache_dir``), made on first use."""
        if self._weights_cache is None:
            root = Path(self.icfg.weights_cache_dir) if self.icfg.weights_cache_dir else \
                Path(tempfile.mkdtemp(prefix=f"rlstream-weights-{self.icfg.worker_id}-"))
            self._weights_cache = WeightsCache(root, self.icfg.weights_cache_bytes)
        return self._weights_cache

    async def _download(self, version: PolicyVersion, record: SourceRecord | None) -> Path | None:
        """The local copy of a version whose ``uri`` is a URL under ``inference.weights_roots``: from the cache, or
        downloaded into it with every file checked against the manifest. A failed or mismatching download (a
        corrupted or truncated file) is reported and dead-lettered, then tried again ``inference.download_retries``
        times; None once it is given up (reported). Other refusals (outside the roots, file types, size) raise."""
        check_url_under_roots(version, self.icfg.weights_roots)
        protected = set(self.wanted) | {self.state.version} | {self._adapter_version(n) for n in self.adapters}
        attempts = self.icfg.download_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return await asyncio.to_thread(self.weights_cache.fetch, version, protected,
                                               self.icfg.max_version_bytes, self.icfg.weight_store_options)
            except DownloadMismatch as exc:
                log.warning("download refused", version=version.version, uri=version.uri, attempt=attempt,
                            of=attempts, error=str(exc))
                await self._report(version, record, exc, refused=True)
                if attempt < attempts:
                    await asyncio.sleep(self.icfg.retry_backoff_s * 2 ** (attempt - 1))
        return None

    def _drop_staged(self) -> None:
        """Let go of the staged copies the server no longer uses (the loaded adapters and full weights are kept): a
        full version's copy is deleted at once (vLLM read it during the reload), a LoRA version's is retired and
        deleted later by :meth:`_purge_retired` (retention.py: a queued request may make vLLM read it again)."""
        keep = {self.state.weights_dir} | {self._staged.get(self._adapter_version(n)) for n in self.adapters}
        now = time.monotonic()
        for version, path in list(self._staged.items()):
            if path not in keep:
                del self._staged[version]
                if version in self._lora_staged:
                    self._lora_staged.discard(version)
                    self._retired[version] = RetiredFiles(version, path, now)
                else:
                    shutil.rmtree(path, ignore_errors=True)

    def _purge_retired(self, listed: set[int]) -> None:
        """Delete the retired copies retention.py allows: the server does not list the version (``listed``, read
        from ``/v1/models``) and ``inference.trim_grace_s`` has passed since it was unloaded."""
        for files in deletable(list(self._retired.values()), listed, time.monotonic(), self.icfg.trim_grace_s):
            shutil.rmtree(files.path, ignore_errors=True)
            del self._retired[files.version]
            log.info("staged files of an unloaded version deleted", version=files.version, path=str(files.path))

    @staticmethod
    def _adapter_version(name: str) -> int:
        return int(name.rsplit("-v", 1)[1])

    async def _load(self, version: PolicyVersion, weights_dir: Path) -> None:
        if version.kind == WeightsKind.lora:
            name = adapter_name(version.policy, version.version)
            if name in self.adapters:  # loaded by an earlier attempt whose follow-up failed
                await self.backend.unload_lora(name)
                self.adapters.remove(name)
            await self.backend.load_lora(name, weights_dir)
            self.adapters.append(name)
            if version.version > self.state.version:  # an older version loaded for serving leaves the newest
                self.state = LoadedState(version.version, name, "lora", self.state.weights_dir)
            await self._trim_adapters()
        elif version.kind == WeightsKind.full:
            previous = self.state.weights_dir or self._base_dir(version)
            await self.backend.load_full(weights_dir, rollback_dir=previous)
            self.state = LoadedState(version.version, self.icfg.served_model, "full", weights_dir)
            # adapters trained against the old base no longer match the served weights
            while self.adapters:
                await self._unload_quietly(self.adapters.popleft())
        else:  # pragma: no cover - the enum has two members
            raise LoadRefused(f"unknown weights kind {version.kind}")

    def _base_dir(self, version: PolicyVersion) -> Path | None:
        """The base model's directory to fall back to when a full reload fails: only under the weights roots."""
        path = rollback_dir(version.base_model, self.weights_roots, self.icfg.weights_root)
        if path is None:
            log.warning("base_model is not under the weights roots; a failed reload has no fallback",
                        base_model=version.base_model, version=version.version)
        return path

    async def _trim_adapters(self) -> None:
        """Unload the oldest candidates beyond ``keep_adapters``; the versions the fleet is asked to serve stay, and
        so does a version held for an evaluation on this replica (the gate's, or ``rlstream up``'s held-out scoring)."""
        keep = set(self.wanted)
        try:
            keep |= await self.serving.evaluation_holds(self.cfg.policy, self.icfg.worker_id)
        except Exception as exc:  # noqa: BLE001 - Redis unreachable: trim as if nothing were held
            log.warning("cannot read the evaluation hold; trimming adapters without it", error=str(exc))
        for name in adapters_to_unload(list(self.adapters), keep, self.icfg.keep_adapters):
            self.adapters.remove(name)
            await self._unload_quietly(name)

    # -- the versions the fleet is asked to serve ---------------------------------------------
    async def follow_serving(self, force: bool = False) -> None:
        """Read the serving pointer (at most every ``SERVING_POLL_S``) and load the serving, pending and canary
        versions this server lacks, from their trusted records (LoRA versions side by side; on a serve replica
        following ``serving``, the one full version :func:`full_version_for_serve` names; a failed one again after
        ``WANTED_RETRY_S``)."""
        now = time.monotonic()
        if not force and now - self._serving_read_at < SERVING_POLL_S:
            return
        self._serving_read_at = now
        try:
            self.pointer_wants = await self.serving.wanted(self.cfg.policy)
        except Exception as exc:  # noqa: BLE001 - Redis unreachable: keep what is loaded, read again later
            log.warning("cannot read the serving pointer", error=str(exc))
            return
        self.wanted = self.pointer_wants.all()
        if self.follows_serving:
            await self._hold_full(full_version_for_serve("serving", None, self.pointer_wants, self.icfg.worker_id),
                                  now)
        loaded = {self._adapter_version(n) for n in self.adapters} | {self.state.version}
        if self.state.kind != "full":
            loaded.add(0)  # the base model's own name answers as version 0 beside the adapters
        for version in sorted(self.wanted - loaded, reverse=True):
            known = self.known.get(version)
            failed = self.failed.get(version)
            if known is None or failed is not None and now - failed[0] < WANTED_RETRY_S:
                continue
            if known[0].kind != WeightsKind.lora:
                continue  # one full version per server: _hold_full's on a serve replica following serving
            log.info("loading a version the fleet is asked to serve", version=version)
            await self.sync(known[0], known[1])
        await self._emit_fleet_failures()

    async def _hold_full(self, target: int | None, now: float) -> None:
        """Load the full version ``target`` the serving pointer asks for when the server holds another one (also an
        older one: a rollback loads its trusted record again)."""
        if target is None or target == self.state.version:
            return
        known = self.known.get(target)
        if known is None:
            if target not in self._unknown_wanted:
                self._unknown_wanted.add(target)
                log.warning("the serving pointer asks for a version with no trusted record here; not loaded",
                            version=target, loaded=self.state.version)
            return
        if known[0].kind != WeightsKind.full:
            return  # a LoRA version: loaded under its own name by follow_serving
        failed = self.failed.get(target)
        if failed is not None and now - failed[0] < WANTED_RETRY_S:
            return
        wants = self.pointer_wants
        log.info("loading the full-weights version the serving pointer asks for", version=target,
                 loaded=self.state.version, serving=wants.serving, pending=wants.pending, canary=wants.canary)
        await self.sync(known[0], known[1])

    async def _emit_fleet_failures(self) -> None:
        """``inference/fleet_load_failed`` when it changed (a gauge: Prometheus keeps the last value)."""
        failing = sum(1 for v in self.wanted if v in self.failed)
        if failing != self._fleet_failures_emitted:
            self._fleet_failures_emitted = failing
            await self.metrics.emit(mn.INFERENCE_FLEET_LOAD_FAILED, float(failing),
                                    tags={"worker": self.icfg.worker_id})

    async def _unload_quietly(self, name: str) -> None:
        try:
            await self.backend.unload_lora(name)
        except BackendError as exc:
            log.warning("could not unload an old adapter", name=name, error=str(exc))

    # -- reporting --------------------------------------------------------------------------
    async def _report(self, version: PolicyVersion, record: SourceRecord | None, exc: Exception, refused: bool) -> None:
        self.failures += 1
        self.failed[version.version] = (time.monotonic(), f"{type(exc).__name__}: {exc}")
        while len(self.failed) > 32:
            del self.failed[min(self.failed)]
        if refused:
            self.refused.append((version.version, str(exc)))
        what = "refused" if refused else "failed"
        log.error(f"version {what}", policy=version.policy, version=version.version, error=str(exc),
                  loaded_version=self.state.version)
        await self.metrics.emit(mn.INFERENCE_LOAD_FAILED, 1.0, step=version.version,
                                tags={"worker": self.icfg.worker_id, "reason": type(exc).__name__})
        if isinstance(exc, (UntrustedVersion, UntrustedVersionRecord)):
            await self.metrics.emit(mn.INFERENCE_VERSION_REFUSED, 1.0, step=version.version,
                                    tags={"worker": self.icfg.worker_id, "reason": exc.reason})
        try:
            await self.control.redis.hset(worker_key(self.cfg.policy, self.icfg.worker_id), mapping={
                "last_error": f"version {version.version} {what}: {exc}", "last_error_version": version.version,
                "last_error_at": time.time()})
        except Exception as redis_exc:  # the dlq and log still carry it
            log.warning("could not record the failure in redis", error=str(redis_exc))
        if record is not None:
            await self.dead_letters.send(record, exc)

    # -- heartbeat --------------------------------------------------------------------------
    async def read_back(self) -> dict[int, str] | None:
        """The versions the server answers to (``/v1/models``), by version: the policy's adapters, and the base name
        as the loaded full version (0 before any). None when the server does not answer."""
        models = getattr(self.backend, "models", None)
        if models is None:  # a backend without a model listing: what this worker loaded
            names = [self.icfg.served_model, *self.adapters]
        else:
            try:
                names = await models()
            except BackendError as exc:
                log.warning("the server does not list its models; no heartbeat", error=str(exc))
                return None
        loaded: dict[int, str] = {}
        for name in names:
            version = adapter_version(self.cfg.policy, name)
            if version is not None:
                loaded[version] = name
            elif name == self.icfg.served_model:
                loaded.setdefault(self.state.version if self.state.kind == "full" else 0, name)
        return loaded

    async def _heartbeat(self) -> None:
        """Acknowledge what the server has loaded (read back, not assumed), with the heartbeat; delete the retired
        files the server no longer lists (:meth:`_purge_retired`). None while the server is down."""
        if self.engine_down:
            return
        loaded = await self.read_back()
        if loaded is None:
            return
        self._purge_retired(set(loaded))
        if self.engine_down:  # went down while the server was asked
            return
        newest = max(loaded) if loaded else 0
        failed = {v: error for v, (_, error) in self.failed.items() if v not in loaded}
        await self.serving.record_replica(self.cfg.policy, ReplicaAck(
            worker_id=self.icfg.worker_id, version=newest, name=loaded.get(newest, self.state.name),
            url=self.replica_url, loaded=loaded, failed=failed, role=self.icfg.role,
            follows=self.icfg.full_weights_follow), self.icfg.heartbeat_ttl_s)

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.5, self.icfg.heartbeat_ttl_s / 3))
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                return
            try:
                await self._heartbeat()
            except Exception as exc:
                log.warning("heartbeat failed", error=str(exc))

    # -- the server's health ------------------------------------------------------------------
    async def _health_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.icfg.health_interval_s)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                return
            try:
                await self.check_health()
            except Exception as exc:  # noqa: BLE001 - Redis or Kafka trouble: the next check tries again
                log.warning("handling a health check failed", error=str(exc))

    async def check_health(self) -> HealthChange | None:
        """One health check of the server (vLLM's ``/health``). Going down takes the replica out of routing at once
        and is counted; coming back makes the worker's loop run :meth:`recover`. None: no change (or a backend
        without a health check)."""
        healthy = getattr(self.backend, "healthy", None)
        if healthy is None:
            return None
        change = self.health.observe(await healthy(timeout_s=HEALTH_TIMEOUT_S))
        tags = {"worker": self.icfg.worker_id}
        if change == HealthChange.down:
            self.engine_down = True
            reason = f"health check failed {self.health.failed_in_row} times in a row"
            log.error("the inference server is down; the replica leaves routing until it is back",
                      url=self.replica_url, reason=reason)
            await self.serving.mark_replica_down(self.cfg.policy, self.icfg.worker_id, reason,
                                                 self.icfg.heartbeat_ttl_s)
            await self.metrics.emit(mn.INFERENCE_ENGINE_DOWN, 1.0, tags=tags)
            await self.metrics.emit(mn.INFERENCE_ENGINE_UP, 0.0, tags=tags)
        elif change == HealthChange.up:
            log.info("the inference server answers again; loading its versions again", url=self.replica_url)
            self._recover = True
        return change

    async def recover(self) -> None:
        """The server answers again (its supervisor restarted it, with nothing loaded): load again what it held (the
        full weights, then every adapter it no longer lists, from their staged copies), the newest version announced
        while it was down, and the versions the fleet is asked to serve; only then does the heartbeat put the replica
        back into routing."""
        self._recover = False
        listed = await self.read_back()
        try:
            if listed is None:
                raise BackendError("the server does not list its models")
            if self.state.kind == "full" and self.state.weights_dir is not None:
                await self.backend.load_full(self.state.weights_dir)  # /v1/models cannot tell base from reloaded
            reloaded = []
            for name in list(self.adapters):
                version = self._adapter_version(name)
                if version in listed:
                    continue
                path = self._staged.get(version)
                if path is None:  # no staged copy left: not held any more
                    self.adapters.remove(name)
                    continue
                await self.backend.load_lora(name, path)
                reloaded.append(version)
        except BackendError as exc:
            if self.health.down:  # down again: the next recovery starts over
                return
            log.warning("loading the versions of the server again failed; trying again", error=str(exc))
            await asyncio.sleep(self.icfg.health_interval_s)
            self._recover = True
            return
        if self.health.down:
            return
        self.engine_down = False
        log.info("the server has its versions again; the replica is back in routing", reloaded=reloaded,
                 full=self.state.version if self.state.kind == "full" else None)
        newest = max((v for v, (record, _) in self.known.items() if self._loads_now(record)), default=None)
        if newest is not None and newest > self.state.version:
            await self.sync(*self.known[newest])
        await self.follow_serving(force=True)
        await self._heartbeat()
        await self.metrics.emit(mn.INFERENCE_ENGINE_UP, 1.0, tags={"worker": self.icfg.worker_id})

