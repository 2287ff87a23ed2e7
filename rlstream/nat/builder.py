"""``rlstream_traj_builder``: NAT's evaluation as the rollout, its evaluator's score as the reward.

Per epoch it runs the workflow over the eval dataset ``num_generations`` times (concurrently), reads each
item's intermediate steps into a conversation (:mod:`rlstream.nat.steps`: every call of the target LLM inside
the target functions is a turn, tool calls kept), and groups the generations of one example. A failed
generation loses that generation, never the epoch. Bound to rlstream's trainer adapter, each evaluation run
sends the target LLM's calls to the newest version vLLM has loaded.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from nat.data_models.evaluate_runtime import EvaluationRunConfig, EvaluationRunOutput
from nat.data_models.finetuning import EpisodeItem, EpisodeItemRole, Trajectory, TrajectoryCollection
from nat.finetuning.interfaces.trajectory_builder import TrajectoryBuilder

from rlstream.nat.config import RlstreamTrajectoryBuilderConfig
from rlstream.nat.nat_config import llm_field, resolved_config, target_llm_name
from rlstream.nat.steps import Conversation, conversation_from_steps
from rlstream.nat.token_capture import RECORDER, capturing_config
from rlstream.transport.log import get_logger

log = get_logger(__name__)
#: where a trajectory's conversation travels inside NAT's Trajectory.metadata (the adapter reads it back)
CONVERSATION_KEY = "rlstream_conversation"
#: the route of the target LLM: (model name to request, policy version it serves)
RouteFn = Callable[[], Awaitable[tuple[str, int]]]


@dataclass
class Generation:
    """One evaluation pass of one epoch: its task, and the model/version its target calls went to."""

    task: asyncio.Task[EvaluationRunOutput]
    model: str | None
    version: int


@dataclass
class BuildStats:
    generations_failed: int = 0
    items_without_turns: int = 0
    replaced_turns: int = 0
    turns: int = 0
    turns_with_token_data: int = 0  # token ids and logprobs from the LLM response (the rest are re-rendered)
    trajectories: int = 0
    by_run: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per builder run: why its generations failed or produced nothing (the first few reasons)
    problems: dict[str, list[str]] = field(default_factory=dict)


def episode_of(conv: Conversation) -> list[EpisodeItem]:
    """NAT's view of a conversation: one EpisodeItem per message, tool calls kept in the metadata."""
    trained = {t.message_index for t in conv.turns}
    items = []
    for index, m in enumerate(conv.messages):
        role = EpisodeItemRole(m.role) if m.role in EpisodeItemRole._value2member_map_ else EpisodeItemRole.OTHER
        meta: dict[str, Any] = {}
        if m.tool_calls:
            meta["tool_calls"] = [c.model_dump(mode="json") for c in m.tool_calls]
        if m.tool_call_id:
            meta["tool_call_id"] = m.tool_call_id
        if m.name:
            meta["name"] = m.name
        if role == EpisodeItemRole.ASSISTANT:
            meta["trainable"] = index in trained
        logprobs = conv.logprobs.get(index, []) if role == EpisodeItemRole.ASSISTANT else None
        items.append(EpisodeItem(role=role, content=m.content or "", logprobs=logprobs, metadata=meta or None))
    return items


class RlstreamTrajectoryBuilder(TrajectoryBuilder):
    """NAT TrajectoryBuilder: N evaluation runs per epoch -> groups of trajectories with rlstream turns."""

    def __init__(self, trajectory_builder_config: RlstreamTrajectoryBuilderConfig) -> None:
        super().__init__(trajectory_builder_config=trajectory_builder_config)
        self.config = trajectory_builder_config
        self.route: RouteFn | None = None
        self.stats = BuildStats()
        self._runs: dict[str, list[Generation]] = {}

    @property
    def num_generations(self) -> int:
        return self.config.num_generations

    async def _target(self) -> tuple[Any, str | None, str | None, int]:
        """(the Config of the next run, target LLM name, model name its calls use, policy version)."""
        rc = self.run_config.run_configuration
        config = resolved_config(rc)
        llm = target_llm_name(config, self.run_config)
        model = llm_field(config, llm, "model_name") if llm else None
        version = 0
        if llm and self.route is not None and self.config.route_to_latest_version:
            routed, version = await self.route()
            if routed and routed != model and hasattr(config.llms[llm], "model_name"):
                config = config.model_copy(deep=True)
                config.llms[llm].model_name = routed  # type: ignore[attr-defined]
                model = routed
        if llm and self.config.capture_token_data:
            capturing = capturing_config(config.llms[llm])
            if capturing is not config.llms[llm]:
                config = config.model_copy(deep=True)
                config.llms[llm] = capturing
        return config, llm, model, version

    async def evaluate(self, config: Any, dataset: Any = None) -> EvaluationRunOutput:
        """One NAT evaluation run of ``config`` (on ``dataset`` when given, else the run's)."""
        from nat.plugins.eval.runtime.evaluate import EvaluationRun
        from nat.utils.io.supress_logs import suppress_logs

        rc = self.run_config.run_configuration
        chosen = dataset or rc.dataset  # --dataset arrives as a Path; NAT's evaluation takes a str
        eval_cfg = EvaluationRunConfig(config_file=config, dataset=str(chosen) if chosen else None,
                                       result_json_path=rc.result_json_path, endpoint=rc.endpoint,
                                       endpoint_timeout=rc.endpoint_timeout, override=())
        async with suppress_logs(prefix="nat.eval", level=logging.WARNING):
            return await EvaluationRun(config=eval_cfg).run_and_evaluate()

    async def run_eval(self) -> EvaluationRunOutput:
        config, _, _, _ = await self._target()
        return await self.evaluate(config)

    async def start_run(self, run_id: str, meta: dict | None = None) -> None:
        if run_id in self._runs:
            raise ValueError(f"run {run_id} is already in progress")
        config, _, model, version = await self._target()
        self._runs[run_id] = [
            Generation(asyncio.create_task(self.evaluate(config), name=f"eval-{run_id}-{g}"), model, version)
            for g in range(self.num_generations)]
        log.info("evaluation runs started", run_id=run_id, generations=self.num_generations, model=model,
                 policy_version=version)

    def rewards_of(self, output: EvaluationRunOutput) -> dict[Any, Any]:
        """The reward evaluator's output items by item id (empty when that evaluator did not run)."""
        name = self.run_config.reward_function.name if self.run_config.reward_function else None
        for metric_name, metric in output.evaluation_results:
            if metric_name == name:
                return {item.id: item for item in metric.eval_output_items}
        return {}

    async def finalize(self, run_id: str, meta: dict | None = None) -> TrajectoryCollection:
        generations = self._runs.pop(run_id)
        outputs = await asyncio.gather(*(g.task for g in generations), return_exceptions=True)
        by_example: dict[str, list[Trajectory]] = {}
        counts = {"generations_failed": 0, "items_without_turns": 0, "trajectories": 0}
        problems = self.stats.problems.setdefault(run_id, [])
        for index, (gen, output) in enumerate(zip(generations, outputs)):
            if isinstance(output, BaseException):
                counts["generations_failed"] += 1
                problems.append(f"evaluation run failed: {type(output).__name__}: {output}")
                log.error("evaluation run failed; its generation is lost, the epoch goes on", run_id=run_id,
                          generation=index, error=f"{type(output).__name__}: {output}")
                continue
            rewards = self.rewards_of(output)
            if not rewards:
                counts["generations_failed"] += 1
                reward_name = self.run_config.reward_function.name if self.run_config.reward_function else None
                problems.append(f"the reward evaluator {reward_name!r} produced nothing")
                log.error("the reward evaluator produced nothing", run_id=run_id, generation=index,
                          reward_function=self.run_config.reward_function.name if self.run_config.reward_function
                          else None)
                continue
            for item in output.eval_input.eval_input_items:
                trajectory = await self._trajectory(item, rewards.get(item.id), gen, index, run_id, meta)
                if isinstance(trajectory, str):
                    counts["items_without_turns"] += 1
                    if len(problems) < 5:
                        problems.append(f"item {item.id}: {trajectory}")
                    continue
                counts["trajectories"] += 1
                by_example.setdefault(str(item.id), []).append(trajectory)
        self.stats.generations_failed += counts["generations_failed"]
        self.stats.items_without_turns += counts["items_without_turns"]
        self.stats.trajectories += counts["trajectories"]
        self.stats.by_run[run_id] = counts
        self.log_progress(run_id, {**counts, "groups": len(by_example),
                                   "turns_with_token_data": self.stats.turns_with_token_data, "turns": self.stats.turns})
        return TrajectoryCollection(trajectories=list(by_example.values()), run_id=run_id)

    async def _trajectory(self, item: Any, reward_item: Any, gen: Generation, index: int, run_id: str,
                          meta: dict | None) -> Trajectory | str:
        """The item's trajectory, or why it has none."""
        if reward_item is None:
            return "the reward evaluator did not score it"
        targets = None
        if self.run_config.target_model:
            targets = {m for m in (gen.model,) if m}
        lookup = RECORDER.lookup if self.config.capture_token_data else None
        conv = conversation_from_steps(item.trajectory, self.run_config.target_functions, targets, lookup)
        self.stats.replaced_turns += conv.replaced_turns
        self.stats.turns += len(conv.turns)
        self.stats.turns_with_token_data += conv.turns_with_token_data
        if len(conv.messages) < self.config.min_episode_length:
            log.warning("episode shorter than min_episode_length; item not trained on", item=item.id,
                        messages=len(conv.messages), min_episode_length=self.config.min_episode_length)
            return f"{len(conv.messages)} messages, fewer than min_episode_length {self.config.min_episode_length}"
        if not conv.turns:
            log.warning("no call of the target model in the target functions; item not trained on", item=item.id,
                        target_functions=self.run_config.target_functions, target_model=self.run_config.target_model)
            return "no call of the target model in the target functions"
        return Trajectory(
            episode=episode_of(conv), reward=await self.compute_reward(reward_item, meta=meta),
            metadata={"id": str(item.id), "reasoning": reward_item.reasoning, "run_id": run_id, "generation": index,
                      "policy_version": gen.version, "model": gen.model,
                      CONVERSATION_KEY: {"messages": [m.model_dump(mode="json") for m in conv.messages],
                                         "turns": [t.model_dump(mode="json") for t in conv.turns]}})

    async def validation_rewards(self, dataset: Any, config_file: Any = None) -> list[float]:
        """One evaluation pass over ``dataset`` (with ``config_file`` when given): the reward of each item."""
        if config_file:
            from rlstream.nat.nat_config import resolved_config as load

            config = load(None, config_file)
            if self.route is not None and self.config.route_to_latest_version:
                llm = target_llm_name(config, self.run_config)
                if llm and hasattr(config.llms[llm], "model_name"):
                    config.llms[llm].model_name = (await self.route())[0]  # type: ignore[attr-defined]
        else:
            config, _, _, _ = await self._target()
        output = await self.evaluate(config, dataset)
        return [float(r.score) if r.score is not None else 0.0 for r in self.rewards_of(output).values()]

    def log_progress(self, run_id: str, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        log.info("trajectories built", run_id=run_id, **metrics)
