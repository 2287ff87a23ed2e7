"""Operations: the CLI, the local infrastructure, Kafka admin and clients, the Redis control plane, logging."""
