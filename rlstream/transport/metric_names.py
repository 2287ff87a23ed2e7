"""Every metric name rlstream emits, in one place.

Producers (streams, learner, inference, rollout, finetune, ``rlstream up``, ``rlstream replay``) emit
these constants through :class:`~rlstream.transport.metrics.MetricsPublisher` (never a string written
at the emit site: ``tests/unit/test_metric_names.py`` fails on one), and the operator tools
(``rlstream plot``, ``rlstream status``, the live view of ``rlstream up``, dashboards) read them from here.

The ``step`` of a MetricEvent is the x axis: the policy version in an online run, the epoch in
``rlstream finetune``, the learner step for the ``learner/*`` figures. The tag ``STEP_TAG`` says which.

Prometheus: :data:`SPECS` (at the end) declares for every name its kind, its Prometheus name and the tags that
become labels (besides ``source`` and ``run_id``, always there). A **counter** (``rlstream_..._total``) adds up:
each event is an increment (``rollout/published``: 1 per trajectory), or with ``cumulative`` a running total since
the emitter started (the stream app's counters) of which the mirror adds the growth. A **histogram** (``..._seconds``,
buckets in seconds) observes each value (a duration). A **gauge** holds the last value (a level: lag, reward, loss).
Tags not declared as labels never become labels (no ``example_id``, no error text). A few names stay on the topic
only (``prometheus=None``: a rate or percentile Prometheus computes itself) and a few go to Prometheus only
(``topic=False``: one value per group or request, too many for the topic). The ``metrics`` topic carries every other
name as it always did. See ``transport/metrics.py`` for the mirror and ``ops/alerts.yml`` and
``ops/grafana/dashboards/rlstream.json`` for what reads the series.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
#: Trajectories published by ``rlstream import`` (source ``replay``); tag ``format``.
IMPORT_PUBLISHED = "import/published"
#: Records of an ``rlstream import`` file sent to ``dlq``; tag ``format``.
IMPORT_DEAD_LETTERED = "import/dead_lettered"

# --- rollout runner (source ``rollout``) -----------------------------------------------------------------------
#: 1 per trajectory published (tag ``policy_version``).
ROLLOUT_PUBLISHED = "rollout/published"
#: 1 per failed generation (tags ``example_id``, ``error``).
ROLLOUT_GENERATION_FAILED = "rollout/generation_failed"
#: Seconds one admission-control pause lasted.
ROLLOUT_ADMISSION_PAUSED_S = "rollout/admission_paused_s"
#: 1 per resync of the admission count to the learner's version (groups counted ahead that will never train).
ROLLOUT_ADMISSION_RESYNCS = "rollout/admission_resyncs"

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
#: Versions the fleet is asked to serve (serving, pending, canary: docs/promotion.md) that this worker's server failed
#: to load (tag ``worker``); above 0 the fleet switch waits for it and the serving pointer does not move.
INFERENCE_FLEET_LOAD_FAILED = "inference/fleet_load_failed"
#: 1 per time the worker found its server down (``inference.health_failures`` failed health checks in a row; tag
#: ``worker``): the replica leaves routing until the server answers again with its versions loaded again.
INFERENCE_ENGINE_DOWN = "inference/engine_down"
#: 1 while the worker's server answers its health check and holds its versions, 0 while it is down (tag ``worker``).
INFERENCE_ENGINE_UP = "inference/engine_up"

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
#: Mean entropy (nats) of the batch-start policy over the step's completion tokens: collapse shows here first.
LEARNER_ENTROPY = "learner/entropy"
#: Rows dropped from a step because their own loss or gradient was not finite (the step ran on the others).
LEARNER_ROWS_DROPPED_NONFINITE = "learner/rows_dropped_nonfinite"
#: Rows of the step without behaviour logprobs (importance weight 1: trained as if on-policy).
LEARNER_ROWS_WITHOUT_LOGPROBS = "learner/rows_without_logprobs"
#: Rows without behaviour logprobs not trained: produced more than learner.max_lag_without_logprobs versions ago.
LEARNER_ROWS_WITHOUT_LOGPROBS_DROPPED = "learner/rows_without_logprobs_dropped"
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
#: ``other_run`` (``learner.run_ids``), ``validation``, ``stale``: a turn it trains was produced more than
#: ``streams.max_policy_lag`` versions before the learner's); never dead-lettered.
LEARNER_GROUPS_SKIPPED = "learner/groups_skipped"
#: Records of ``groups`` the learner dead-lettered (undecodable, or a group no step can use), total since start.
LEARNER_DLQ_TOTAL = "learner/dlq_total"
#: 1 per publication refused (tag ``reason``: ``nonfinite_weights``); the version is neither written nor announced.
LEARNER_PUBLISH_REFUSED = "learner/publish_refused"
#: 1 while the learner holds its Redis lease and Redis confirms it, 0 from a failed renewal until a renewal succeeds,
#: and once the lease is lost (then no checkpoint or version is written); emitted when it changes.
LEARNER_LEASE_HELD = "learner/lease_held"
#: How many versions the learner's weights are ahead of the serving version (counted along what it trained, from
#: the version it last reset to; docs/off-policy.md); emitted each step and while it is held at the bound.
LEARNER_VERSIONS_AHEAD_OF_SERVING = "learner/versions_ahead_of_serving"
#: Moves back to the serving version's weights (after ``learner.reset_after_rejections`` gate rejections), running
#: total over the run (kept in the checkpoint).
LEARNER_RESETS_TO_SERVING = "learner/resets_to_serving"

# --- stream app (source ``streams:<worker>``, tag ``worker``; counters are totals since the worker started) --------
#: The prefix of every stream-app name. A counter may carry a reason after one more dot
#: (``streams.dlq.bad_key``): the app emits it as ``streams.dlq`` with the tag ``reason``.
STREAMS_PREFIX = "streams."
STREAMS_EVENTS_IN = "streams.events_in"
STREAMS_EVENTS_OUT = "streams.events_out"
STREAMS_EVENTS_IN_PER_S = "streams.events_in_per_s"
STREAMS_EVENTS_OUT_PER_S = "streams.events_out_per_s"
#: Latency percentiles (seconds from a group's last member to its emission) over the worker's last 10 000 groups.
STREAMS_ASSEMBLY_LATENCY_P50_S = "streams.assembly_latency_p50_s"
STREAMS_ASSEMBLY_LATENCY_P99_S = "streams.assembly_latency_p99_s"
#: The same latency, one value per emitted group (Prometheus only: a histogram).
STREAMS_ASSEMBLY_LATENCY_S = "streams.assembly_latency_s"
#: Records behind the high watermark over the worker's trajectories and rewards partitions.
STREAMS_CONSUMER_LAG = "streams.consumer_lag"
#: Records put off by the progress gate (rebalance, recovery) and records skipped as already applied.
STREAMS_RECORDS_DEFERRED = "streams.records_deferred"
STREAMS_RECORDS_SKIPPED = "streams.records_skipped"
#: Probes that found offsets a read_committed consumer did not deliver which cannot be proven to hold only transaction
#: markers and aborted records: the partition stops there (error log) and the probe is repeated.
STREAMS_UNPROVEN_GAPS = "streams.unproven_gaps"
#: Dead letters (tag ``reason``) and their total.
STREAMS_DLQ = "streams.dlq"
STREAMS_DLQ_TOTAL = "streams.dlq_total"
#: Groups emitted (tag ``reason`` = the completion: ``full`` or ``timeout``) and groups filtered (tag ``reason``).
STREAMS_GROUPS_EMITTED = "streams.groups_emitted"
STREAMS_GROUPS_FILTERED = "streams.groups_filtered"
#: The assembler's counters (``streams.assembly.Outcome.counts``).
STREAMS_TRAJECTORIES_ACCEPTED = "streams.trajectories_accepted"
#: Validation trajectories (held-out answers) read and left out of assembly: never grouped, never trained.
STREAMS_VALIDATION_SKIPPED = "streams.validation_skipped"
STREAMS_DUPLICATE_TRAJECTORY = "streams.duplicate_trajectory"
STREAMS_DUPLICATE_REWARD = "streams.duplicate_reward"
STREAMS_REWARDS_HELD = "streams.rewards_held"
STREAMS_REWARDS_JOINED = "streams.rewards_joined"
#: Feedback corrections (a repeated feedback_id) applied while the trajectory's group was open (last write wins).
STREAMS_REWARDS_CORRECTED = "streams.rewards_corrected"
#: Feedback corrections that came after their group left: recorded on dlq (correction_after_emit), never trained.
STREAMS_REWARDS_CORRECTED_AFTER_EMIT = "streams.rewards_corrected_after_emit"
STREAMS_GROUPS_COMPLETED = "streams.groups_completed"
STREAMS_GROUPS_TIMED_OUT = "streams.groups_timed_out"
STREAMS_GROUPS_EXPIRED = "streams.groups_expired"
STREAMS_CLOSED_FORGOTTEN = "streams.closed_forgotten"
#: Finished groups none of whose members' records could be read back (nothing emitted; members dead-lettered).
STREAMS_GROUPS_WITHOUT_RECORDS = "streams.groups_without_records"
#: Waiting members' records read back from their topic by offset (not in the worker's payload cache).
STREAMS_PAYLOADS_READ_BACK = "streams.payloads_read_back"
#: Session stitching over ``calls`` (streams/stitching.py): calls joined, trajectories published, splits (rewritten
#: history; a cap reached), calls continued by messages, idle closes, re-sent calls dropped, records missing a
#: turn or reward, ends of unknown sessions.
STREAMS_SESSION_CALLS = "streams.session_calls"
STREAMS_SESSION_TRAJECTORIES = "streams.session_trajectories"
STREAMS_SESSION_SPLITS = "streams.session_splits"
STREAMS_SESSION_SPLITS_LONG = "streams.session_splits_long"
STREAMS_SESSION_RETOKENIZED = "streams.session_retokenized"
STREAMS_SESSIONS_IDLE_CLOSED = "streams.sessions_idle_closed"
STREAMS_SESSION_DUPLICATE_CALLS = "streams.session_duplicate_calls"
STREAMS_SESSION_CALLS_INCOMPLETE = "streams.session_calls_incomplete"
STREAMS_SESSION_ENDS_UNKNOWN = "streams.session_ends_unknown"
#: Scored episodes of a tool task (a trajectory or reward whose components carry ``tool_calls``).
STREAMS_TOOL_EPISODES = "streams.tool_episodes"
#: Tool-task episodes in which the model wrote a tool call that did not parse (reward component ``tool_call_unparsed`` > 0).
STREAMS_TOOL_CALL_PARSE_FAILURES = "streams.tool_call_parse_failures"
#: Tool-task episodes without any tool call (reward component ``tool_calls`` 0, nothing left unparsed).
STREAMS_TOOL_EPISODES_WITHOUT_CALL = "streams.tool_episodes_without_call"

# --- capture gateway (source ``gateway``; Prometheus only: one value per call) -----------------------------------
#: Seconds the gateway spent on a captured call besides waiting for the upstream: the whole handler minus the
#: upstream call (non-streamed), up to handing on the first event minus the upstream's time to it (streamed).
#: Tags ``route`` (``chat_completions``, ``responses``) and ``streamed`` (``true``/``false``).
GATEWAY_OVERHEAD_S = "gateway/overhead_s"
GATEWAY_REQUESTS_REJECTED = "gateway/requests_rejected"
GATEWAY_SESSIONS_EVICTED = "gateway/sessions_evicted"
GATEWAY_SESSIONS_SPLIT_LONG = "gateway/sessions_split_long"

# --- promotion gate (source ``gate``; step = the version decided about; docs/gate.md) --------------------------------
#: 1 per decision (tag ``decision``: promote, reject, canary, finish_canary, rollback).
GATE_DECISIONS = "gate/decisions"
#: Mean held-out reward of one evaluated version (tag ``role``: candidate or serving).
GATE_EVAL_REWARD_MEAN = "gate/eval_reward_mean"
#: Seconds from a rewarded trajectory's feedback to a version trained on it serving on every alive replica (one per
#: trained trajectory; Prometheus only).
GATE_FEEDBACK_TO_SERVING_S = "gate/feedback_to_serving_s"
#: Median and 90th percentile of every feedback-to-serving sample the gate measured.
GATE_FEEDBACK_TO_SERVING_P50_S = "gate/feedback_to_serving_p50_s"
GATE_FEEDBACK_TO_SERVING_P90_S = "gate/feedback_to_serving_p90_s"
#: Rewarded trajectories trained into a version that does not serve yet (no version at or above it promoted).
GATE_FEEDBACK_WAITING = "gate/feedback_waiting"
#: Seconds from a canary's start to its rollback by the sequential test.
GATE_CANARY_ROLLBACK_S = "gate/canary_rollback_s"
#: 1 per policy-versions record the gate refused as untrusted (tag ``reason``); it never evaluates it.
GATE_VERSION_REFUSED = "gate/version_refused"
#: 1 per evaluation that produced no result (EvaluationFailed): no decision is taken, the gate tries again later.
GATE_EVALUATION_FAILURES = "gate/evaluation_failures"
#: 1 per failed evaluation episode, retried or not (tag ``reason``: connection, timeout, status_<code>, no_answer,
#: error); a sample that still fails after its retries fails the whole evaluation.
GATE_EVALUATION_REQUEST_FAILURES = "gate/evaluation_request_failures"
#: 1 per reward (a RewardEvent, or a trajectory's inline reward) the gate left out because it fails the reward rules
#: of rlstream/schemas/rewards.py (tag ``reason``): never counted in the canary's test nor the feedback latency.
GATE_INVALID_REWARDS = "gate/invalid_rewards"

# --- groups of names ---------------------------------------------------------------------------------------------
#: The names ``rlstream plot`` draws, in the order of its legend.
PLOTTED = (REWARD_MEAN, REWARD_MEAN_FILTERED, VALIDATION_REWARD_MEAN, CURRICULUM_PERCENTILE)
#: The names the operator tools give a meaning to.
TOOLS = (REWARD_MEAN, REWARD_MEAN_FILTERED, VALIDATION_REWARD_MEAN, CURRICULUM_PERCENTILE, LEARNER_LOSS,
         REPLAY_PUBLISHED, IMPORT_PUBLISHED, IMPORT_DEAD_LETTERED)
ROLLOUT = (ROLLOUT_PUBLISHED, ROLLOUT_GENERATION_FAILED, ROLLOUT_ADMISSION_PAUSED_S, ROLLOUT_ADMISSION_RESYNCS)
INFERENCE = (INFERENCE_LOADED_VERSION, INFERENCE_LOAD_SECONDS, INFERENCE_LOAD_FAILED, INFERENCE_VERSION_REFUSED,
             INFERENCE_FLEET_LOAD_FAILED, INFERENCE_ENGINE_DOWN, INFERENCE_ENGINE_UP)
#: Per learner step: the step's own figures and those of its optimizer step.
LEARNER = (LEARNER_GROUPS, LEARNER_POLICY_LAG_MEAN, LEARNER_POLICY_LAG_MAX, LEARNER_LOSS, LEARNER_KL,
           LEARNER_CLIP_FRACTION, LEARNER_IS_RATIO_MEAN, LEARNER_IS_RATIO_MIN, LEARNER_IS_RATIO_MAX,
           LEARNER_REWARD_MEAN, LEARNER_REWARD_STD, LEARNER_ADVANTAGE_MEAN, LEARNER_ADVANTAGE_STD, LEARNER_ENTROPY,
           LEARNER_GRAD_NORM, LEARNER_LEARNING_RATE, LEARNER_TOKENS, LEARNER_SEQUENCES, LEARNER_TRAJECTORIES,
           LEARNER_OPTIMIZER_STEPS, LEARNER_NONFINITE_SKIPPED, LEARNER_ROWS_DROPPED_NONFINITE,
           LEARNER_ROWS_WITHOUT_LOGPROBS, LEARNER_ROWS_WITHOUT_LOGPROBS_DROPPED, LEARNER_SECONDS,
           LEARNER_TOKENS_PER_S)
#: The learner's counters outside a step's figures.
LEARNER_COUNTERS = (LEARNER_GROUPS_SKIPPED, LEARNER_DLQ_TOTAL, LEARNER_PUBLISH_REFUSED, LEARNER_LEASE_HELD,
                    LEARNER_VERSIONS_AHEAD_OF_SERVING, LEARNER_RESETS_TO_SERVING)
STREAMS = (STREAMS_EVENTS_IN, STREAMS_EVENTS_OUT, STREAMS_EVENTS_IN_PER_S, STREAMS_EVENTS_OUT_PER_S,
           STREAMS_ASSEMBLY_LATENCY_P50_S, STREAMS_ASSEMBLY_LATENCY_P99_S, STREAMS_ASSEMBLY_LATENCY_S,
           STREAMS_CONSUMER_LAG,
           STREAMS_UNPROVEN_GAPS,
           STREAMS_RECORDS_DEFERRED, STREAMS_RECORDS_SKIPPED, STREAMS_DLQ, STREAMS_DLQ_TOTAL, STREAMS_GROUPS_EMITTED,
           STREAMS_GROUPS_FILTERED, STREAMS_TRAJECTORIES_ACCEPTED, STREAMS_DUPLICATE_TRAJECTORY,
           STREAMS_DUPLICATE_REWARD, STREAMS_REWARDS_HELD, STREAMS_REWARDS_JOINED, STREAMS_REWARDS_CORRECTED,
           STREAMS_REWARDS_CORRECTED_AFTER_EMIT, STREAMS_GROUPS_COMPLETED,
           STREAMS_GROUPS_TIMED_OUT, STREAMS_GROUPS_EXPIRED, STREAMS_CLOSED_FORGOTTEN, STREAMS_GROUPS_WITHOUT_RECORDS,
           STREAMS_PAYLOADS_READ_BACK, STREAMS_SESSION_CALLS, STREAMS_SESSION_TRAJECTORIES, STREAMS_SESSION_SPLITS,
           STREAMS_SESSION_SPLITS_LONG, STREAMS_SESSION_RETOKENIZED, STREAMS_SESSIONS_IDLE_CLOSED,
           STREAMS_SESSION_DUPLICATE_CALLS, STREAMS_SESSION_CALLS_INCOMPLETE, STREAMS_SESSION_ENDS_UNKNOWN,
           STREAMS_TOOL_EPISODES, STREAMS_TOOL_CALL_PARSE_FAILURES, STREAMS_TOOL_EPISODES_WITHOUT_CALL,
           STREAMS_VALIDATION_SKIPPED)
GATEWAY = (GATEWAY_OVERHEAD_S, GATEWAY_REQUESTS_REJECTED, GATEWAY_SESSIONS_EVICTED, GATEWAY_SESSIONS_SPLIT_LONG)
GATE = (GATE_DECISIONS, GATE_EVAL_REWARD_MEAN, GATE_FEEDBACK_TO_SERVING_S, GATE_FEEDBACK_TO_SERVING_P50_S,
        GATE_FEEDBACK_TO_SERVING_P90_S, GATE_FEEDBACK_WAITING, GATE_CANARY_ROLLBACK_S, GATE_VERSION_REFUSED,
        GATE_EVALUATION_FAILURES, GATE_EVALUATION_REQUEST_FAILURES, GATE_INVALID_REWARDS)
#: Every name rlstream emits (a name in several groups appears once).
ALL = tuple(dict.fromkeys(TOOLS + ROLLOUT + INFERENCE + LEARNER + LEARNER_COUNTERS + STREAMS + GATEWAY + GATE))


def split_streams_figure(key: str) -> tuple[str, str]:
    """A stream-app figure key as (metric name, reason): ``streams.dlq.bad_key`` -> (``streams.dlq``, ``bad_key``),
    ``streams.events_in`` -> (``streams.events_in``, ``""``)."""
    base, _, reason = key.removeprefix(STREAMS_PREFIX).partition(".")
    return STREAMS_PREFIX + base, reason


# --- Prometheus: the kind, name and labels of every metric name -----------------------------------------------------
MetricKind = Literal["counter", "gauge", "histogram"]
#: Labels every series has (the MetricEvent's ``source`` and ``run_id``); a spec never lists them.
FIXED_LABELS = ("source", "run_id")
#: Histogram buckets (seconds) of a duration from milliseconds to minutes: a learner step, a weight reload, a
#: group's assembly, an admission pause.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Histogram buckets (seconds) of a sub-second duration: the gateway's own time on a call.
FAST_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class MetricSpec:
    """How one metric name is served to Prometheus, and whether it goes on the ``metrics`` topic.

    ``prometheus`` is None for a name kept off Prometheus (a rate or percentile it computes itself from a counter or
    histogram). ``labels``: the tags that become labels (any other tag is dropped from the series). ``cumulative``
    (counters): each value is a running total since the emitter started, not an increment. ``topic`` False: the
    name goes to Prometheus only. ``buckets``: a histogram's upper bounds, in seconds.
    """

    name: str
    kind: MetricKind
    prometheus: str | None
    labels: tuple[str, ...] = ()
    help: str = ""
    cumulative: bool = False
    topic: bool = True
    buckets: tuple[float, ...] = SECONDS_BUCKETS


def _gauge(name: str, prometheus: str, labels: tuple[str, ...], help: str) -> MetricSpec:
    return MetricSpec(name, "gauge", prometheus, labels, help)


def _counter(name: str, prometheus: str, labels: tuple[str, ...], help: str, cumulative: bool = False) -> MetricSpec:
    return MetricSpec(name, "counter", prometheus, labels, help, cumulative=cumulative)


def _total(name: str, prometheus: str, labels: tuple[str, ...], help: str) -> MetricSpec:
    """A counter whose events carry the running total since the emitter started."""
    return _counter(name, prometheus, labels, help, cumulative=True)


def _histogram(name: str, prometheus: str, labels: tuple[str, ...], help: str, topic: bool = True,
               buckets: tuple[float, ...] = SECONDS_BUCKETS) -> MetricSpec:
    return MetricSpec(name, "histogram", prometheus, labels, help, topic=topic, buckets=buckets)


def _topic_only(name: str, kind: MetricKind, why: str) -> MetricSpec:
    return MetricSpec(name, kind, None, (), why)


_VERSIONED = ("step_kind", "policy")
_LEARNER = ("policy",)
_WORKER = ("worker",)
_WORKER_REASON = ("worker", "reason")

#: Every metric name's spec, keyed by the name (``tests/unit/test_metric_names.py`` checks it covers ``ALL`` and
#: follows the naming conventions).
SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in (
    _gauge(REWARD_MEAN, "rlstream_reward_mean", _VERSIONED, "Mean reward of the trajectories trained on or "
           "generated at this step, before filters"),
    _gauge(REWARD_MEAN_FILTERED, "rlstream_reward_mean_filtered", _VERSIONED, "Mean reward of the groups kept by "
           "the filters"),
    _gauge(VALIDATION_REWARD_MEAN, "rlstream_validation_reward_mean", _VERSIONED, "Mean reward of the last "
           "validation (held-out) pass"),
    _gauge(CURRICULUM_PERCENTILE, "rlstream_curriculum_percentile", _VERSIONED, "Fraction of groups the "
           "curriculum accepts"),
    _gauge(LEARNER_LOSS, "rlstream_learner_loss", _VERSIONED, "GRPO loss of the last learner step or finetune epoch"),
    _total(REPLAY_PUBLISHED, "rlstream_replay_published_total", ("from_topic",), "Trajectories re-published by "
           "rlstream replay"),
    _total(IMPORT_PUBLISHED, "rlstream_import_published_total", ("format",), "Trajectories published by "
           "rlstream import"),
    _total(IMPORT_DEAD_LETTERED, "rlstream_import_dead_lettered_total", ("format",), "Records of an rlstream import "
           "file sent to the dead-letter topic"),
    # rollout runner
    _counter(ROLLOUT_PUBLISHED, "rlstream_rollout_published_total", (), "Trajectories published by the rollout "
             "runner"),
    _counter(ROLLOUT_GENERATION_FAILED, "rlstream_rollout_generation_failed_total", (), "Generations that failed "
             "(the example and the error are in the metrics topic and the logs)"),
    _histogram(ROLLOUT_ADMISSION_PAUSED_S, "rlstream_rollout_admission_paused_seconds", (), "Duration of one "
               "admission-control pause of the rollout runner"),
    _counter(ROLLOUT_ADMISSION_RESYNCS, "rlstream_rollout_admission_resyncs_total", (), "Times the rollout runner "
             "counted from the learner's version again because groups it counted ahead never trained"),
    # inference sync worker
    _gauge(INFERENCE_LOADED_VERSION, "rlstream_inference_loaded_version", _WORKER, "Policy version the worker's "
           "server has loaded last"),
    _histogram(INFERENCE_LOAD_SECONDS, "rlstream_inference_load_seconds", _WORKER, "Time to load one policy "
               "version into the inference server"),
    _counter(INFERENCE_LOAD_FAILED, "rlstream_inference_load_failed_total", _WORKER_REASON, "Policy versions the "
             "worker could not load (reason: the exception type)"),
    _counter(INFERENCE_VERSION_REFUSED, "rlstream_inference_version_refused_total", _WORKER_REASON, "Policy "
             "versions refused as untrusted and dead-lettered"),
    _gauge(INFERENCE_FLEET_LOAD_FAILED, "rlstream_inference_fleet_load_failed", _WORKER, "Versions the fleet is "
           "asked to serve (serving, pending, canary) that the worker's server failed to load"),
    _counter(INFERENCE_ENGINE_DOWN, "rlstream_inference_engine_down_total", _WORKER, "Times the worker found its "
             "inference server down (failed health checks); the replica left routing until it was back"),
    _gauge(INFERENCE_ENGINE_UP, "rlstream_inference_engine_up", _WORKER, "1 while the worker's inference server is "
           "healthy and holds its versions, 0 while it is down (out of routing)"),
    # learner: one event of each per learner step
    _counter(LEARNER_GROUPS, "rlstream_learner_groups_trained_total", _LEARNER, "Groups the learner trained on"),
    _gauge(LEARNER_POLICY_LAG_MEAN, "rlstream_learner_policy_lag_mean", _LEARNER, "Mean policy lag (versions) of "
           "the last step's groups"),
    _gauge(LEARNER_POLICY_LAG_MAX, "rlstream_learner_policy_lag_max", _LEARNER, "Largest policy lag (versions) of "
           "the last step's groups"),
    _gauge(LEARNER_KL, "rlstream_learner_kl", _LEARNER, "KL to the reference of the last step"),
    _gauge(LEARNER_CLIP_FRACTION, "rlstream_learner_clip_fraction", _LEARNER, "Fraction of tokens clipped in the "
           "last step"),
    _gauge(LEARNER_IS_RATIO_MEAN, "rlstream_learner_is_ratio_mean", _LEARNER, "Mean importance ratio of the last "
           "step"),
    _gauge(LEARNER_IS_RATIO_MIN, "rlstream_learner_is_ratio_min", _LEARNER, "Smallest importance ratio of the "
           "last step"),
    _gauge(LEARNER_IS_RATIO_MAX, "rlstream_learner_is_ratio_max", _LEARNER, "Largest importance ratio of the last "
           "step"),
    _gauge(LEARNER_REWARD_MEAN, "rlstream_learner_reward_mean", _LEARNER, "Mean reward of the last step's "
           "trajectories"),
    _gauge(LEARNER_REWARD_STD, "rlstream_learner_reward_std", _LEARNER, "Reward standard deviation of the last "
           "step's trajectories"),
    _gauge(LEARNER_ADVANTAGE_MEAN, "rlstream_learner_advantage_mean", _LEARNER, "Mean advantage of the last step"),
    _gauge(LEARNER_ADVANTAGE_STD, "rlstream_learner_advantage_std", _LEARNER, "Advantage standard deviation of the "
           "last step"),
    _counter(LEARNER_ROWS_DROPPED_NONFINITE, "rlstream_learner_rows_dropped_nonfinite_total", _LEARNER, "Rows "
             "dropped from a step because their own loss or gradient was not finite"),
    _counter(LEARNER_ROWS_WITHOUT_LOGPROBS, "rlstream_learner_rows_without_logprobs_total", _LEARNER, "Rows trained "
             "or considered without behaviour logprobs (importance weight 1)"),
    _counter(LEARNER_ROWS_WITHOUT_LOGPROBS_DROPPED, "rlstream_learner_rows_without_logprobs_dropped_total", _LEARNER,
             "Rows without behaviour logprobs not trained: older than learner.max_lag_without_logprobs"),
    _gauge(LEARNER_ENTROPY, "rlstream_learner_entropy", _LEARNER, "Mean policy entropy (nats) over the last "
           "step's completion tokens"),
    _gauge(LEARNER_GRAD_NORM, "rlstream_learner_grad_norm", _LEARNER, "Gradient norm of the last step"),
    _gauge(LEARNER_LEARNING_RATE, "rlstream_learner_learning_rate", _LEARNER, "Learning rate of the last step"),
    _counter(LEARNER_TOKENS, "rlstream_learner_tokens_total", _LEARNER, "Tokens trained on"),
    _counter(LEARNER_SEQUENCES, "rlstream_learner_sequences_total", _LEARNER, "Sequences (turns) trained on"),
    _counter(LEARNER_TRAJECTORIES, "rlstream_learner_trajectories_total", _LEARNER, "Trajectories trained on"),
    _counter(LEARNER_OPTIMIZER_STEPS, "rlstream_learner_optimizer_steps_total", _LEARNER, "Optimizer steps applied"),
    _counter(LEARNER_NONFINITE_SKIPPED, "rlstream_learner_nonfinite_skipped_total", _LEARNER, "Optimizer steps "
             "skipped for a non-finite loss or gradient"),
    _histogram(LEARNER_SECONDS, "rlstream_learner_step_seconds", _LEARNER, "Duration of one learner step"),
    _gauge(LEARNER_TOKENS_PER_S, "rlstream_learner_tokens_per_second", _LEARNER, "Training throughput of the last "
           "step"),
    _total(LEARNER_GROUPS_SKIPPED, "rlstream_learner_groups_skipped_total", ("policy", "reason"), "Groups consumed "
           "but not trained on"),
    _total(LEARNER_DLQ_TOTAL, "rlstream_learner_dead_letters_total", _LEARNER, "Records of the groups topic the "
           "learner dead-lettered"),
    _gauge(LEARNER_LEASE_HELD, "rlstream_learner_lease_held", _LEARNER, "1 while the learner's Redis lease is held and "
           "confirmed, 0 after a failed renewal or once it is lost"),
    _counter(LEARNER_PUBLISH_REFUSED, "rlstream_learner_publish_refused_total", ("policy", "reason"), "Publications "
             "the learner refused (weights not finite)"),
    _gauge(LEARNER_VERSIONS_AHEAD_OF_SERVING, "rlstream_learner_versions_ahead_of_serving", _LEARNER, "Versions "
           "the learner's weights are ahead of the serving version"),
    _total(LEARNER_RESETS_TO_SERVING, "rlstream_learner_resets_to_serving_total", _LEARNER, "Moves of the learner "
           "back to the serving version's weights after gate rejections"),
    # stream app: its counters report running totals since the worker started
    _total(STREAMS_EVENTS_IN, "rlstream_streams_events_in_total", _WORKER, "Trajectory and reward events consumed"),
    _total(STREAMS_EVENTS_OUT, "rlstream_streams_events_out_total", _WORKER, "Groups produced to the groups topic"),
    _topic_only(STREAMS_EVENTS_IN_PER_S, "gauge", "Prometheus: rate(rlstream_streams_events_in_total[5m])"),
    _topic_only(STREAMS_EVENTS_OUT_PER_S, "gauge", "Prometheus: rate(rlstream_streams_events_out_total[5m])"),
    _topic_only(STREAMS_ASSEMBLY_LATENCY_P50_S, "gauge", "Prometheus: histogram_quantile over "
                "rlstream_streams_assembly_latency_seconds_bucket"),
    _topic_only(STREAMS_ASSEMBLY_LATENCY_P99_S, "gauge", "Prometheus: histogram_quantile over "
                "rlstream_streams_assembly_latency_seconds_bucket"),
    _histogram(STREAMS_ASSEMBLY_LATENCY_S, "rlstream_streams_assembly_latency_seconds", _WORKER, "Time from a "
               "group's last member to its emission", topic=False),
    _gauge(STREAMS_CONSUMER_LAG, "rlstream_streams_consumer_lag", _WORKER, "Records behind the high watermark over "
           "the worker's trajectories and rewards partitions"),
    _total(STREAMS_RECORDS_DEFERRED, "rlstream_streams_records_deferred_total", _WORKER, "Records put off by the "
           "progress gate"),
    _total(STREAMS_RECORDS_SKIPPED, "rlstream_streams_records_skipped_total", _WORKER, "Records skipped as already "
           "applied"),
    _total(STREAMS_UNPROVEN_GAPS, "rlstream_streams_unproven_gaps_total", _WORKER, "Probes of undelivered offsets "
           "that could not be proven markers or aborted records (the partition is stopped)"),
    _total(STREAMS_DLQ, "rlstream_streams_dead_letters_total", _WORKER_REASON, "Records the stream app "
           "dead-lettered"),
    _topic_only(STREAMS_DLQ_TOTAL, "counter", "Prometheus: sum without (reason) (rlstream_streams_dead_letters_total)"),
    _total(STREAMS_GROUPS_EMITTED, "rlstream_streams_groups_emitted_total", _WORKER_REASON, "Groups emitted "
           "(reason: full or timeout)"),
    _total(STREAMS_GROUPS_FILTERED, "rlstream_streams_groups_filtered_total", _WORKER_REASON, "Groups dropped by a "
           "filter (reason: stale, zero_variance, curriculum)"),
    _total(STREAMS_TRAJECTORIES_ACCEPTED, "rlstream_streams_trajectories_accepted_total", _WORKER, "Trajectories "
           "accepted by the assembler"),
    _total(STREAMS_DUPLICATE_TRAJECTORY, "rlstream_streams_duplicate_trajectories_total", _WORKER, "Duplicate "
           "trajectories dropped"),
    _total(STREAMS_DUPLICATE_REWARD, "rlstream_streams_duplicate_rewards_total", _WORKER, "Duplicate rewards "
           "dropped"),
    _total(STREAMS_REWARDS_HELD, "rlstream_streams_rewards_held_total", _WORKER, "Rewards held until their "
           "trajectory arrives"),
    _total(STREAMS_REWARDS_JOINED, "rlstream_streams_rewards_joined_total", _WORKER, "Rewards joined to their "
           "trajectory"),
    _total(STREAMS_REWARDS_CORRECTED, "rlstream_streams_rewards_corrected_total", _WORKER, "Feedback corrections "
           "(a repeated feedback_id) applied before the trajectory's group left"),
    _total(STREAMS_REWARDS_CORRECTED_AFTER_EMIT, "rlstream_streams_rewards_corrected_after_emit_total", _WORKER,
           "Feedback corrections that came after the trajectory's group left (recorded on dlq, never trained)"),
    _total(STREAMS_GROUPS_COMPLETED, "rlstream_streams_groups_completed_total", _WORKER, "Groups completed (all "
           "members)"),
    _total(STREAMS_GROUPS_TIMED_OUT, "rlstream_streams_groups_timed_out_total", _WORKER, "Groups closed by the "
           "timeout"),
    _total(STREAMS_GROUPS_EXPIRED, "rlstream_streams_groups_expired_total", _WORKER, "Groups expired without "
           "enough members"),
    _total(STREAMS_CLOSED_FORGOTTEN, "rlstream_streams_closed_forgotten_total", _WORKER, "Closed group ids "
           "forgotten after the retention"),
    _total(STREAMS_GROUPS_WITHOUT_RECORDS, "rlstream_streams_groups_without_records_total", _WORKER, "Finished "
           "groups none of whose members' records could be read back"),
    _total(STREAMS_PAYLOADS_READ_BACK, "rlstream_streams_payloads_read_back_total", _WORKER, "Waiting members' "
           "records read back from their topic by offset"),
    _total(STREAMS_SESSION_CALLS, "rlstream_streams_session_calls_total", _WORKER, "Session calls joined to a trajectory by the stitcher"),
    _total(STREAMS_SESSION_TRAJECTORIES, "rlstream_streams_session_trajectories_total", _WORKER, "Session trajectories published by the stitcher"),
    _total(STREAMS_SESSION_SPLITS, "rlstream_streams_session_splits_total", _WORKER, "Session calls that rewrote the history and started a new trajectory"),
    _total(STREAMS_SESSION_SPLITS_LONG, "rlstream_streams_session_splits_long_total", _WORKER, "Sessions continued in a new trajectory at the turn or byte cap"),
    _total(STREAMS_SESSION_RETOKENIZED, "rlstream_streams_session_retokenized_total", _WORKER, "Session calls continued by messages while their prompt tokens differ"),
    _total(STREAMS_SESSIONS_IDLE_CLOSED, "rlstream_streams_sessions_idle_closed_total", _WORKER, "Sessions closed for being idle"),
    _total(STREAMS_SESSION_DUPLICATE_CALLS, "rlstream_streams_session_duplicate_calls_total", _WORKER, "Session calls re-sent by a gateway and dropped by call id"),
    _total(STREAMS_VALIDATION_SKIPPED, "rlstream_streams_validation_skipped_total", _WORKER, "Validation (held-out) trajectories checked and left out of groups"),
    _total(STREAMS_SESSION_CALLS_INCOMPLETE, "rlstream_streams_session_calls_incomplete_total", _WORKER, "Session records without a turn, reply or reward"),
    _total(STREAMS_SESSION_ENDS_UNKNOWN, "rlstream_streams_session_ends_unknown_total", _WORKER, "Session ends for sessions with no open trajectory"),
    _total(STREAMS_TOOL_EPISODES, "rlstream_streams_tool_episodes_total", _WORKER, "Scored tool-task episodes"),
    _total(STREAMS_TOOL_CALL_PARSE_FAILURES, "rlstream_streams_tool_call_parse_failures_total", _WORKER,
           "Tool-task episodes with a tool call that did not parse"),
    _total(STREAMS_TOOL_EPISODES_WITHOUT_CALL, "rlstream_streams_tool_episodes_without_call_total", _WORKER,
           "Tool-task episodes without a tool call"),
    # capture gateway
    _histogram(GATEWAY_OVERHEAD_S, "rlstream_gateway_overhead_seconds", ("route", "streamed"), "Time the gateway "
               "spent on a captured call besides waiting for the upstream", topic=False,
               buckets=FAST_SECONDS_BUCKETS),
    MetricSpec(GATEWAY_REQUESTS_REJECTED, "counter", "rlstream_gateway_requests_rejected_total", ("reason",),
               "Requests the gateway answered with a 4xx or 503 for a bound (body or headers too large, slow "
               "body, bad session id, bad JSON, n too large, overloaded)", cumulative=True, topic=False),
    MetricSpec(GATEWAY_SESSIONS_EVICTED, "counter", "rlstream_gateway_sessions_evicted_total", (),
               "Open sessions closed and published early because max_open_sessions were open", cumulative=True,
               topic=False),
    MetricSpec(GATEWAY_SESSIONS_SPLIT_LONG, "counter", "rlstream_gateway_sessions_split_long_total", (),
               "Sessions split because their trajectory reached max_session_turns or max_session_bytes",
               cumulative=True, topic=False),
    # promotion gate
    _counter(GATE_DECISIONS, "rlstream_gate_decisions_total", ("policy", "decision"), "Promotion decisions of the "
             "gate (promote, reject, canary, finish_canary, rollback)"),
    _gauge(GATE_EVAL_REWARD_MEAN, "rlstream_gate_eval_reward_mean", ("policy", "role"), "Mean held-out reward of "
           "the last version the gate evaluated (role: candidate or serving)"),
    _histogram(GATE_FEEDBACK_TO_SERVING_S, "rlstream_gate_feedback_to_serving_seconds", ("policy",), "Time from a "
               "trained trajectory's feedback to a version trained on it serving on every alive replica",
               topic=False, buckets=(1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0, 600.0, 1800.0)),
    _gauge(GATE_FEEDBACK_TO_SERVING_P50_S, "rlstream_gate_feedback_to_serving_p50_seconds", ("policy",), "Median "
           "feedback-to-serving time over every trajectory the gate measured"),
    _gauge(GATE_FEEDBACK_TO_SERVING_P90_S, "rlstream_gate_feedback_to_serving_p90_seconds", ("policy",), "90th "
           "percentile of the feedback-to-serving time over every trajectory the gate measured"),
    _gauge(GATE_FEEDBACK_WAITING, "rlstream_gate_feedback_waiting", ("policy",), "Rewarded trajectories trained "
           "into a version that does not serve yet"),
    _histogram(GATE_CANARY_ROLLBACK_S, "rlstream_gate_canary_rollback_seconds", ("policy",), "Time from a canary's "
               "start to its automatic rollback"),
    _counter(GATE_VERSION_REFUSED, "rlstream_gate_version_refused_total", ("policy", "reason"), "policy-versions "
             "records the gate refused as untrusted (never evaluated)"),
    _counter(GATE_EVALUATION_FAILURES, "rlstream_gate_evaluation_failures_total", ("policy", "role"), "Held-out "
             "evaluations that produced no result (the decision is held and tried again)"),
    _counter(GATE_EVALUATION_REQUEST_FAILURES, "rlstream_gate_evaluation_request_failures_total",
             ("policy", "reason"), "Failed held-out evaluation episodes, retried or not (reason: connection, timeout, "
             "status_<code>, no_answer, error)"),
    _counter(GATE_INVALID_REWARDS, "rlstream_gate_invalid_rewards_total", ("policy", "reason"), "Rewards the gate "
             "left out of the canary's test (not finite, outside streams.reward_range, malformed)"),
)}
