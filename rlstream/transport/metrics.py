"""MetricEvents on the ``metrics`` topic, mirrored to a Prometheus endpoint.

Every service reports through one :class:`MetricsPublisher`, so the topic and the
Prometheus scrape show the same figures: each metric name becomes the gauge
``rlstream_<name>`` (non-alphanumerics replaced by ``_``) holding the last value, labelled by
the event's tags plus ``source`` and ``run_id``. Every metric name is a constant of
:mod:`rlstream.transport.metric_names`.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer

from rlstream.transport.log import get_logger
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import MetricEvent

log = get_logger(__name__)
_NOT_PROM = re.compile(r"[^a-zA-Z0-9_]")
_FIXED_LABELS = ("source", "run_id")
DEFAULT_PROMETHEUS_ADDR = "0.0.0.0"  # a scraper in another container or host must reach it


def prometheus_name(metric: str) -> str:
    """``validation/reward_mean`` -> ``rlstream_validation_reward_mean``."""
    return "rlstream_" + _NOT_PROM.sub("_", metric)


def label_name(tag: str) -> str:
    """A valid Prometheus label for a tag key (``tag_`` prefix when it would clash or start badly)."""
    clean = _NOT_PROM.sub("_", tag) or "tag"
    if clean[0].isdigit() or clean.startswith("__") or clean in _FIXED_LABELS:
        clean = "tag_" + clean
    return clean


@dataclass
class PrometheusEndpoint:
    """One HTTP endpoint with its registry and the gauges registered on it."""

    registry: Any
    port: int
    server: Any
    gauges: dict[str, tuple[Any, tuple[str, ...]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, event: MetricEvent) -> None:
        """Set the gauge of ``event.name`` to its value (labels fixed by the first event of that name)."""
        from prometheus_client import Gauge

        name = prometheus_name(event.name)
        labels = {label_name(k): v for k, v in event.tags.items()}
        labels.update(source=event.source, run_id=event.run_id)
        with self.lock:
            entry = self.gauges.get(name)
            if entry is None:
                names = tuple(sorted(labels))
                try:
                    gauge = Gauge(name, f"rlstream metric {event.name}", names, registry=self.registry)
                except ValueError as exc:  # e.g. two metric names that sanitise to the same gauge
                    log.warning("metric not mirrored to prometheus", metric=event.name, error=str(exc))
                    return
                entry = self.gauges[name] = (gauge, names)
            gauge, names = entry
        extra = sorted(set(labels) - set(names))
        if extra:
            log.debug("prometheus labels not in the first event of this metric; dropped", metric=event.name,
                      labels=extra)
        gauge.labels(**{n: labels.get(n, "") for n in names}).set(event.value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_ENDPOINTS: dict[tuple[str, int], PrometheusEndpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


def start_prometheus(port: int, addr: str = DEFAULT_PROMETHEUS_ADDR) -> PrometheusEndpoint:
    """Serve a registry on ``addr:port`` (0 = any free port; the bound one is ``.port``).

    Publishers of one process that ask for the same port share one endpoint.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    with _ENDPOINTS_LOCK:
        if port and (addr, port) in _ENDPOINTS:
            return _ENDPOINTS[(addr, port)]
        registry = CollectorRegistry()
        server, _thread = start_http_server(port, addr=addr, registry=registry)
        bound = int(server.server_address[1])
        endpoint = PrometheusEndpoint(registry=registry, port=bound, server=server)
        _ENDPOINTS[(addr, bound)] = endpoint
    log.info("prometheus endpoint", addr=addr, port=bound)
    return endpoint


def stop_prometheus(endpoint: PrometheusEndpoint) -> None:
    """Shut an endpoint down and forget it (tests; services keep theirs for the process lifetime)."""
    with _ENDPOINTS_LOCK:
        for key, value in list(_ENDPOINTS.items()):
            if value is endpoint:
                del _ENDPOINTS[key]
    endpoint.close()


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
        prometheus_addr: str = DEFAULT_PROMETHEUS_ADDR,
    ) -> None:
        self.producer = producer
        self.codec = codec
        self.topic = topic
        self.source = source
        self.run_id = run_id
        self.prometheus: PrometheusEndpoint | None = None
        if prometheus_port is not None:
            self.prometheus = start_prometheus(prometheus_port, prometheus_addr)

    @property
    def prometheus_port(self) -> int | None:
        """The port the Prometheus endpoint listens on (the bound one when 0 was asked for)."""
        return self.prometheus.port if self.prometheus else None

    async def emit(self, name: str, value: float, step: int | None = None, tags: dict[str, str] | None = None) -> None:
        """Publish one figure (fire-and-forget delivery; failures are logged, never raised)."""
        event = MetricEvent(source=self.source, run_id=self.run_id, name=name, value=float(value), step=step,
                            tags={str(k): str(v) for k, v in (tags or {}).items()})
        if self.prometheus is not None:
            try:
                self.prometheus.set(event)
            except Exception as exc:  # the mirror must never take a service down either
                log.warning("metric not mirrored to prometheus", metric=name, error=str(exc))
        try:
            await self.producer.send(self.topic, self.codec.encode(event), key=self.source.encode())
        except Exception as exc:  # metrics must never take a service down
            log.warning("metric not sent", metric=name, error=str(exc))

    async def emit_many(self, figures: dict[str, float], step: int | None = None, tags: dict[str, str] | None = None) -> None:
        """Publish several figures with the same step and tags."""
        for name, value in figures.items():
            await self.emit(name, value, step, tags)
