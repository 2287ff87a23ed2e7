"""Every metric name rlstream emits, in one place.

Producers (streams, learner, inference, rollout, finetune, ``rlstream up``, ``rlstream replay``) emit
these constants through :class:`~rlstream.transport.metrics.MetricsPublisher` (never a string written
at the emit site: ``tests/unit/test_metric_names.py`` fails on one), and the operator tools
(``rlstream plot``, ``rlstream status``, the live view of ``rlstream up``, dashboards) read them from here.

The ``step`` of a MetricEvent is the x axis: the policy version in an online run, the epoch in
``rlstream finetune``, the learner step for the ``learner/*`` figures. The tag ``STEP_TAG`` says which.
Prometheus sees each name as ``rlstream_<name with / and . replaced by _>`` (a gauge of the last value).
"""
from __future__ import annotations

#: Tag naming the meaning of ``step``: ``"version"`` (online), ``"epoch"`` (finetune) or ``"step"`` (learner step).
STEP_TAG = "step_kind"
STEP_VERSION = "version"
STEP_EPOCH = "epoch"
STEP_LEARNER = "step"

# --- read by the operator tools ---------------------------------------------------------------------------
#: Mean reward of the trajectories trained on (or generated) at this step, before filters.
REWARD_MEAN = "reward_mean"
#: Mean reward of the groups kept after the filters (staleness, zero variance, curriculum).
REWARD_MEAN_FILTERED = "reward_mean_filtered"
#: Mean reward of one validation pass (finetune: every ``validation_interval`` epochs and after the last;
#: ``rlstream up``: the held-out examples, once per loaded version).
VALIDATION_REWARD_MEAN = "validation/reward_mean"
#: Fraction of groups the curriculum currently accepts, in (0, 1].
CURRICULUM_PERCENTILE = "curriculum/percentile"
#: GRPO loss of one learner step (step = learner step), or of one finetune epoch (step = epoch).
LEARNER_LOSS = "learner/loss"
#: Trajectories re-published by ``rlstream replay`` (source ``replay``).
REPLAY_PUBLISHED = "replay/published"

# --- rollout runner (source ``rollout``) -----------------------------------------------------------------------
#: 1 per trajectory published (tag ``policy_version``).
ROLLOUT_PUBLISHED = "rollout/published"
#: 1 per failed generation (tags ``example_id``, ``error``).
ROLLOUT_GENERATION_FAILED = "rollout/generation_failed"
#: Seconds one admission-control pause lasted.
ROLLOUT_ADMISSION_PAUSED_S = "rollout/admission_paused_s"

# --- inference sync worker (source ``inference:<worker>``; step = policy version) --------------------------------
#: The version just loaded into the server (tags ``worker``, ``kind``).
INFERENCE_LOADED_VERSION = "inference/loaded_version"
#: Seconds the load took (tag ``worker``).
INFERENCE_LOAD_SECONDS = "inference/load_seconds"
#: 1 per version that could not be loaded (tags ``worker``, ``reason``).
INFERENCE_LOAD_FAILED = "inference/load_failed"
#: 1 per PolicyVersion record refused as untrusted and dead-lettered (tags ``worker``, ``reason``: ``uri_outside_roots``,
#: ``file_not_in_manifest``, ``version_jump``, ``stale_fencing_token``); the worker keeps its loaded version.
INFERENCE_VERSION_REFUSED = "inference/version_refused"

# --- learner (source ``learner``; step = learner step, ``STEP_TAG`` = ``STEP_LEARNER``) ---------------------------
#: Groups trained on in the step.
LEARNER_GROUPS = "learner/groups"
#: Policy versions between the learner and the groups it trained on (mean, max over the step's groups).
LEARNER_POLICY_LAG_MEAN = "learner/policy_lag_mean"
LEARNER_POLICY_LAG_MAX = "learner/policy_lag_max"
#: The figures of one optimizer step (``learner.step.StepStats``; ``LEARNER_LOSS`` above is one of them).
LEARNER_KL = "learner/kl"
LEARNER_CLIP_FRACTION = "learner/clip_fraction"
LEARNER_IS_RATIO_MEAN = "learner/is_ratio_mean"
LEARNER_IS_RATIO_MIN = "learner/is_ratio_min"
LEARNER_IS_RATIO_MAX = "learner/is_ratio_max"
LEARNER_REWARD_MEAN = "learner/reward_mean"
LEARNER_REWARD_STD = "learner/reward_std"
LEARNER_ADVANTAGE_MEAN = "learner/advantage_mean"
LEARNER_ADVANTAGE_STD = "learner/advantage_std"
LEARNER_GRAD_NORM = "learner/grad_norm"
LEARNER_LEARNING_RATE = "learner/learning_rate"
LEARNER_TOKENS = "learner/tokens"
LEARNER_SEQUENCES = "learner/sequences"
#: Trajectories in the step (a trajectory of several turns is several sequences).
LEARNER_TRAJECTORIES = "learner/trajectories"
#: Optimizer steps applied in the step (``learner.num_iterations``, fewer after a non-finite one).
LEARNER_OPTIMIZER_STEPS = "learner/optimizer_steps"
#: Optimizer steps skipped because the loss or the gradient was not finite (logged as a warning too).
LEARNER_NONFINITE_SKIPPED = "learner/nonfinite_skipped"
LEARNER_SECONDS = "learner/seconds"
LEARNER_TOKENS_PER_S = "learner/tokens_per_s"
#: Groups consumed but not trained on, totals since the learner started (tag ``reason``: ``other_policy``,
#: ``other_run`` (``learner.run_ids``), ``validation``); never dead-lettered.
LEARNER_GROUPS_SKIPPED = "learner/groups_skipped"
#: Records of ``groups`` the learner dead-lettered (undecodable, or a group no step can use), total since start.
LEARNER_DLQ_TOTAL = "learner/dlq_total"
#: 1 per publication refused (tag ``reason``: ``nonfinite_weights``); the version is neither written nor announced.
LEARNER_PUBLISH_REFUSED = "learner/publish_refused"

# --- stream app (source ``streams:<worker>``, tag ``worker``; counters are totals since the worker started) --------
#: The prefix of every stream-app name. A counter may carry a reason after one more dot
#: (``streams.dlq.bad_key``): the app emits it as ``streams.dlq`` with the tag ``reason``.
STREAMS_PREFIX = "streams."
STREAMS_EVENTS_IN = "streams.events_in"
STREAMS_EVENTS_OUT = "streams.events_out"
STREAMS_EVENTS_IN_PER_S = "streams.events_in_per_s"
STREAMS_EVENTS_OUT_PER_S = "streams.events_out_per_s"
STREAMS_ASSEMBLY_LATENCY_P50_S = "streams.assembly_latency_p50_s"
STREAMS_ASSEMBLY_LATENCY_P99_S = "streams.assembly_latency_p99_s"
#: Records behind the high watermark over the worker's trajectories and rewards partitions.
STREAMS_CONSUMER_LAG = "streams.consumer_lag"
#: Records put off by the progress gate (rebalance, recovery) and records skipped as already applied.
STREAMS_RECORDS_DEFERRED = "streams.records_deferred"
STREAMS_RECORDS_SKIPPED = "streams.records_skipped"
#: Dead letters (tag ``reason``) and their total.
STREAMS_DLQ = "streams.dlq"
STREAMS_DLQ_TOTAL = "streams.dlq_total"
#: Groups emitted (tag ``reason`` = the completion: ``full`` or ``timeout``) and groups filtered (tag ``reason``).
STREAMS_GROUPS_EMITTED = "streams.groups_emitted"
STREAMS_GROUPS_FILTERED = "streams.groups_filtered"
#: The assembler's counters (``streams.assembly.Outcome.counts``).
STREAMS_TRAJECTORIES_ACCEPTED = "streams.trajectories_accepted"
STREAMS_DUPLICATE_TRAJECTORY = "streams.duplicate_trajectory"
STREAMS_DUPLICATE_REWARD = "streams.duplicate_reward"
STREAMS_REWARDS_HELD = "streams.rewards_held"
STREAMS_REWARDS_JOINED = "streams.rewards_joined"
STREAMS_GROUPS_COMPLETED = "streams.groups_completed"
STREAMS_GROUPS_TIMED_OUT = "streams.groups_timed_out"
STREAMS_GROUPS_EXPIRED = "streams.groups_expired"
STREAMS_CLOSED_FORGOTTEN = "streams.closed_forgotten"

# --- groups of names ---------------------------------------------------------------------------------------------
#: The names ``rlstream plot`` draws, in the order of its legend.
PLOTTED = (REWARD_MEAN, REWARD_MEAN_FILTERED, VALIDATION_REWARD_MEAN, CURRICULUM_PERCENTILE)
#: The names the operator tools give a meaning to.
TOOLS = (REWARD_MEAN, REWARD_MEAN_FILTERED, VALIDATION_REWARD_MEAN, CURRICULUM_PERCENTILE, LEARNER_LOSS,
         REPLAY_PUBLISHED)
ROLLOUT = (ROLLOUT_PUBLISHED, ROLLOUT_GENERATION_FAILED, ROLLOUT_ADMISSION_PAUSED_S)
INFERENCE = (INFERENCE_LOADED_VERSION, INFERENCE_LOAD_SECONDS, INFERENCE_LOAD_FAILED, INFERENCE_VERSION_REFUSED)
#: Per learner step: the step's own figures and those of its optimizer step.
LEARNER = (LEARNER_GROUPS, LEARNER_POLICY_LAG_MEAN, LEARNER_POLICY_LAG_MAX, LEARNER_LOSS, LEARNER_KL,
           LEARNER_CLIP_FRACTION, LEARNER_IS_RATIO_MEAN, LEARNER_IS_RATIO_MIN, LEARNER_IS_RATIO_MAX,
           LEARNER_REWARD_MEAN, LEARNER_REWARD_STD, LEARNER_ADVANTAGE_MEAN, LEARNER_ADVANTAGE_STD, LEARNER_GRAD_NORM,
           LEARNER_LEARNING_RATE, LEARNER_TOKENS, LEARNER_SEQUENCES, LEARNER_TRAJECTORIES, LEARNER_OPTIMIZER_STEPS,
           LEARNER_NONFINITE_SKIPPED, LEARNER_SECONDS, LEARNER_TOKENS_PER_S)
#: The learner's counters outside a step's figures.
LEARNER_COUNTERS = (LEARNER_GROUPS_SKIPPED, LEARNER_DLQ_TOTAL, LEARNER_PUBLISH_REFUSED)
STREAMS = (STREAMS_EVENTS_IN, STREAMS_EVENTS_OUT, STREAMS_EVENTS_IN_PER_S, STREAMS_EVENTS_OUT_PER_S,
           STREAMS_ASSEMBLY_LATENCY_P50_S, STREAMS_ASSEMBLY_LATENCY_P99_S, STREAMS_CONSUMER_LAG,
           STREAMS_RECORDS_DEFERRED, STREAMS_RECORDS_SKIPPED, STREAMS_DLQ, STREAMS_DLQ_TOTAL, STREAMS_GROUPS_EMITTED,
           STREAMS_GROUPS_FILTERED, STREAMS_TRAJECTORIES_ACCEPTED, STREAMS_DUPLICATE_TRAJECTORY,
           STREAMS_DUPLICATE_REWARD, STREAMS_REWARDS_HELD, STREAMS_REWARDS_JOINED, STREAMS_GROUPS_COMPLETED,
           STREAMS_GROUPS_TIMED_OUT, STREAMS_GROUPS_EXPIRED, STREAMS_CLOSED_FORGOTTEN)
#: Every name rlstream emits (a name in several groups appears once).
ALL = tuple(dict.fromkeys(TOOLS + ROLLOUT + INFERENCE + LEARNER + LEARNER_COUNTERS + STREAMS))


def split_streams_figure(key: str) -> tuple[str, str]:
    """A stream-app figure key as (metric name, reason): ``streams.dlq.bad_key`` -> (``streams.dlq``, ``bad_key``),
    ``streams.events_in`` -> (``streams.events_in``, ``""``)."""
    base, _, reason = key.removeprefix(STREAMS_PREFIX).partition(".")
    return STREAMS_PREFIX + base, reason
