"""Integrations with other tools' extension points (at the rollout level: they use schemas, transport and rollout
only)."""
