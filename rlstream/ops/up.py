"""``rlstream up``: the whole system on one machine, training continuously on a toy task.

Starts the embedded broker and Redis, creates the topics, then the streams worker, the learner,
a vLLM server with its sync worker and a rollout runner as child processes; evaluates every
policy version vLLM loads on held-out prompts; shows a live view; on the end of ``--duration``
or Ctrl-C stops every child by PID and writes a reward-per-version plot and a JSON summary.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.ops.infra import LocalStack, free_port, spawn, stop_pid, terminate_as_interrupt
from rlstream.rollout.gateway.auth import API_KEYS_ENV
from rlstream.rollout.sampling import SamplingSettings
from rlstream.rollout.users import USERS_API_KEY_ENV
from rlstream.rollout.workflows import Workflow, check_workflow
from rlstream.transport.kafka import create_topics
from rlstream.transport.log import get_logger
from rlstream.schemas.config import (ConfigError, RlstreamConfig, format_validation_error, load_config,
                                     overrides_to_dict, read_yaml)
from rlstream.schemas.masking import public_config_text, remember_secret, secret_env, secret_value
from rlstream.schemas.topics import TopicNames

log = get_logger(__name__)

#: The toy run: a tiny Qwen2 (random init plus a generic copy skill) learns to answer with the letter the prompt
#: names, under a reward no constant answer can earn (about 1/8); lr 1e-2 wrecks the pre-trained copy skill.
TOY_DEFAULTS: dict[str, Any] = {
    "policy": "toy",
    "topics": {"partitions": 4},
    "streams": {"group_timeout_s": 60.0, "min_group_size": 2, "max_policy_lag": 8, "min_reward_diff": 0.0,
                "metrics_interval_s": 2.0},
    "learner": {"lora": {"enabled": False}, "learning_rate": 1e-3, "groups_per_step": 8, "publish_every": 1,
                "checkpoint_every": 5, "scale_rewards": "group"},
    "rollout": {"workflow": "rlstream.rollout.workflows:single_turn",
                "reward_function": "rlstream.ops.toy:toy_strict_reward",
                "group_size": 8, "concurrency": 8, "max_policy_lag": 2, "mode": "continuous",
                "max_tokens": 12, "temperature": 1.0, "model": "toy"},
    "inference": {"served_model": "toy"},
}
#: A pretrained 135M model: LoRA with a small learning rate (full fine-tuning at the tiny model's rate would wreck it).
SMOLLM2_DEFAULTS: dict[str, Any] = {
    "learner": {"lora": {"enabled": True}, "learning_rate": 1e-4},
    "rollout": {"max_tokens": 16},
}
#: Production traffic trains single responses against a task-wide baseline: a step of 32 of them (about the samples
#: of 4 GRPO groups) is less noisy than 8, and versions come slowly enough that most feedback (5-60 s late) is still
#: within streams.max_policy_lag (measured: 0.34 -> 0.63 in 35 versions, against a dip to 0.20 and 0.48 at 8).
PRODUCTION_TRAFFIC_DEFAULTS: dict[str, Any] = {"learner": {"groups_per_step": 32}}
HELDOUT_SEED = 1_000
#: reward components shown per version when the task's reward function reports them: (name, label, format)
HELDOUT_COMPONENT_ROWS: tuple[tuple[str, str, str], ...] = (
    ("success", "task success", ".2f"), ("tool_call_parsed", "tool-call parse rate", ".2f"),
    ("answer_words", "answer length (words)", ".1f"))


@dataclass
class UpOptions:
    """What ``rlstream up`` was asked for."""

    config: Path | None = None
    overrides: list[tuple[str, str]] = field(default_factory=list)
    duration_s: float | None = None
    until_version: int | None = None  # stop once a version >= this one has been scored on the held-out prompts
    runs_dir: Path = Path("runs")
    heldout_examples: int = 24
    model: str = "tiny"
    eval_samples: int = 4
    live: bool = True
    traffic: str = "synthetic"  # synthetic: the rollout runner's GRPO groups; production: gateway + simulated users
    feedback_delay_s: tuple[float, float] = (5.0, 60.0)
    gate: bool = True  # the promotion gate decides which version serves (rlstream gate, docs/gate.md)
    task: str = "toy"  # toy | tool-agent (rlstream/ops/tool_task.py)
    # completions per held-out prompt for the gate: few enough that it decides before the next candidate replaces a
    # full-weights server's version (the prompts and seeds are the same for every version)
    gate_samples: int = 2


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_file: Path


class Supervisor:
    """Starts children as process-group leaders that die with this process however it ends (PDEATHSIG and the
    group reaper of :func:`rlstream.ops.infra.spawn`) and stops them by process group, newest first.

    ``env`` is added to every child's environment: the run's secrets travel there (:func:`secret_env`), never in
    the config files the children are started with."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env: dict[str, str] = dict(env or {})
        self.children: list[Child] = []
        self.extra_pids: dict[str, int] = {}

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        log_file = self.log_dir / f"{name}.log"
        with open(log_file, "ab") as out:
            proc = spawn(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env, **(env or {})})
        child = Child(name, proc, log_file)
        self.children.append(child)
        log.info("started", service=name, pid=proc.pid, log=str(log_file))
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def stop_all(self) -> None:
        for child in reversed(self.children):
            ended = child.proc.poll()  # it ended by itself: Popen collected its code; else stop_pid does
            reaped = stop_pid(child.proc.pid, timeout_s=20.0)
            log.info("stopped", service=child.name, pid=child.proc.pid,
                     exit_code=ended if ended is not None else reaped)
        for name, pid in self.extra_pids.items():
            log.info("stopped", service=name, pid=pid, exit_code=stop_pid(pid, timeout_s=20.0))


def rlstream_command(*args: str) -> list[str]:
    """The command line of an ``rlstream`` subcommand run with this interpreter."""
    return [sys.executable, "-m", "rlstream.cli", "--log-format", "json", *args]


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def compose_config(opts: UpOptions, run_id: str, run_dir: Path, stack: LocalStack, model_dir: Path | None,
                   vllm_url: str, dataset: Path | None,
                   vllm_api_key: str | None = None) -> tuple[RlstreamConfig, Path]:
    """The effective config of the run (toy defaults < user file < environment < overrides), written to
    ``run_dir`` without its secrets (see :func:`rlstream.schemas.masking.public_config_text`); ``vllm_api_key``
    (the key vLLM was started with) becomes ``inference.api_key`` and ``rollout.api_key``."""
    user = read_yaml(opts.config) if opts.config else {}
    toy = opts.config is None
    base = deep_merge(TOY_DEFAULTS, SMOLLM2_DEFAULTS if opts.model == "smollm2" else {}) if toy else {}
    if toy and opts.traffic == "production":
        base = deep_merge(base, PRODUCTION_TRAFFIC_DEFAULTS)
    if toy and opts.task == "tool-agent":
        from rlstream.ops.tool_task import TOOL_AGENT_DEFAULTS

        base = deep_merge(base, TOOL_AGENT_DEFAULTS)
    plumbing: dict[str, Any] = {
        "run_id": run_id,
        "kafka": {"bootstrap_servers": stack.bootstrap},
        "redis": {"url": stack.redis_url},
        "streams": {"data_dir": str(run_dir / "streams")},
        "learner": {"output_dir": str(run_dir / "learner")},
        "rollout": {"base_url": f"{vllm_url}/v1"},
        "inference": {"url": vllm_url},
    }
    if vllm_api_key:
        plumbing["rollout"]["api_key"] = plumbing["inference"]["api_key"] = vllm_api_key
    if model_dir is not None:
        plumbing["learner"]["model"] = str(model_dir)
    if dataset is not None:
        plumbing["rollout"]["dataset"] = str(dataset)
    merged = deep_merge(deep_merge(base, plumbing), user)
    merged = deep_merge(merged, overrides_to_dict(opts.overrides))
    try:
        cfg = RlstreamConfig(**merged)  # the environment applies as it does to a file
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, opts.config, {})) from None
    # the file holds no secret (the services get them through the environment: Supervisor(env=secret_env(cfg)))
    path = run_dir / "config.yaml"
    path.write_text(public_config_text(cfg))
    return cfg, path


# --- held-out evaluation -------------------------------------------------------------------------------
@dataclass
class VersionScore:
    version: int
    model: str
    reward_mean: float
    samples: int
    at: float
    components: dict[str, float] = field(default_factory=dict)  # the reward function's components, averaged


async def evaluate_heldout(base_url: str, examples: list[dict[str, Any]], workflow: Workflow, reward_fn: Any,
                           samples: int, sampling: SamplingSettings,
                           api_key: str | None = None,
                           components: dict[str, float] | None = None) -> tuple[float, int]:
    """Mean reward of ``samples`` runs of ``workflow`` per held-out example, sampled with ``sampling``
    (whose ``model`` names the version served by vLLM). ``components``, when given, receives the mean of each of the
    reward function's components (e.g. the tool task's success and tool-call parse rate).

    The workflow gets a plain (not recorded) OpenAI client, so evaluation traffic never reaches training.
    """
    from openai import AsyncOpenAI

    from rlstream.rollout.runner import score

    check_workflow(workflow)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", timeout=60.0)
    try:
        async def one(example: dict[str, Any]) -> tuple[float, dict[str, float]]:
            output = await workflow(example, client, sampling)
            return score(reward_fn(example, output))

        scored = await asyncio.gather(*(one(e) for e in examples for _ in range(samples)))
    finally:
        await client.close()
    scores = [reward for reward, _ in scored]
    if components is not None and scored:
        names = {name for _, parts in scored for name in parts}
        components.update({name: sum(parts.get(name, 0.0) for _, parts in scored) / len(scored) for name in names})
    return (sum(scores) / len(scores) if scores else 0.0), len(scores)


# --- live figures --------------------------------------------------------------------------------------
@dataclass
class PromotionFigures:
    """The promotion gate's decisions (``promotions``), the serving pointer and the feedback-to-serving figures."""

    gate: bool = False
    serving: int | None = None
    canary: int | None = None
    canary_share: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)  # decision -> how many
    last: tuple[str, int, str] | None = None  # (decision, version, reason)
    marks: list[tuple[str, int]] = field(default_factory=list)  # (decision, version) of every decision
    feedback_to_serving_p50_s: float | None = None
    feedback_to_serving_p90_s: float | None = None
    feedback_waiting: int | None = None  # trained trajectories whose version does not serve yet

    def summary(self) -> dict[str, Any]:
        """The ``promotion`` section of summary.json."""
        c = self.counts
        return {"gate": self.gate, "serving_version": self.serving,
                "promoted": c.get("promote", 0) + c.get("finish_canary", 0) + c.get("force_promote", 0),
                "rejected": c.get("reject", 0), "rolled_back": c.get("rollback", 0), "canaries": c.get("canary", 0),
                "last_decision": ({"decision": self.last[0], "version": self.last[1], "reason": self.last[2]}
                                  if self.last else None),
                "feedback_to_serving_s": {"p50": self.feedback_to_serving_p50_s,
                                          "p90": self.feedback_to_serving_p90_s},
                "trained_not_serving": self.feedback_waiting}


@dataclass
class LiveFigures:
    """What the live view shows, refreshed from Kafka and Redis."""

    started: float = field(default_factory=time.monotonic)
    latest_version: int = -1
    latest_published_at: float | None = None
    loaded: dict[str, str] = field(default_factory=dict)
    groups_seen: int = 0
    group_reward_by_version: dict[int, list[float]] = field(default_factory=dict)
    newest_group_version: int | None = None
    filtered: dict[str, float] = field(default_factory=dict)
    dlq_count: int = 0
    lags: dict[str, int] = field(default_factory=dict)
    heldout: list[VersionScore] = field(default_factory=list)
    group_times: list[float] = field(default_factory=list)
    baseline_groups: int = 0  # single responses scored against a keyed baseline (production traffic)
    users: dict[str, str] = field(default_factory=dict)  # the simulated users' figures (production traffic)
    constant_answer: tuple[str, float] | None = None  # the toy task's best instruction-blind answer and its reward
    task_baselines: dict[str, float] = field(default_factory=dict)  # what a task's no-skill answers earn (tool task)
    promotion: PromotionFigures = field(default_factory=lambda: PromotionFigures())

    def groups_per_s(self, window_s: float = 30.0) -> float:
        now = time.monotonic()
        recent = [t for t in self.group_times if now - t <= window_s]
        return len(recent) / min(window_s, max(1e-9, now - self.started))

    def policy_lag(self) -> int | None:
        if self.newest_group_version is None or self.latest_version < 0:
            return None
        return self.latest_version - self.newest_group_version


def render(figures: LiveFigures, run_id: str, duration_s: float | None) -> Any:
    from rich.table import Table

    elapsed = time.monotonic() - figures.started
    title = f"rlstream up — run {run_id} — {elapsed:.0f}s" + (f" / {duration_s:.0f}s" if duration_s else "")
    table = Table(title=title, show_header=True)
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    age = f"{time.time() - figures.latest_published_at:.0f}s ago" if figures.latest_published_at else "-"
    table.add_row("policy version (published)", f"{figures.latest_version if figures.latest_version >= 0 else '-'} ({age})")
    table.add_row("loaded in vLLM", ", ".join(f"{w}: v{v}" for w, v in figures.loaded.items()) or "-")
    p = figures.promotion
    if p.gate:
        candidate = figures.latest_version if figures.latest_version >= 0 else "-"
        table.add_row("serving / candidate", f"v{p.serving if p.serving is not None else '-'} / v{candidate}"
                      + (f"  (canary v{p.canary} on {p.canary_share:.0%} of new sessions)" if p.canary else ""))
        last = f"{p.last[0]} v{p.last[1]}: {p.last[2]}" if p.last else "-"
        table.add_row("last gate decision", last)
        table.add_row("gate decisions", ", ".join(f"{k} {v}" for k, v in sorted(p.counts.items())) or "-")
        p50, p90 = p.feedback_to_serving_p50_s, p.feedback_to_serving_p90_s
        table.add_row("feedback to serving", "-" if p50 is None else
                      f"p50 {p50:.1f}s" + (f", p90 {p90:.1f}s" if p90 is not None else "")
                      + (f"; {p.feedback_waiting} trained, not serving yet" if p.feedback_waiting else ""))
    heldout = "  ".join(f"v{s.version}: {s.reward_mean:.2f}" for s in figures.heldout[-8:])
    table.add_row("held-out reward per version", heldout or "-")
    for name, label, form in HELDOUT_COMPONENT_ROWS:
        if any(name in s.components for s in figures.heldout):
            table.add_row(f"held-out {label} per version", "  ".join(
                f"v{s.version}: {s.components[name]:{form}}" for s in figures.heldout[-8:] if name in s.components))
    if figures.task_baselines:
        table.add_row("without the tool (held-out)", ", ".join(f"{k} {v:.2f}" for k, v in figures.task_baselines.items()))
    if figures.constant_answer is not None:
        answer, reward = figures.constant_answer
        table.add_row("best constant answer (format only)", f"{answer!r} for every prompt earns {reward:.2f}")
    train = "  ".join(f"v{v}: {sum(r) / len(r):.2f}" for v, r in sorted(figures.group_reward_by_version.items())[-8:])
    table.add_row("training reward per version", train or "-")
    table.add_row("groups", f"{figures.groups_seen} ({figures.groups_per_s():.2f}/s)"
                  + (f", {figures.baseline_groups} single responses vs. baseline" if figures.baseline_groups else ""))
    if figures.users:
        u = figures.users
        table.add_row("users (production traffic)", f"requests {u.get('users_requests', '0')}, streamed "
                      f"{u.get('users_streamed', '0')}, langchain {u.get('users_langchain', '0')}, feedback sent "
                      f"{u.get('users_feedback_sent', '0')}")
    table.add_row("groups filtered", ", ".join(f"{k}: {v:.0f}" for k, v in sorted(figures.filtered.items())) or "0")
    table.add_row("dlq", str(figures.dlq_count))
    lag = figures.policy_lag()
    table.add_row("policy lag (versions)", "-" if lag is None else str(lag))
    table.add_row("consumer lag", ", ".join(f"{k}: {v}" for k, v in sorted(figures.lags.items())) or "-")
    return table


class Watcher:
    """Feeds :class:`LiveFigures` from the groups, metrics and dlq topics and from Redis."""

    def __init__(self, cfg: RlstreamConfig, control: ControlPlane, figures: LiveFigures) -> None:
        self.cfg, self.control, self.figures = cfg, control, figures
        self._filtered_totals: dict[tuple[str, str], float] = {}  # (worker, reason) -> that worker's running total

    async def follow_topics(self, stop: asyncio.Event) -> None:
        from rlstream.transport.kafka import make_consumer
        from rlstream.transport.topic_reader import SourceRecord, TopicReader, fetch_batch
        from rlstream.schemas.codec import codec_for
        from rlstream.schemas.models import DeadLetter, MetricEvent, PromotionDecision, TrajectoryGroup

        def undecodable(source: SourceRecord, reason: BaseException | str) -> None:
            log.warning("undecodable record in live view", topic=source.topic, error=str(reason))

        names = TopicNames.from_config(self.cfg.topics)
        codec = codec_for(self.cfg, max_bytes=self.cfg.kafka.max_message_bytes * 4)
        consumer = make_consumer(self.cfg.kafka, names.groups, names.metrics, names.dlq, names.promotions,
                                 group_id=None, isolation_level="read_committed")
        # one consumer, one typed reader per topic; the live view only looks, so nothing is dead-lettered
        groups = TopicReader(consumer, codec, TrajectoryGroup, on_reject=undecodable)
        metrics = TopicReader(consumer, codec, MetricEvent, on_reject=undecodable)
        letters = TopicReader(consumer, codec, DeadLetter, on_reject=undecodable)
        decisions = TopicReader(consumer, codec, PromotionDecision, on_reject=undecodable)
        await consumer.start()
        try:
            while not stop.is_set():
                for record in await fetch_batch(consumer, timeout_ms=500, max_records=500):
                    if record.topic == names.groups:
                        if group := await groups.decode(record):
                            self._on_group(group.event)
                    elif record.topic == names.metrics:
                        if metric := await metrics.decode(record):
                            self._on_metric(metric.event)
                    elif record.topic == names.promotions:
                        if decision := await decisions.decode(record):
                            self._on_decision(decision.event)
                    elif await letters.decode(record):
                        self.figures.dlq_count += 1
        finally:
            await consumer.stop()

    def _on_group(self, group: Any) -> None:
        if group.run_id != self.cfg.run_id:
            return
        self.figures.groups_seen += 1
        self.figures.group_times.append(time.monotonic())
        if getattr(group, "baseline", None) is not None:
            self.figures.baseline_groups += 1
        rewards = [t.reward for t in group.trajectories if t.reward is not None]
        if rewards:
            self.figures.group_reward_by_version.setdefault(group.max_policy_version, []).append(
                sum(rewards) / len(rewards))
        self.figures.newest_group_version = max(self.figures.newest_group_version or 0, group.max_policy_version)

    def _on_decision(self, event: Any) -> None:
        if event.policy != self.cfg.policy:
            return
        p = self.figures.promotion
        kind = event.decision.value
        p.counts[kind] = p.counts.get(kind, 0) + 1
        p.last = (kind, event.version, event.reason)
        p.marks.append((kind, int(event.candidate_metrics.get("canary_version", event.version))))

    def _on_metric(self, event: Any) -> None:
        if event.run_id != self.cfg.run_id:
            return
        if event.name == mn.GATE_FEEDBACK_TO_SERVING_P50_S:
            self.figures.promotion.feedback_to_serving_p50_s = event.value
        elif event.name == mn.GATE_FEEDBACK_TO_SERVING_P90_S:
            self.figures.promotion.feedback_to_serving_p90_s = event.value
        elif event.name == mn.GATE_FEEDBACK_WAITING:
            self.figures.promotion.feedback_waiting = int(event.value)
        if event.name != mn.STREAMS_GROUPS_FILTERED:
            return
        # every streams worker reports its own count since start: keep each worker's latest, sum per reason
        worker, reason = event.tags.get("worker", event.source), event.tags.get("reason", "unknown")
        self._filtered_totals[(worker, reason)] = event.value
        totals: dict[str, float] = {}
        for (_, why), value in self._filtered_totals.items():
            totals[why] = totals.get(why, 0.0) + value
        self.figures.filtered = totals

    async def refresh_control(self) -> None:
        """Read the latest version, what each inference worker has loaded and the run's status from Redis."""
        latest = await self.control.latest(self.cfg.policy)
        if latest:
            self.figures.latest_version = int(latest["version"])
            self.figures.latest_published_at = float(latest.get("published_at", 0) or 0) or None
        workers = await self.control.workers(self.cfg.policy)
        self.figures.loaded = {w: info.get("version", "?") for w, info in workers.items()}
        from rlstream.transport.serving import ServingControl

        pointer = await ServingControl(self.control).serving(self.cfg.policy)
        if pointer is not None:
            p = self.figures.promotion
            p.serving, p.canary, p.canary_share = pointer.version, pointer.canary_version, pointer.canary_share
        status = await self.control.status(self.cfg.run_id)
        self.figures.users = {k: v for k, v in status.items() if k.startswith("users_")}

    async def poll_control(self, stop: asyncio.Event) -> None:
        from rlstream.ops.status import consumer_group_lags

        while not stop.is_set():
            try:
                await self.refresh_control()
                lags = await consumer_group_lags(self.cfg.kafka, prefix=self.cfg.topics.prefix)
                self.figures.lags = {f"{g.group}/{g.topic.removeprefix(self.cfg.topics.prefix)}": g.lag for g in lags}
            except Exception as exc:  # the view must not die with a transient error
                log.warning("live view refresh failed", error=str(exc))
            await _sleep_or_stop(stop, 2.0)


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass


async def evaluate_versions(cfg: RlstreamConfig, control: ControlPlane, figures: LiveFigures, base_url: str,
                            heldout: list[dict[str, Any]], samples: int, stop: asyncio.Event, on_score: Any) -> None:
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
        """The newest version a replica acknowledged, by its own name: candidates too, not only the serving one."""
        loaded = [(v, name or cfg.rollout.model) for r in await serving.replicas(cfg.policy)
                  for v, name in r.loaded.items()]
        return Route(max(loaded)[1], max(loaded)[0]) if loaded else None

    sampling = SamplingSettings.from_config(cfg.rollout)
    done: set[int] = set()
    while not stop.is_set():
        route = await newest_loaded()
        if route is not None and route.version not in done:
            done.add(route.version)
            parts: dict[str, float] = {}
            try:
                mean, n = await evaluate_heldout(base_url, heldout, workflow, reward_fn, samples,
                                                 sampling.with_model(route.model),
                                                 api_key=secret_value(cfg.inference.api_key), components=parts)
            except Exception as exc:
                log.warning("held-out evaluation failed", version=route.version, model=route.model, error=str(exc))
                done.discard(route.version)
            else:
                score = VersionScore(route.version, route.model, mean, n, time.time(), parts)
                figures.heldout.append(score)
                await on_score(score)
        await _sleep_or_stop(stop, 1.0)


# --- outputs ---------------------------------------------------------------------------------------------
def write_plot(figures: LiveFigures, out: Path, run_id: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if figures.heldout:
        ax.plot([s.version for s in figures.heldout], [s.reward_mean for s in figures.heldout], "o-",
                label="held-out reward (vLLM, loaded version)")
    train = sorted(figures.group_reward_by_version.items())
    if train:
        ax.plot([v for v, _ in train], [sum(r) / len(r) for _, r in train], "s--", alpha=0.7,
                label="training reward (groups by policy version)")
    if figures.constant_answer is not None:
        answer, reward = figures.constant_answer
        ax.axhline(reward, color="grey", linestyle=":", label=f"best constant answer {answer!r} (format only)")
    _plot_components(ax, figures)
    marks = {"promote": ("tab:green", "promoted"), "finish_canary": ("tab:green", "promoted"),
             "force_promote": ("tab:green", "promoted"), "rollback": ("tab:red", "rolled back")}
    labelled: set[str] = set()
    for kind, version in figures.promotion.marks:
        if kind in marks:
            color, label = marks[kind]
            ax.axvline(version, color=color, alpha=0.35, linewidth=1,
                       label=None if label in labelled else f"{label} (gate)")
            labelled.add(label)
    ax.set_xlabel("policy version")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"rlstream up — {run_id}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_components(ax: Any, figures: LiveFigures) -> None:
    """The held-out reward components per version (task success, tool-call parse rate; answer length on a second
    axis) and what the task's no-skill answers earn, where the task reports them."""
    styles = {"success": ("tab:green", "held-out task success"),
              "tool_call_parsed": ("tab:purple", "held-out tool-call parse rate")}
    for name, (color, label) in styles.items():
        points = [(s.version, s.components[name]) for s in figures.heldout if name in s.components]
        if points:
            ax.plot([v for v, _ in points], [c for _, c in points], "^-", color=color, alpha=0.8, label=label)
    for (name, value), style in zip(figures.task_baselines.items(), (":", "-.", "--")):
        ax.axhline(value, color="grey", linestyle=style, alpha=0.8, label=f"{name} (held-out)")
    words = [(s.version, s.components["answer_words"]) for s in figures.heldout if "answer_words" in s.components]
    if words:
        twin = ax.twinx()
        twin.plot([v for v, _ in words], [w for _, w in words], "x:", color="tab:brown", alpha=0.6)
        twin.set_ylabel("held-out answer length (words, x)", color="tab:brown")
        twin.set_ylim(0, max(w for _, w in words) * 1.2 + 1)


def summarize(figures: LiveFigures, run_id: str, run_dir: Path, config_path: Path, plot: Path | None,
              topic_ends: dict[str, int] | None = None) -> dict[str, Any]:
    scores = figures.heldout
    first = scores[0].reward_mean if scores else None
    best_last = scores[-1].reward_mean if scores else None
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "config": str(config_path),
        "plot": str(plot) if plot else None,
        "latest_version": figures.latest_version,
        "loaded": figures.loaded,
        "groups": figures.groups_seen,
        "baseline_groups": figures.baseline_groups,
        "users": figures.users,
        "dlq": figures.dlq_count,
        "filtered": figures.filtered,
        "heldout": [{"version": s.version, "model": s.model, "reward_mean": s.reward_mean, "samples": s.samples,
                     **({"components": s.components} if s.components else {})} for s in scores],
        "heldout_first": first,
        "heldout_last": best_last,
        "heldout_gain": (best_last - first) if scores else None,
        "heldout_components_first": scores[0].components if scores else None,
        "heldout_components_last": scores[-1].components if scores else None,
        "task_baselines": figures.task_baselines,
        "best_constant_answer": ({"answer": figures.constant_answer[0], "reward_mean": figures.constant_answer[1]}
                                 if figures.constant_answer is not None else None),
        "training_reward_by_version": {str(v): sum(r) / len(r) for v, r in sorted(figures.group_reward_by_version.items())},
        "promotion": figures.promotion.summary(),
        "topic_end_offsets": topic_ends or {},
        "checkpoints": str(run_dir / "learner"),
        "logs": str(run_dir / "logs"),
    }


# --- main ------------------------------------------------------------------------------------------------
async def _supervise(cfg: RlstreamConfig, opts: UpOptions, sup: Supervisor, vllm_url: str,
                     heldout: list[dict[str, Any]], figures: LiveFigures) -> None:
    from rich.console import Console
    from rich.live import Live

    from rlstream.transport.kafka import make_producer
    from rlstream.transport.metrics import MetricsPublisher
    from rlstream.schemas.codec import codec_for

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    control = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
    producer = make_producer(cfg.kafka)
    await producer.start()
    metrics = MetricsPublisher(producer, codec_for(cfg), TopicNames.from_config(cfg.topics).metrics, source="up",
                               run_id=cfg.run_id)

    async def on_score(score: VersionScore) -> None:
        log.info("held-out reward", version=score.version, reward_mean=round(score.reward_mean, 3))
        await metrics.emit(mn.VALIDATION_REWARD_MEAN, score.reward_mean, step=score.version,
                           tags={mn.STEP_TAG: mn.STEP_VERSION})

    watcher = Watcher(cfg, control, figures)
    tasks = [
        asyncio.create_task(watcher.follow_topics(stop)),
        asyncio.create_task(watcher.poll_control(stop)),
    ]
    if heldout:
        tasks.append(asyncio.create_task(evaluate_versions(cfg, control, figures, f"{vllm_url}/v1", heldout,
                                                           opts.eval_samples, stop, on_score)))
    else:
        log.warning("no held-out examples (set finetuning.validation_dataset): versions are not evaluated")
    figures.started = time.monotonic()  # the clock of the live view starts with the services
    deadline = figures.started + opts.duration_s if opts.duration_s else None
    console = Console()
    try:
        with Live(render(figures, cfg.run_id, opts.duration_s), console=console, refresh_per_second=1,
                  transient=False, auto_refresh=opts.live) as live:
            while not stop.is_set():
                if deadline and time.monotonic() >= deadline:
                    break
                if opts.until_version is not None and any(s.version >= opts.until_version for s in figures.heldout):
                    log.info("held-out score of the requested version recorded; stopping", version=opts.until_version)
                    break
                dead = sup.dead()
                if dead:
                    names = ", ".join(f"{c.name} (exit {c.proc.returncode}, log {c.log_file})" for c in dead)
                    log.error("a service stopped; shutting down", services=names)
                    break
                live.update(render(figures, cfg.run_id, opts.duration_s))
                await _sleep_or_stop(stop, 1.0)
            live.update(render(figures, cfg.run_id, opts.duration_s))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:  # the summary shows the end of the run, not the last poll (a version loaded since would be missing)
            await watcher.refresh_control()
        except Exception as exc:
            log.warning("final control-plane read failed; the summary shows the last poll", error=str(exc))
        await producer.stop()
        await control.close()


def run_up(opts: UpOptions) -> dict[str, Any]:
    """Run the whole system until ``duration_s``, ``until_version`` (scored) or Ctrl-C, whichever comes first;
    returns the summary written to disk."""
    from rlstream.ops.vllm import ensure_vllm_venv, start_vllm_server

    user_cfg = load_config(opts.config, opts.overrides) if opts.config else None  # fail before starting anything
    run_id = f"up-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = (opts.runs_dir / run_id).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # SIGTERM/SIGHUP stop the run as Ctrl-C does; every child dies with this process even when it is SIGKILLed
    signals = terminate_as_interrupt()
    signals.install()
    stack = LocalStack.start(run_dir / "infra")
    sup = Supervisor(run_dir / "logs")
    figures = LiveFigures()
    cfg: RlstreamConfig | None = None
    config_path = run_dir / "config.yaml"
    try:
        model_dir, dataset, heldout = _task(opts, run_dir, user_cfg)
        print(f"run {run_id}: data in {run_dir}", flush=True)
        print("preparing vLLM (its own virtualenv; the first run installs it, ~3-5 min)…", flush=True)
        ensure_vllm_venv(None, log_file=run_dir / "logs" / "vllm-install.log")
        served = user_cfg.inference.served_model if user_cfg else TOY_DEFAULTS["inference"]["served_model"]
        # vLLM wants a key (its --api-key): the inference settings' own, else a fresh one; every service gets it
        # through the environment (secret_env), never in a file or on a command line
        wanted = (user_cfg or RlstreamConfig()).inference.api_key
        vllm_key = wanted.get_secret_value() if wanted is not None else f"vllm-{secrets.token_urlsafe(32)}"
        remember_secret(vllm_key)
        vllm = start_vllm_server(model_dir, served_model_name=served, workdir=run_dir / "vllm", api_key=vllm_key,
                                 extra_args=_task_vllm_args(opts, run_dir))
        sup.extra_pids["vllm"] = vllm.pid
        cfg, config_path = compose_config(opts, run_id, run_dir, stack, None if user_cfg else model_dir,
                                          vllm.url, dataset, vllm_api_key=vllm_key)
        sup.env.update(secret_env(cfg))
        if user_cfg is None and heldout and opts.task == "tool-agent":  # what no tool use earns on the same prompts
            from rlstream.ops.tool_task import baseline_scores

            figures.task_baselines = baseline_scores(heldout).figures()
        elif user_cfg is None and heldout:  # the toy task: what ignoring the instruction earns on the same prompts
            from rlstream.ops.toy import best_constant_answer
            from rlstream.rollout.loading import load_callable

            figures.constant_answer = best_constant_answer(heldout, load_callable(cfg.rollout.reward_function))
        asyncio.run(create_topics(cfg.kafka, cfg.topics))
        c = ["-c", str(config_path)]
        sup.spawn("streams", rlstream_command("streams", "worker", *c))
        sup.spawn("learner", rlstream_command("learner", "run", *c))
        sup.spawn("inference-sync", rlstream_command("inference", "sync", "--backend", "vllm", "--url", vllm.url, *c))
        if opts.gate and heldout:  # the gate evaluates every candidate on the held-out prompts before it serves
            heldout_file = run_dir / "heldout.jsonl"
            heldout_file.write_text("".join(json.dumps(e) + "\n" for e in heldout))
            gate_dataset = [] if cfg.gate.dataset else ["-o", "gate.dataset", str(heldout_file)]
            sup.spawn("gate", rlstream_command("gate", *c, *gate_dataset, "-o", "gate.samples", str(opts.gate_samples),
                                               "-o", "gate.examples", str(len(heldout))))
            figures.promotion.gate = True
        elif opts.gate:
            log.warning("no held-out examples (set finetuning.validation_dataset or gate.dataset): the promotion "
                        "gate is off and every loaded version serves")
        if opts.traffic == "production":
            gateway_port = free_port()
            api_key = f"rls-{secrets.token_urlsafe(32)}"  # the gateway's client key, through the environment only
            remember_secret(api_key)
            sup.env.update({API_KEYS_ENV: api_key, USERS_API_KEY_ENV: api_key})
            print(f"gateway http://127.0.0.1:{gateway_port} (OpenAI-compatible; send Authorization: Bearer {api_key})",
                  flush=True)
            sup.spawn("gateway", rlstream_command("gateway", "serve", *c, "--upstream", vllm.url, "--port",
                                                  str(gateway_port), "--served-model", cfg.rollout.model,
                                                  "--session-idle-s", "30", "--spool-dir", str(run_dir / "spool")))
            low, high = opts.feedback_delay_s
            sup.spawn("users", rlstream_command("rollout", "users", *c, "--gateway", f"http://127.0.0.1:{gateway_port}",
                                                "--task", opts.task, "--feedback-min-s", str(low), "--feedback-max-s",
                                                str(high), *_task_users_args(opts)))
        else:
            sup.spawn("rollout", rlstream_command("rollout", "run", *c))
        try:
            asyncio.run(_supervise(cfg, opts, sup, vllm.url, heldout, figures))
        except KeyboardInterrupt:
            pass
        signals.install()  # asyncio.run reset SIGTERM to its default
    except KeyboardInterrupt:
        log.warning("interrupted; stopping the services")
    finally:
        sup.stop_all()
        topic_ends = _topic_end_offsets(cfg) if cfg is not None else {}
        stack.stop()
        plot = None
        try:
            plot = write_plot(figures, run_dir / "reward_per_version.png", run_id)
        except Exception as exc:
            log.warning("plot not written", error=str(exc))
        summary = summarize(figures, run_id, run_dir, config_path, plot, topic_ends)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"\nrun data and checkpoints: {run_dir}")
        print(f"plot:    {plot}")
        print(f"summary: {run_dir / 'summary.json'}")
        signals.restore()
    return summary


def _topic_end_offsets(cfg: RlstreamConfig) -> dict[str, int]:
    """What the run wrote to each topic, read before the broker stops (empty when it cannot be read)."""
    from rlstream.ops.status import topic_end_offsets

    try:
        return asyncio.run(topic_end_offsets(cfg.kafka, TopicNames.from_config(cfg.topics)))
    except Exception as exc:  # the summary must be written even when the broker is gone
        log.warning("topic offsets not read", error=str(exc))
        return {}


def _task(opts: UpOptions, run_dir: Path, user_cfg: RlstreamConfig | None) -> tuple[Path, Path | None, list[dict[str, Any]]]:
    """Model directory, training dataset file (None: the user's config names it) and held-out examples.

    The toy task is built here; a user config brings ``learner.model`` and, for held-out evaluation,
    ``finetuning.validation_dataset``.
    """
    from rlstream.rollout.loading import load_examples

    if user_cfg is not None:
        if not user_cfg.learner.model:
            raise ConfigError("learner.model: with --config, name a local transformers model directory "
                              "(untied embeddings) for vLLM and the learner")
        path = user_cfg.finetuning.validation_dataset
        heldout = load_examples(path)[: opts.heldout_examples] if path else []
        return Path(user_cfg.learner.model), None, heldout
    from rlstream.ops.toy import COPY_PRETRAIN_STEPS, build_tiny_model, smollm2_model_dir, toy_dataset

    models = (opts.runs_dir / "models").resolve()
    if opts.model == "smollm2":
        model_dir = smollm2_model_dir(models / "smollm2")
    elif opts.model != "tiny":  # a local transformers directory (untied embeddings)
        model_dir = Path(opts.model).resolve()
        if not (model_dir / "config.json").exists():
            raise ConfigError(f"--model {opts.model}: not a transformers model directory (no config.json)")
    elif opts.task == "tool-agent":
        raise ConfigError("--task tool-agent needs a pretrained instruct model: --model smollm2 or a local directory")
    else:  # a random tiny model given a generic copy skill first (rlstream/ops/toy.py), never the task's answers
        model_dir = build_tiny_model(models / "tiny", pretrain_steps=COPY_PRETRAIN_STEPS)
    if opts.task == "tool-agent":
        from rlstream.ops.tool_task import TRAIN_EXAMPLES, tool_dataset

        dataset = run_dir / "train.jsonl"
        dataset.write_text("".join(json.dumps(e) + "\n" for e in tool_dataset(TRAIN_EXAMPLES, "train")))
        return model_dir, dataset, tool_dataset(opts.heldout_examples, "heldout", seed=HELDOUT_SEED)
    dataset = run_dir / "train.jsonl"
    dataset.write_text("".join(json.dumps(e) + "\n" for e in toy_dataset(64, seed=0)))
    return model_dir, dataset, toy_dataset(opts.heldout_examples, seed=HELDOUT_SEED)


def _task_vllm_args(opts: UpOptions, run_dir: Path) -> list[str]:
    """vLLM options the task needs: the tool task's chat template and tool-call parser."""
    if opts.config is not None or opts.task != "tool-agent":
        return []
    from rlstream.ops.tool_task import CHAT_TEMPLATE, TOOL_CALL_PARSER

    template = run_dir / "tool_chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    return ["--chat-template", str(template), "--tool-call-parser", TOOL_CALL_PARSER]


def _task_users_args(opts: UpOptions) -> list[str]:
    """``rlstream rollout users`` options the task needs: the tool task's users run its agent."""
    return ["--agent", "rlstream.ops.tool_task:tool_agent"] if opts.task == "tool-agent" else []
