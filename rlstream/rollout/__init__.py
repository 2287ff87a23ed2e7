"""Agent-side SDK (capture + publish), the reference rollout runner, and inference sync (-> trajectories).

What agent code imports::

    from rlstream.rollout import Recording, TrajectoryPublisher, instrument, target_function

Heavier parts live in their modules: ``rollout.runner`` (``rlstream rollout run``), ``rollout.sync``
(``rlstream inference sync``), ``rollout.vllm_backend``, ``rollout.manifest``.
"""
from rlstream.rollout.capture import WORKFLOW, Recording, instrument, routing, target_function
from rlstream.rollout.publisher import PublishError, TrajectoryPublisher

__all__ = ["WORKFLOW", "PublishError", "Recording", "TrajectoryPublisher", "instrument", "routing", "target_function"]
