"""Held-out evaluation of ``rlstream up``: every version vLLM loads (and the base model first) scored on the held-out
prompts with the run's own workflow and reward function."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from rlstream.rollout.sampling import SamplingSettings
from rlstream.rollout.workflows import Workflow, check_workflow
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.masking import secret_value
from rlstream.transport.control import ControlPlane
from rlstream.transport.log import get_logger
from rlstream.transport.signals import sleep_or_stop

log = get_logger(__name__)

#: Seconds a held-out scoring holds its version on the replica at most (released as soon as it is scored).
SCORING_HOLD_S = 900.0


@dataclass
class VersionScore:
    """One version's held-out figures."""

    version: int
    model: str
    reward_mean: float
    samples: int
    at: float
    components: dict[str, float] = field(default_factory=dict)  # the reward function's components, averaged


#: the held-out figure of the answer's length in words (an answer that grows or collapses shows here)
ANSWER_WORDS = "answer_words"
#: the same in tokens, as the promotion gate measures it
ANSWER_TOKENS = "answer_tokens"

#: the gate's evaluation figures (``PromotionDecision`` metrics) -> the held-out components ``rlstream up`` shows.
#: Not the gate's tool_call_parse_rate: it counts the calls the server parsed out of those made (nearly always 1),
#: where the component tool_call_parsed is the share of episodes whose first call parsed.
GATE_COMPONENTS: dict[str, str] = {"task_success": "success", "answer_length": ANSWER_TOKENS}


def score_from_gate(version: int, model: str, metrics: dict[str, float], at: float) -> VersionScore | None:
    """A version's held-out score from the figures the promotion gate measured for one decision (its
    ``candidate_metrics`` or ``serving_metrics``): the same held-out prompts, the task's own episode and reward
    function, so ``rlstream up`` need not evaluate every version a second time. None when the decision carries no
    evaluation (a failed evaluation, an operator's decision)."""
    reward, samples = metrics.get("reward_mean"), metrics.get("samples")
    if reward is None or not samples:
        return None
    parts = {name: metrics[figure] for figure, name in GATE_COMPONENTS.items() if figure in metrics}
    return VersionScore(version, model, float(reward), int(samples), at, parts)


def answer_text(output: Any) -> str:
    """The final answer of a workflow's output: its ``final_answer`` (an agent episode), else the output itself."""
    return str(getattr(output, "final_answer", output) or "")


async def evaluate_heldout(base_url: str, examples: list[dict[str, Any]], workflow: Workflow, reward_fn: Any,
                           samples: int, sampling: SamplingSettings,
                           api_key: str | None = None,
                           components: dict[str, float] | None = None) -> tuple[float, int]:
    """Mean reward of ``samples`` runs of ``workflow`` per held-out example, sampled with ``sampling``
    (whose ``model`` names the version served by vLLM). ``components``, when given, receives the mean of each of the
    reward function's components (e.g. the tool task's success and tool-call parse rate) and of the answer's length
    in words (``answer_words``).

    The workflow gets a plain (not recorded) OpenAI client, so evaluation traffic never reaches training.
    """
    from openai import AsyncOpenAI

    from rlstream.rollout.runner import score

    check_workflow(workflow)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", timeout=60.0)
    try:
        async def one(example: dict[str, Any]) -> tuple[float, dict[str, float]]:
            output = await workflow(example, client, sampling)
            reward, parts = score(reward_fn(example, output))
            return reward, {**parts, ANSWER_WORDS: float(len(answer_text(output).split()))}

        scored = await asyncio.gather(*(one(e) for e in examples for _ in range(samples)))
    finally:
        await client.close()
    scores = [reward for reward, _ in scored]
    if components is not None and scored:
        names = {name for _, parts in scored for name in parts}
        components.update({name: sum(parts.get(name, 0.0) for _, parts in scored) / len(scored) for name in names})
    return (sum(scores) / len(scores) if scores else 0.0), len(scores)


async def evaluate_versions(cfg: RlstreamConfig, control: ControlPlane, base_url: str, heldout: list[dict[str, Any]],
                            samples: int, stop: asyncio.Event,
                            on_score: Callable[[VersionScore], Awaitable[None]]) -> None:
    """Score every version the inference worker reports loaded (and the base model first) on held-out examples,
    with the run's own workflow and reward function."""
    from rlstream.rollout.loading import UserCodeError, load_callable
    from rlstream.rollout.routing import Route
    from rlstream.transport.serving import ServingControl

    try:
        workflow = check_workflow(load_callable(cfg.rollout.workflow or "rlstream.rollout.workflows:single_turn"))
    except UserCodeError as exc:
        log.error("held-out evaluation is off: the workflow cannot be used", error=str(exc))
        return
    if not cfg.rollout.reward_function:
        log.warning("no rollout.reward_function: held-out evaluation is off (rewards come as RewardEvents)")
        return
    reward_fn = load_callable(cfg.rollout.reward_function)

    serving = ServingControl(control)

    async def newest_loaded() -> Route | None:
        """The newest version a replica acknowledged, by its own name on that replica's server: candidates too, not
        only the serving one (with full weights, a candidate is on the evaluation server only)."""
        loaded = [(v, name or cfg.rollout.model, r.url, r.worker_id) for r in await serving.replicas(cfg.policy)
                  for v, name in r.loaded.items()]
        if not loaded:
            return None
        version, model, url, worker_id = max(loaded)
        return Route(model, version, worker_id=worker_id, url=url)

    sampling = SamplingSettings.from_config(cfg.rollout)
    done: set[int] = set()
    while not stop.is_set():
        route = await newest_loaded()
        if route is not None and route.version not in done:
            done.add(route.version)
            parts: dict[str, float] = {}
            try:
                where = f"{route.url.rstrip('/')}/v1" if route.url else base_url
                # the replica keeps the version loaded while it is scored (a LoRA adapter is not trimmed away)
                async with serving.held_for_evaluation(cfg.policy, route.worker_id or "", route.version,
                                                       SCORING_HOLD_S):
                    mean, n = await evaluate_heldout(where, heldout, workflow, reward_fn, samples,
                                                     sampling.with_model(route.model),
                                                     api_key=secret_value(cfg.inference.api_key), components=parts)
            except Exception as exc:
                log.warning("held-out evaluation failed", version=route.version, model=route.model, error=str(exc))
                done.discard(route.version)
            else:
                await on_score(VersionScore(route.version, route.model, mean, n, time.time(), parts))
        await sleep_or_stop(stop, 1.0)
