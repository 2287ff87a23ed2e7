"""The GRPO learner: batching, loss, checkpoints, weight publication (groups -> policy-versions)."""
