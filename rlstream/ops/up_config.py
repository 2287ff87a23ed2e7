"""What ``rlstream up`` was asked for (:class:`UpOptions`) and what it runs on: the task (model, training and
held-out examples, the task's vLLM and users options) and the run's effective config (task defaults < user file <
environment < overrides)."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from rlstream.ops.infra import LocalStack
from rlstream.ops.vllm import ModelTokenizer
from rlstream.schemas.config import (ConfigError, RlstreamConfig, format_validation_error, overrides_to_dict,
                                     read_yaml)
from rlstream.schemas.masking import REVEAL, public_config_text

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
#: streams.max_policy_lag 4: bench/staleness.py (bench/results/2026-11-27-staleness.md) with the default learner
#: (learner.num_iterations 3, truncate, cap 2) keeps the goal (area >= 0.95 and gain >= 0.90 of on-policy on every
#: seed) at lags 2, 4 and 8 over 40 steps (lag 4: 0.963-0.979 / 0.940-0.965), but over the first 20 steps, before the
#: toy task nears its ceiling, lag 4 is at the line (0.943-0.985 / 0.893-0.971) and lag 8 short of it (0.913-0.940
#: / 0.830-0.886); at one optimizer step per batch no lag keeps it and lag 8 is the lowest. So 4, not 8: feedback
#: older than 4 versions is filtered rather than trained.
#: gate.canary_share 0.5: the canary's sequential test needs gate.canary_min_samples (50) rewards per arm, and one
#: engine's simulated users (8, 70 % of sessions rewarded) give on the order of 10 rewarded sessions a minute on two
#: cores: at the config's share (0.2) one canary would need about 25 minutes of traffic, at 0.5 about 10.
PRODUCTION_TRAFFIC_DEFAULTS: dict[str, Any] = {"learner": {"groups_per_step": 32}, "streams": {"max_policy_lag": 4},
                                               "gate": {"canary_share": 0.5}}
HELDOUT_SEED = 1_000


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
    users: int = 8  # production traffic: simultaneous simulated users
    gate: bool = True  # the promotion gate decides which version serves (rlstream gate, docs/gate.md)
    task: str = "toy"  # toy | tool-agent (rlstream/ops/tool_task.py)
    # completions per held-out prompt for the gate: few enough that it decides before the next candidate replaces a
    # full-weights server's version (the prompts and seeds are the same for every version)
    gate_samples: int = 2
    tool_call_parser: str = "auto"  # vLLM's tool-call parser (rlstream.ops.vllm.tool_call_args): auto | none | NAME
    dry_run: bool = False  # write every process's config and print the plan; start nothing


@dataclass(frozen=True)
class StackAddresses:
    """Where the run's broker and Redis are (a started :class:`LocalStack`, or the addresses a dry run plans)."""

    bootstrap: str
    redis_url: str


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, merging nested mappings key by key."""
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def compose_config(opts: UpOptions, run_id: str, run_dir: Path, stack: LocalStack | StackAddresses,
                   model_dir: Path | None,
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


def process_config(cfg: RlstreamConfig, name: str, overrides: Sequence[tuple[str, str]], config_dir: Path) -> Path:
    """Write the resolved config of one process of the run (the run's config with this process's overrides) to
    ``config_dir/NAME.yaml`` without its secrets (the process gets them through the environment); returns the path."""
    merged = deep_merge(cfg.model_dump(mode="json", context=REVEAL), overrides_to_dict(list(overrides)))
    try:
        resolved = RlstreamConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, None, {})) from None
    config_dir.mkdir(parents=True, exist_ok=True)
    path = config_dir / f"{name}.yaml"
    path.write_text(public_config_text(resolved))
    return path


def task_inputs(opts: UpOptions, run_dir: Path, user_cfg: RlstreamConfig | None,
                build_model: bool = True) -> tuple[Path, Path | None, list[dict[str, Any]]]:
    """Model directory, training dataset file (None: the user's config names it) and held-out examples.

    The toy task is built here; a user config brings ``learner.model`` and, for held-out evaluation,
    ``finetuning.validation_dataset``. ``build_model`` False (a dry run): a toy model's directory is where it would
    be built, not built (see :func:`toy_model_tokenizer`).
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
    if opts.model == "tiny" and opts.task == "tool-agent":
        raise ConfigError("--task tool-agent needs a pretrained instruct model: --model smollm2 or a local directory")
    if opts.model in TOY_MODELS and not build_model:
        model_dir = models / opts.model
    elif opts.model == "smollm2":
        model_dir = smollm2_model_dir(models / "smollm2")
    elif opts.model != "tiny":  # a local transformers directory (untied embeddings)
        model_dir = Path(opts.model).resolve()
        if not (model_dir / "config.json").exists():
            raise ConfigError(f"--model {opts.model}: not a transformers model directory (no config.json)")
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


#: the models ``rlstream up`` builds itself (``--model``), in ``RUNS_DIR/models/NAME``
TOY_MODELS = ("tiny", "smollm2")
#: the tiny model's tokenizer: :func:`rlstream.ops.toy.build_tiny_model`'s vocabulary size and seed
TINY_VOCAB_SIZE, TINY_SEED = 1024, 0


@functools.cache
def toy_model_tokenizer(model: str) -> ModelTokenizer:
    """What the tool-call parser check reads of a toy model before it is built (a dry run builds nothing): the
    tokenizer, family and chat template it will have, read from its source in seconds: SmolLM2's packaged GGUF, or
    the tiny model's tokenizer (trained as :func:`rlstream.ops.toy.build_tiny_model` trains it; a Qwen2)."""
    if model == "smollm2":
        from gguf import GGUFReader

        from rlstream.ops.toy import smollm2_gguf

        gguf = smollm2_gguf()
        fields = GGUFReader(str(gguf)).fields

        def text(name: str) -> str:
            field = fields[name]
            return bytes(field.parts[field.data[0]]).decode()

        tokens = fields["tokenizer.ggml.tokens"]
        return ModelTokenizer(source=str(gguf), model_type=text("general.architecture"),
                              chat_template=text("tokenizer.chat_template") if "tokenizer.chat_template" in fields
                              else None,
                              tokens=frozenset(bytes(tokens.parts[i]).decode() for i in tokens.data))
    from transformers import Qwen2Config

    from rlstream.ops.toy import _build_tokenizer

    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE, TINY_SEED)
    return ModelTokenizer(source="the tiny model's tokenizer", model_type=Qwen2Config.model_type,
                          chat_template=tokenizer.chat_template, tokens=frozenset(tokenizer.get_vocab()))


def task_vllm_args(opts: UpOptions, run_dir: Path) -> list[str]:
    """vLLM options the task needs: the tool task's chat template and tool-call parser."""
    if opts.config is not None or opts.task != "tool-agent":
        return []
    from rlstream.ops.tool_task import CHAT_TEMPLATE, TOOL_CALL_PARSER

    template = run_dir / "tool_chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    return ["--chat-template", str(template), "--tool-call-parser", TOOL_CALL_PARSER]


def task_users_args(opts: UpOptions) -> list[str]:
    """``rlstream rollout users`` options the task needs: the tool task's users run its agent."""
    return ["--agent", "rlstream.ops.tool_task:tool_agent"] if opts.task == "tool-agent" else []
