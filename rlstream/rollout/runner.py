"""The reference rollout runner (``rlstream rollout run``).

For each example, ``group_size`` generations of the user's workflow run (at most ``concurrency``
at once) with capture on; each finished generation is scored by the reward function (when one is
configured; otherwise rewards come later as RewardEvents), tagged with the policy version that
served it, and published. Admission control pauses new groups while the run is more than
``max_policy_lag`` versions ahead of the learner. A failed generation is logged, counted and
reported as a metric; the rest of its group goes on.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_consumer
from rlstream.transport.log import get_logger
from rlstream.transport.metrics import MetricsPublisher
from rlstream.rollout.admission import AdmissionPolicy
from rlstream.rollout.capture import Recording, instrument, routing, to_message
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.routing import Route, VersionRouter
from rlstream.rollout.sampling import SamplingSettings
from rlstream.rollout.workflows import Workflow, check_workflow, example_messages
from rlstream.schemas.config import RlstreamConfig

log = get_logger(__name__)

RewardFn = Callable[[dict[str, Any], Any], Any]


@dataclass
class GenerationFailure:
    example_id: str
    group_id: str
    generation_index: int
    error: str


@dataclass
class RunnerStats:
    groups_started: int = 0
    generations_ok: int = 0
    generations_failed: int = 0
    admission_waits: int = 0
    admission_resyncs: int = 0
    paused_s: float = 0.0
    versions_used: dict[int, int] = field(default_factory=dict)
    failures: list[GenerationFailure] = field(default_factory=list)


def score(result: Any) -> tuple[float, dict[str, float]]:
    """A reward function's result as (reward, components): a number, a (reward, components) pair, or a
    dict of components (its ``reward`` entry, else their sum)."""
    if isinstance(result, tuple) and len(result) == 2:
        reward, components = result
        return float(reward), {k: float(v) for k, v in dict(components).items()}
    if isinstance(result, dict):
        components = {k: float(v) for k, v in result.items()}
        return components.get("reward", sum(components.values())), components
    return float(result), {}


class RolloutRunner:
    """Runs groups of workflow generations and publishes their trajectories."""

    def __init__(
        self,
        cfg: RlstreamConfig,
        workflow: Workflow,
        client: Any,
        publisher: TrajectoryPublisher,
        control: ControlPlane,
        reward_fn: RewardFn | None = None,
        metrics: MetricsPublisher | None = None,
    ) -> None:
        self.cfg = cfg
        self.rcfg = cfg.rollout
        self.workflow = check_workflow(workflow)
        self.sampling = SamplingSettings.from_config(self.rcfg)
        self.reward_fn = reward_fn
        self.publisher = publisher
        self.control = control
        self.metrics = metrics
        self.client = instrument(client, request_token_data=self.rcfg.request_token_data)
        self.router = VersionRouter(control, cfg.policy, self.rcfg.model, self.rcfg.route_worker_id)
        groups_per_version = self.rcfg.groups_per_version or cfg.learner.groups_per_step * cfg.learner.publish_every
        self.admission = AdmissionPolicy(self.rcfg.max_policy_lag, groups_per_version)
        self.target_model = cfg.finetuning.target_model or self.rcfg.model
        self.stats = RunnerStats()
        self._generation_slots = asyncio.Semaphore(self.rcfg.concurrency)
        self._group_slots = asyncio.Semaphore(max(1, math.ceil(self.rcfg.concurrency / self.rcfg.group_size)))
        self._groups_in_flight = 0
        self._last_group_done = time.monotonic()

    # -- the run ----------------------------------------------------------------------------
    async def run(self, examples: AsyncIterator[tuple[dict[str, Any], int]], stop: asyncio.Event | None = None) -> RunnerStats:
        """Run groups for ``examples`` ((example, round) pairs) until they end, ``max_groups`` or ``stop``."""
        stop = stop or asyncio.Event()
        self.admission.base_version = max(0, await self.control.latest_version(self.cfg.policy))
        tasks: set[asyncio.Task[None]] = set()
        try:
            async for example, round_index in examples:
                if stop.is_set() or (self.rcfg.max_groups and self.stats.groups_started >= self.rcfg.max_groups):
                    break
                if not await self._admit(stop):
                    break
                await self._group_slots.acquire()
                self.stats.groups_started += 1
                task = asyncio.create_task(self._group(example, round_index))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await self.publisher.flush()
        log.info("rollout finished", groups=self.stats.groups_started, ok=self.stats.generations_ok,
                 failed=self.stats.generations_failed, paused_s=round(self.stats.paused_s, 1))
        return self.stats

    async def _admit(self, stop: asyncio.Event) -> bool:
        """Wait until admission control lets a new group start; False when stopped while waiting."""
        started = time.monotonic()
        waited = False
        while not stop.is_set():
            learner = await self.control.latest_version(self.cfg.policy)
            route, from_worker = await self.router.current_with_source()
            pointer = await self.router.serving.serving(self.cfg.policy)
            decision = self.admission.decide(self.stats.groups_started, learner,
                                             route.version if from_worker else None,
                                             pointer.version if pointer is not None else None)
            if decision.admit:
                if waited:
                    paused = time.monotonic() - started
                    self.stats.paused_s += paused
                    log.info("admission resumed", paused_s=round(paused, 2), learner_version=learner)
                    await self._emit(mn.ROLLOUT_ADMISSION_PAUSED_S, paused)
                return True
            if not waited:
                waited = True
                self.stats.admission_waits += 1
                log.info("admission paused", reason=decision.reason, groups_started=self.stats.groups_started,
                         learner_version=learner)
            if decision.ahead_of_learner and await self._learner_starved():
                self.admission.resync(self.stats.groups_started, learner)
                self.stats.admission_resyncs += 1
                log.warning("admission resynced: the learner waits for groups and none of this runner's is on the "
                            "way, so the groups counted ahead will never train (filtered, skipped as stale or "
                            "dead-lettered); counting from the learner's version", learner_version=learner,
                            groups_started=self.stats.groups_started, reason=decision.reason)
                await self._emit(mn.ROLLOUT_ADMISSION_RESYNCS, 1.0)
                continue
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.rcfg.admission_poll_s)
            except asyncio.TimeoutError:
                pass
        return False

    async def _learner_starved(self) -> bool:
        """The learner has waited ``admission_resync_s`` for groups, and this runner's last group was done (published)
        at least as long ago: whatever the count still holds ahead of the learner is not on its way."""
        resync_after = self.rcfg.admission_resync_s
        if self._groups_in_flight or time.monotonic() - self._last_group_done < resync_after:
            return False
        try:
            waited = await self.control.learner_waiting_s(self.cfg.policy, patience_s=2.0)
        except Exception as exc:  # noqa: BLE001 - no answer is no evidence: stay paused, ask again at the next poll
            log.warning("learner waiting state not read (Redis unreachable?)", error=str(exc))
            return False
        return waited is not None and waited >= resync_after

    async def _group(self, example: dict[str, Any], round_index: int) -> None:
        group_id = f"{self.cfg.run_id}:{example['id']}:{round_index}"
        self._groups_in_flight += 1
        try:
            await asyncio.gather(*(self._generation(example, group_id, i) for i in range(self.rcfg.group_size)))
        finally:
            self._groups_in_flight -= 1
            self._last_group_done = time.monotonic()
            self._group_slots.release()

    async def _generation(self, example: dict[str, Any], group_id: str, index: int) -> None:
        async with self._generation_slots:
            try:
                route = await self.router.current()
                await self._generate_and_publish(example, group_id, index, route)
                self.stats.generations_ok += 1
                self.stats.versions_used[route.version] = self.stats.versions_used.get(route.version, 0) + 1
            except Exception as exc:  # one failed generation never fails the batch
                self.stats.generations_failed += 1
                failure = GenerationFailure(str(example["id"]), group_id, index, f"{type(exc).__name__}: {exc}")
                self.stats.failures.append(failure)
                log.error("generation failed", example_id=failure.example_id, group_id=group_id,
                          generation_index=index, error=failure.error)
                await self._emit(mn.ROLLOUT_GENERATION_FAILED, 1.0, {"example_id": failure.example_id,
                                                                    "error": failure.error[:200]})

    async def _generate_and_publish(self, example: dict[str, Any], group_id: str, index: int, route: Route) -> None:
        recording = Recording(target_functions=list(self.cfg.finetuning.target_functions),
                              target_model=self.target_model)
        policy_model = self.rcfg.model
        with routing(lambda model: route.model if model == policy_model else model,
                     version=lambda model: route.version if model == policy_model else None):
            with recording:
                output = await self.workflow(example, self.client, self.sampling)
        reward, components = None, {}
        if self.reward_fn is not None:
            result = self.reward_fn(example, output)
            if inspect.isawaitable(result):
                result = await result
            reward, components = score(result)
            if not math.isfinite(reward):
                raise ValueError(f"reward function returned a non-finite reward {reward!r}")
        if not recording.calls:
            raise RuntimeError(f"the workflow made no call of the target model {self.target_model!r}")
        fallback = output if isinstance(output, list) else example_messages(example)
        event = recording.to_event(
            run_id=self.cfg.run_id, example_id=str(example["id"]), group_id=group_id,
            group_size=self.rcfg.group_size, generation_index=index, policy=self.cfg.policy,
            policy_version=route.version, reward=reward, reward_components=components,
            metadata={"served_model": route.model}, producer_id=self.rcfg.producer_id,
            fallback_messages=[to_message(m) for m in fallback],
        )
        await self.publisher.publish_trajectory(event)
        await self._emit(mn.ROLLOUT_PUBLISHED, 1.0, {"policy_version": str(route.version)})

    async def _emit(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        if self.metrics is not None:
            await self.metrics.emit(name, value, tags=tags)


# --- example sources ----------------------------------------------------------------------------
async def dataset_examples(examples: list[dict[str, Any]], mode: str, epochs: int = 1) -> AsyncIterator[tuple[dict[str, Any], int]]:
    """Epoch mode: ``epochs`` passes; continuous mode: cycle the dataset forever."""
    round_index = 0
    while mode == "continuous" or round_index < epochs:
        for example in examples:
            yield example, round_index
        round_index += 1


async def topic_examples(
    cfg: RlstreamConfig, topic: str, stop: asyncio.Event,
    on_bad_record: Callable[[Any, Exception], Awaitable[None]] | None = None,
) -> AsyncIterator[tuple[dict[str, Any], int]]:
    """Continuous mode from a topic: each record is a JSON example. A bad record is handed to
    ``on_bad_record`` (the CLI sends it to the dlq) and the stream goes on."""
    consumer = make_consumer(cfg.kafka, topic, group_id=f"rollout-{cfg.run_id}")
    await consumer.start()
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    try:
                        example = json.loads(record.value)
                        if not isinstance(example, dict):
                            raise ValueError("not a JSON object")
                    except ValueError as exc:
                        log.error("bad prompt record", topic=topic, offset=record.offset, error=str(exc))
                        if on_bad_record is not None:
                            await on_bad_record(record, exc)
                        continue
                    example.setdefault("id", f"{record.partition}-{record.offset}")
                    example["id"] = str(example["id"])
                    yield example, record.offset
            if batches:
                await consumer.commit()
    finally:
        await consumer.stop()
