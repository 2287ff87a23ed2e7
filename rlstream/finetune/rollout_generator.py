"""``rlstream finetune``'s generator: the reference rollout runner through the run's vLLM.

Per epoch, ``finetuning.num_generations`` generations per example (source ``rollout``, routed to the version the
run's vLLM has loaded, scored by the reward function); validation passes publish ``source=validation``
trajectories, which are never trained on.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from rlstream.finetune.engine import CandidateGroup, Generation
from rlstream.finetune.runtime import FinetuneContext, FinetuneError, with_section
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.masking import PLACEHOLDER_API_KEY, secret_value
from rlstream.schemas.models import TrajectoryEvent, TrajectorySource
from rlstream.transport.log import get_logger

log = get_logger(__name__)
#: generations per validation example
VALIDATION_GENERATIONS = 1


class RecordingPublisher:
    """Stands in for the runner's TrajectoryPublisher: keeps the events (stamped with ``source``); the engine
    checks and publishes them."""

    def __init__(self, source: TrajectorySource) -> None:
        self.source = source
        self.events: list[TrajectoryEvent] = []

    async def publish_trajectory(self, event: TrajectoryEvent) -> None:
        if event.source != self.source:
            event = event.model_copy(update={"source": self.source})
        self.events.append(event)

    async def flush(self, timeout_s: float | None = None) -> None:
        return None


async def _one_pass(examples: list[dict[str, Any]], label: Any) -> AsyncIterator[tuple[dict[str, Any], Any]]:
    for example in examples:
        yield example, label


def group_id_of(run_id: str, example_id: str, label: Any) -> str:
    """The group id the rollout runner gives one example's group in one pass."""
    return f"{run_id}:{example_id}:{label}"


class RolloutGenerator:
    """Generates with :class:`~rlstream.rollout.runner.RolloutRunner`; validation publishes its trajectories
    itself (``source=validation``)."""

    def __init__(self, context: FinetuneContext, validation_cfg: RlstreamConfig | None = None) -> None:
        self.context = context
        self.cfg = context.cfg
        self.validation_cfg = validation_cfg
        self.examples: list[dict[str, Any]] = []
        self.validation_examples: list[dict[str, Any]] = []
        self.generation_failures = 0
        self._client: Any = None
        self._workflow: Any = None
        self._reward: Any = None
        self._validation_publisher: Any = None

    @property
    def validates(self) -> bool:
        return bool(self.validation_examples)

    async def open(self) -> None:
        """Load the datasets, the workflow and the reward; open the OpenAI client of the run's vLLM."""
        from openai import AsyncOpenAI

        from rlstream.rollout.loading import load_callable, load_examples
        from rlstream.rollout.publisher import TrajectoryPublisher
        from rlstream.rollout.workflows import check_workflow

        rcfg, ft = self.cfg.rollout, self.cfg.finetuning
        if rcfg.dataset is None:
            raise FinetuneError("no training dataset: give --dataset or set rollout.dataset")
        self.examples = load_examples(rcfg.dataset, rcfg.example_id_field)
        val_cfg = self.validation_cfg or self.cfg
        val_path = ft.validation_dataset or val_cfg.finetuning.validation_dataset
        if val_path is not None:
            self.validation_examples = load_examples(val_path, val_cfg.rollout.example_id_field)
        self._workflow = check_workflow(load_callable(rcfg.workflow or "rlstream.rollout.workflows:single_turn"))
        reward_ref = rcfg.reward_function or ft.reward_function.function
        if not reward_ref:
            raise FinetuneError("finetune needs a reward: set rollout.reward_function or "
                                "finetuning.reward_function.function (module:function)")
        self._reward = load_callable(reward_ref)
        self._client = AsyncOpenAI(base_url=self.context.base_url,
                                   api_key=secret_value(rcfg.api_key) or PLACEHOLDER_API_KEY,
                                   timeout=self.cfg.inference.request_timeout_s)
        if self.validation_examples:
            topics = self.context.topics
            self._validation_publisher = TrajectoryPublisher.from_config(
                self.cfg.kafka, topics.trajectories, topics.rewards, max_in_flight=rcfg.max_in_flight)
            await self._validation_publisher.start()

    async def close(self) -> None:
        if self._validation_publisher is not None:
            try:
                await self._validation_publisher.close()
            except Exception as exc:
                log.warning("validation publisher closed with errors", error=str(exc))
        if self._client is not None:
            await self._client.close()

    def _pass_config(self, base: RlstreamConfig, group_size: int, n_examples: int) -> RlstreamConfig:
        return with_section(base, "rollout", group_size=group_size, mode="epoch", epochs=1, max_groups=None,
                            groups_per_version=max(1, n_examples), route_worker_id=self.context.worker_id,
                            base_url=self.context.base_url, prompts_topic=None)

    def _runner(self, cfg: RlstreamConfig, publisher: Any, workflow: Any, reward: Any) -> Any:
        from rlstream.rollout.runner import RolloutRunner

        assert self.context.control is not None
        return RolloutRunner(cfg, workflow, self._client, publisher, self.context.control, reward,
                             self.context.rollout_metrics)

    async def generate(self, epoch: int) -> list[CandidateGroup]:
        generations = self.cfg.finetuning.num_generations
        cfg = self._pass_config(self.cfg, generations, len(self.examples))
        recorder = RecordingPublisher(TrajectorySource.rollout)
        log.info("epoch generation started", epoch=epoch, examples=len(self.examples), generations=generations)
        try:
            stats = await self._runner(cfg, recorder, self._workflow, self._reward).run(_one_pass(self.examples, epoch))
            self.generation_failures += max(0, stats.generations_failed)
        except Exception as exc:  # the runner itself broke: go on with what it generated
            log.error("epoch generation stopped early; going on with what was generated", epoch=epoch, error=str(exc))
        by_group: dict[str, list[Generation]] = {}
        for event in recorder.events:
            by_group.setdefault(event.group_id, []).append(
                Generation(event, float(event.reward) if event.reward is not None else float("nan")))
        order = [group_id_of(self.cfg.run_id, str(e["id"]), epoch) for e in self.examples]
        return [CandidateGroup(gid, by_group[gid]) for gid in order if gid in by_group]

    async def validate(self, epoch: int) -> list[float]:
        from rlstream.rollout.loading import load_callable
        from rlstream.rollout.workflows import check_workflow

        if not self.validation_examples:
            return []
        base = self.validation_cfg or self.cfg
        cfg = self._pass_config(base, VALIDATION_GENERATIONS, len(self.validation_examples))
        workflow = check_workflow(load_callable(base.rollout.workflow)) if base.rollout.workflow else self._workflow
        reward_ref = base.rollout.reward_function or base.finetuning.reward_function.function
        reward = load_callable(reward_ref) if reward_ref else self._reward
        recorder = RecordingPublisher(TrajectorySource.validation)
        await self._runner(cfg, recorder, workflow, reward).run(_one_pass(self.validation_examples,
                                                                          f"validation-{epoch}"))
        for event in recorder.events:  # on Kafka too, for lineage and plots; the learner never trains them
            await self._validation_publisher.publish_trajectory(event)
        await self._validation_publisher.flush()
        rewards = [float(e.reward) for e in recorder.events if e.reward is not None]
        log.info("validation pass", epoch=epoch, examples=len(self.validation_examples), scored=len(rewards))
        return rewards
