"""``rlstream_trainer``: NAT's Trainer as a shim over rlstream's epoch engine (:class:`rlstream.finetune.EpochEngine`).

The engine runs NAT's epoch loop: validation when ``epoch % validation_interval == 0`` (epoch 0 is the
baseline) and after the last epoch (NAT never validates the final model), the builder's generations, NAT's
curriculum rule (:func:`rlstream.streams.curriculum.select_groups`), one version per epoch, and NAT's output files
in ``finetuning.output_dir`` (``training_metrics.jsonl``, ``reward_history.json``, ``validation_history.json``,
``curriculum_state.json``, ``reward_plot.png``). The trainer pairs with ``rlstream_trainer_adapter``, which owns
the engine; any NAT TrajectoryBuilder generates.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nat.data_models.finetuning import FinetuneConfig, TrainingJobRef, TrainingJobStatus
from nat.finetuning.interfaces.finetuning_runner import Trainer
from nat.finetuning.interfaces.trajectory_builder import TrajectoryBuilder

from rlstream.finetune import CandidateGroup, EpochEngine, FinetuneError, OutcomeStatus
from rlstream.nat.adapter import RlstreamTrainerAdapter, job_status
from rlstream.nat.builder import RlstreamTrajectoryBuilder
from rlstream.nat.config import RlstreamTrainerConfig
from rlstream.nat.nat_config import NatConfigError, resolved_config
from rlstream.transport.log import get_logger

log = get_logger(__name__)


class NatGenerator:
    """The engine's generator over a NAT TrajectoryBuilder: one builder run per epoch, converted by the adapter."""

    def __init__(self, trainer: "RlstreamTrainer", adapter: RlstreamTrainerAdapter) -> None:
        self.trainer = trainer
        self.adapter = adapter

    @property
    def builder(self) -> TrajectoryBuilder:
        return self.trainer.trajectory_builder

    @property
    def validates(self) -> bool:
        rc = self.trainer.run_config.run_configuration
        return bool(rc is not None and rc.validation_dataset)

    async def generate(self, epoch: int) -> list[CandidateGroup]:
        """The epoch's groups; an epoch without a single trajectory (every generation failed) ends the run."""
        builder_run = f"{self.trainer.run_id}_epoch_{epoch}"
        await self.builder.start_run(builder_run, {"epoch": epoch})
        collection = await self.builder.finalize(builder_run, {"epoch": epoch})
        if not any(collection.trajectories):
            problems: list[str] = []
            if isinstance(self.builder, RlstreamTrajectoryBuilder):
                problems = self.builder.stats.problems.get(builder_run, [])
            why = "; ".join(dict.fromkeys(problems)) or "the trajectory builder returned none"
            raise FinetuneError(f"epoch {epoch}: every generation failed, nothing to train on ({why})")
        return self.adapter.candidate_groups(collection)

    async def validate(self, epoch: int) -> list[float]:
        rc = self.trainer.run_config.run_configuration
        if isinstance(self.builder, RlstreamTrajectoryBuilder):
            return await self.builder.validation_rewards(rc.validation_dataset, rc.validation_config_file)
        metrics = await self.trainer.run_validation_evaluation(epoch, self.trainer.run_id)
        return [float(metrics["avg_reward"])] * int(metrics.get("num_examples", 0))


def dataset_file(run_config: FinetuneConfig) -> Path | None:
    """The training dataset file of the run: ``--dataset``, else ``eval.general.dataset.file_path``."""
    rc = run_config.run_configuration
    if rc is None:
        return None
    if rc.dataset:
        return Path(rc.dataset)
    dataset = resolved_config(rc).eval.general.dataset
    path = getattr(dataset, "file_path", None) if dataset is not None else None
    return Path(path) if path else None


def dataset_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a training dataset (missing, empty, a JSON list without rows), None if it can."""
    if not path.is_file():
        return f"the dataset file {path} does not exist" + ("" if path.is_absolute() else f" (in {Path.cwd()})")
    text = path.read_text(errors="replace") if path.stat().st_size < 64 * 1024 * 1024 else "x"
    if not text.strip():
        return f"the dataset file {path} is empty"
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except ValueError as exc:
            return f"the dataset file {path} is not valid JSON: {exc}"
        if isinstance(rows, list) and not rows:
            return f"the dataset file {path} has no rows"
    return None


def check_run(run_config: FinetuneConfig) -> None:
    """Refuse at once what would make every generation fail: a remote ``--endpoint``, a missing or empty dataset."""
    rc = run_config.run_configuration
    if rc is not None and rc.endpoint:
        raise NatConfigError(
            f"--endpoint {rc.endpoint}: rlstream trains on the target LLM's calls inside each workflow run (NAT's "
            "intermediate steps, with vLLM's token data), which a remote `nat serve` does not send back; run "
            "`nat finetune` without --endpoint: the workflow runs in this process against the same vLLM server")
    path = dataset_file(run_config)
    if path is None:
        raise NatConfigError("no training dataset: set eval.general.dataset.file_path or pass --dataset")
    problem = dataset_problem(path)
    if problem is not None:
        source = "--dataset" if rc is not None and rc.dataset else "eval.general.dataset.file_path"
        raise NatConfigError(f"{problem} ({source})")


class RlstreamTrainer(Trainer):
    """NAT Trainer: the epochs run in the engine of the bound ``rlstream_trainer_adapter``."""

    def __init__(self, trainer_config: RlstreamTrainerConfig, **kwargs: Any) -> None:
        super().__init__(trainer_config, **kwargs)
        self.config = trainer_config
        self.adapter: RlstreamTrainerAdapter | None = None
        self.generator: NatGenerator | None = None
        self.run_id = ""

    @property
    def engine(self) -> EpochEngine:
        assert self.adapter is not None and self.adapter.engine is not None, "initialize() first"
        return self.adapter.engine

    async def initialize(self, run_config: FinetuneConfig) -> None:
        adapter = self.trainer_adapter
        if not isinstance(adapter, RlstreamTrainerAdapter):
            raise NatConfigError(f"rlstream_trainer runs rlstream's epoch engine: pair it with trainer_adapter "
                                 f"_type rlstream_trainer_adapter, not {type(adapter).__name__}")
        adapter.curriculum_seed = self.config.seed
        check_run(run_config)
        try:
            await super().initialize(run_config)  # initializes the builder and the adapter (the engine)
        except BaseException:
            await adapter.close()  # NAT calls cleanup only after a successful initialize
            raise
        self.adapter = adapter
        assert adapter.cfg is not None
        self.run_id = adapter.cfg.run_id
        if isinstance(self.trajectory_builder, RlstreamTrajectoryBuilder):
            self.trajectory_builder.route = adapter.route
        self.generator = NatGenerator(self, adapter)

    @property
    def validation_interval(self) -> int:
        rc = self.run_config.run_configuration
        return rc.validation_interval if rc is not None else 5

    async def run(self, num_epochs: int) -> list[TrainingJobStatus]:
        assert self.generator is not None, "initialize() first"
        outcomes = await self.engine.run(self.generator, num_epochs, self.validation_interval)
        failed = [(i, o) for i, o in enumerate(outcomes) if o.status != OutcomeStatus.COMPLETED]
        if failed:  # continue_on_failure: the run went on, and still did not do what it was asked
            raise FinetuneError(f"{len(failed)} of {len(outcomes)} epochs failed: " + "; ".join(
                f"job {i}: {o.message}" for i, o in failed[:3]))
        return [job_status(self.run_id, o) for o in outcomes]

    async def run_epoch(self, epoch: int, run_id: str) -> TrainingJobRef | None:
        assert self.generator is not None and self.adapter is not None, "initialize() first"
        outcome = await self.engine.run_epoch(self.generator, epoch)
        return self.adapter.record(run_id, outcome) if outcome is not None else None

    async def get_metrics(self, run_id: str) -> dict[str, Any]:
        return self.engine.summary()

    def log_progress(self, epoch: int, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        log.info("epoch progress", **{**metrics, "epoch": epoch})

    async def cleanup(self) -> None:
        """Write the plot, then stop what the adapter started (NAT calls this once, after the run)."""
        if self.adapter is not None and self.adapter.engine is not None:
            self.adapter.engine.plot()
        if isinstance(self.trainer_adapter, RlstreamTrainerAdapter):
            await self.trainer_adapter.close()
