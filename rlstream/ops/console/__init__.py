"""``rlstream console``: a read-only web page of a running stack, built from its topics and Redis (docs/console.md)."""
