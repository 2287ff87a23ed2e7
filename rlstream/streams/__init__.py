"""The Faust stream app: validation, group assembly, filtering, curriculum (trajectories -> groups)."""
