"""MetricEvents on the ``metrics`` topic, mirrored to a Prometheus endpoint.

Every service reports through one :class:`MetricsPublisher`, so the topic and the Prometheus scrape show the same
figures. The mirror follows :data:`~rlstream.transport.metric_names.SPECS`: a counter adds each event's value (or,
``cumulative``, the growth of the running total it carries), a histogram observes it, a gauge holds the last value;
labels are ``source``, ``run_id`` and the spec's declared tags (other tags are dropped from the series). A name the
table does not declare is mirrored as a gauge ``rlstream_<name>`` (non-alphanumerics replaced by ``_``) with only
``source`` and ``run_id`` as labels, logged once at debug level. Each endpoint also serves the process, GC and
platform collectors of ``prometheus_client`` (``process_cpu_seconds_total``, ``python_gc_*``, ``python_info``).
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer

from rlstream.transport.log import get_logger
from rlstream.transport.metric_names import FIXED_LABELS, SPECS, MetricSpec
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import MetricEvent

log = get_logger(__name__)
_NOT_PROM = re.compile(r"[^a-zA-Z0-9_]")
#: Where a Prometheus endpoint binds unless told otherwise: loopback (the process's figures are not for the
#: network at large); ``metrics_host`` in the config (:func:`set_default_prometheus_addr`, called by the CLI) widens it
#: for a scraper on another host or container.
DEFAULT_PROMETHEUS_ADDR = "127.0.0.1"
_default_addr = DEFAULT_PROMETHEUS_ADDR


def set_default_prometheus_addr(addr: str) -> None:
    """The address this process's Prometheus endpoints bind when their caller names none (config ``metrics_host``)."""
    global _default_addr
    _default_addr = addr


def default_prometheus_addr() -> str:
    return _default_addr


def metric_spec(metric: str) -> MetricSpec:
    """The declared spec of a metric name, or for an undeclared one a gauge ``rlstream_<name>`` without labels."""
    declared = SPECS.get(metric)
    if declared is not None:
        return declared
    return MetricSpec(metric, "gauge", "rlstream_" + _NOT_PROM.sub("_", metric), (), f"rlstream metric {metric} "
                      "(not declared in metric_names.SPECS)")


def prometheus_name(metric: str) -> str | None:
    """``validation/reward_mean`` -> ``rlstream_validation_reward_mean``; None for a name kept off Prometheus."""
    return metric_spec(metric).prometheus


@dataclass
class MirroredMetric:
    """One metric of an endpoint: its prometheus_client object and spec, and for a counter fed running totals the
    last total seen per label values."""

    spec: MetricSpec
    metric: Any
    label_names: tuple[str, ...]
    last_totals: dict[tuple[str, ...], float] = field(default_factory=dict)

    def record(self, event: MetricEvent) -> None:
        """Add, observe or set ``event.value`` on the series of the event's labels (caller holds the endpoint lock)."""
        tags = {**event.tags, "source": event.source, "run_id": event.run_id}
        values = tuple(tags.get(name, "") for name in self.label_names)
        series = self.metric.labels(*values)
        if self.spec.kind == "gauge":
            series.set(event.value)
        elif self.spec.kind == "histogram":
            series.observe(event.value)
        else:
            increment = event.value
            if self.spec.cumulative:
                last = self.last_totals.get(values, 0.0)
                increment = event.value - last if event.value >= last else event.value  # smaller: emitter restarted
                self.last_totals[values] = event.value
            if increment < 0:
                log.debug("negative counter increment not mirrored to prometheus", metric=event.name,
                          value=event.value)
                return
            series.inc(increment)


def new_metric(spec: MetricSpec, registry: Any) -> MirroredMetric:
    """Register the prometheus_client counter, gauge or histogram of ``spec`` on ``registry``."""
    from prometheus_client import Counter, Gauge, Histogram

    assert spec.prometheus is not None
    label_names = FIXED_LABELS + spec.labels
    help_text = spec.help or f"rlstream metric {spec.name}"
    if spec.kind == "counter":
        metric: Any = Counter(spec.prometheus, help_text, label_names, registry=registry)
    elif spec.kind == "histogram":
        metric = Histogram(spec.prometheus, help_text, label_names, registry=registry, buckets=spec.buckets)
    else:
        metric = Gauge(spec.prometheus, help_text, label_names, registry=registry)
    return MirroredMetric(spec, metric, label_names)


@dataclass
class PrometheusEndpoint:
    """One HTTP endpoint with its registry and the metrics mirrored on it (by metric name)."""

    registry: Any
    port: int
    server: Any
    metrics: dict[str, MirroredMetric | None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, event: MetricEvent) -> None:
        """Mirror one event as its spec says (nothing for a name kept off Prometheus)."""
        with self.lock:
            if event.name not in self.metrics:
                self.metrics[event.name] = self._register(event.name)
            mirrored = self.metrics[event.name]
            if mirrored is not None:
                mirrored.record(event)

    def _register(self, name: str) -> MirroredMetric | None:
        spec = metric_spec(name)
        if spec.prometheus is None:
            return None
        if name not in SPECS:
            log.debug("metric not declared in metric_names.SPECS; mirrored as a gauge without tags", metric=name,
                      prometheus=spec.prometheus)
        try:
            return new_metric(spec, self.registry)
        except ValueError as exc:  # e.g. an undeclared name that sanitises to a registered one
            log.warning("metric not mirrored to prometheus", metric=name, error=str(exc))
            return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_ENDPOINTS: dict[tuple[str, int], PrometheusEndpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


def start_prometheus(port: int, addr: str | None = None) -> PrometheusEndpoint:
    """Serve a registry (with the process, GC and platform collectors) on ``addr:port`` (0 = any free port; the bound
    one is ``.port``).

    Publishers of one process that ask for the same port share one endpoint.
    """
    from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, start_http_server

    addr = addr or default_prometheus_addr()
    with _ENDPOINTS_LOCK:
        if port and (addr, port) in _ENDPOINTS:
            return _ENDPOINTS[(addr, port)]
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
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
        prometheus_addr: str | None = None,
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
        """Publish one figure (fire-and-forget delivery; failures are logged, never raised); a name whose spec says
        ``topic=False`` goes to Prometheus only."""
        event = MetricEvent(source=self.source, run_id=self.run_id, name=name, value=float(value), step=step,
                            tags={str(k): str(v) for k, v in (tags or {}).items()})
        if self.prometheus is not None:
            try:
                self.prometheus.record(event)
            except Exception as exc:  # the mirror must never take a service down either
                log.warning("metric not mirrored to prometheus", metric=name, error=str(exc))
        if not metric_spec(name).topic:
            return
        try:
            await self.producer.send(self.topic, self.codec.encode(event), key=self.source.encode())
        except Exception as exc:  # metrics must never take a service down
            log.warning("metric not sent", metric=name, error=str(exc))

    async def emit_many(self, figures: dict[str, float], step: int | None = None, tags: dict[str, str] | None = None) -> None:
        """Publish several figures with the same step and tags."""
        for name, value in figures.items():
            await self.emit(name, value, step, tags)
