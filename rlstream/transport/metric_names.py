"""The metric names that operator tools read (``rlstream plot``, ``rlstream status``, dashboards).

Producers (streams, learner, rollout, finetune) emit these through
:class:`ops.metrics.MetricsPublisher` so that plots and dashboards find them. Any other name
may be emitted too; only these carry a meaning the tools rely on.

The ``step`` of a MetricEvent is the x axis: the policy version in an online run, the epoch in
``rlstream finetune``. Set the tag ``STEP_TAG`` to ``"version"`` or ``"epoch"`` to say which.
Prometheus sees each name as ``rlstream_<name with / replaced by _>`` (a gauge of the last value).
"""
from __future__ import annotations

#: Tag naming the meaning of ``step``: ``"version"`` (online) or ``"epoch"`` (finetune).
STEP_TAG = "step_kind"
STEP_VERSION = "version"
STEP_EPOCH = "epoch"

#: Mean reward of the trajectories trained on (or generated) at this step, before filters.
REWARD_MEAN = "reward_mean"
#: Mean reward of the groups kept after the filters (staleness, zero variance, curriculum).
REWARD_MEAN_FILTERED = "reward_mean_filtered"
#: Mean reward of one validation pass (finetune: every ``validation_interval`` epochs and after the last).
VALIDATION_REWARD_MEAN = "validation/reward_mean"
#: Fraction of groups the curriculum currently accepts, in (0, 1].
CURRICULUM_PERCENTILE = "curriculum/percentile"
#: GRPO loss of one learner step (step = learner step).
LEARNER_LOSS = "learner/loss"
#: Groups emitted by the assembler, and groups dropped by a filter (tag ``reason``).
GROUPS_EMITTED = "groups/emitted"
GROUPS_FILTERED = "groups/filtered"
#: Events sent to the dlq topic.
DLQ_EVENTS = "dlq/events"
#: Trajectories re-published by ``rlstream replay`` (source ``replay``).
REPLAY_PUBLISHED = "replay/published"

#: The names ``rlstream plot`` draws, in the order of its legend.
PLOTTED = (REWARD_MEAN, REWARD_MEAN_FILTERED, VALIDATION_REWARD_MEAN, CURRICULUM_PERCENTILE)
#: Every documented name.
ALL = (REWARD_MEAN, REWARD_MEAN_FILTERED, VALIDATION_REWARD_MEAN, CURRICULUM_PERCENTILE, LEARNER_LOSS,
       GROUPS_EMITTED, GROUPS_FILTERED, DLQ_EVENTS, REPLAY_PUBLISHED)
