"""Agent-side SDK (capture + publish) and the reference rollout runner (-> trajectories).

What agent code imports::

    from rlstream.rollout import Recording, SamplingSettings, TrajectoryPublisher, instrument, target_function

Heavier parts live in their modules: ``rollout.runner`` (``rlstream rollout run``) and ``rollout.workflows``
(the workflow signature ``(example, client, sampling)`` and the reference workflow).
"""
from rlstream.rollout.capture import WORKFLOW, Recording, instrument, routing, target_function
from rlstream.rollout.publisher import PublishError, TrajectoryPublisher
from rlstream.rollout.sampling import SamplingSettings

__all__ = ["WORKFLOW", "PublishError", "Recording", "SamplingSettings", "TrajectoryPublisher", "instrument", "routing",
           "target_function"]
