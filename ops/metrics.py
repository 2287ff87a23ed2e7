"""MetricEvents on the ``metrics`` topic, mirrored to a Prometheus endpoint.

Every service reports through one :class:`MetricsPublisher`, so the topic and the
Prometheus scrape show the same figures.
"""
from __future__ import annotations

import re
from typing import Any

from aiokafka import AIOKafkaProducer

from ops.log import get_logger
from schemas.codec import AvroCodec
from schemas.models import MetricEvent

log = get_logger(__name__)
_PROM_NAME = re.compile(r"[^a-zA-Z0-9_]")


class MetricsPublisher:
    """Sends :class:`MetricEvent` records keyed by ``source``; optionally serves them to Prometheus."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        codec: AvroCodec,
        topic: str,
        source: str,
        run_id: str,
        prometheus_port: int | None = None,
    ) -> None:
        self.producer = producer
        self.codec = codec
        self.topic = topic
        self.source = source
        self.run_id = run_id
        self._gauges: dict[str, Any] = {}
        self._registry = None
        if prometheus_port is not None:
            self._registry = start_prometheus(prometheus_port)

    async def emit(self, name: str, value: float, step: int | None = None, tags: dict[str, str] | None = None) -> None:
        """Publish one figure (fire-and-forget delivery; failures are logged, never raised)."""
        event = MetricEvent(source=self.source, run_id=self.run_id, name=name, value=float(value), step=step,
                            tags=dict(tags or {}))
        self._mirror(event)
        try:
            await self.producer.send(self.topic, self.codec.encode(event), key=self.source.encode())
        except Exception as exc:  # metrics must never take a service down
            log.warning("metric not sent", metric=name, error=str(exc))

    async def emit_many(self, figures: dict[str, float], step: int | None = None, tags: dict[str, str] | None = None) -> None:
        for name, value in figures.items():
            await self.emit(name, value, step, tags)

    def _mirror(self, event: MetricEvent) -> None:
        if self._registry is None:
            return
        from prometheus_client import Gauge

        prom_name = "rlstream_" + _PROM_NAME.sub("_", event.name)
        label_names = tuple(sorted(event.tags)) + ("source", "run_id")
        key = prom_name + "|" + ",".join(label_names)
        gauge = self._gauges.get(key)
        if gauge is None:
            try:
                gauge = Gauge(prom_name, f"rlstream metric {event.name}", label_names, registry=self._registry)
            except ValueError:  # same name registered with other labels: keep the first
                return
            self._gauges[key] = gauge
        labels = {**event.tags, "source": event.source, "run_id": event.run_id}
        gauge.labels(**labels).set(event.value)


def start_prometheus(port: int) -> Any:
    """Serve a fresh registry on ``127.0.0.1:port`` (0 = any free port) and return it."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    start_http_server(port, addr="127.0.0.1", registry=registry)
    log.info("prometheus endpoint", port=port)
    return registry
