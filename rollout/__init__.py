"""Agent-side SDK (capture + publish), the reference rollout runner, and inference sync (-> trajectories)."""
