"""The Prometheus mirror of MetricEvents follows ``metric_names.SPECS``: counters add up (``_total``), histograms
observe seconds, gauges hold the last value, only declared tags become labels, and every endpoint serves the
process/GC/platform collectors. Read through ``generate_latest`` of the endpoint's registry or its HTTP port."""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client import generate_latest

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import MetricEvent
from rlstream.transport import metric_names as mn
from rlstream.transport.metrics import (MetricsPublisher, PrometheusEndpoint, metric_spec, prometheus_name,
                                        start_prometheus, stop_prometheus)

pytestmark = pytest.mark.unit

#: Tags that must never become labels: one series per example, trajectory or error text.
UNBOUNDED_TAGS = {"example_id", "trajectory_id", "group_id", "error", "policy_version"}


@pytest.fixture
def endpoint() -> Iterator[PrometheusEndpoint]:
    served = start_prometheus(0, addr="127.0.0.1")
    try:
        yield served
    finally:
        stop_prometheus(served)


def exposition(endpoint: PrometheusEndpoint) -> str:
    return generate_latest(endpoint.registry).decode()


def samples(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of every sample line of an exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def event(name: str, value: float, source: str = "svc", **tags: str) -> MetricEvent:
    return MetricEvent(source=source, run_id="r", name=name, value=value, tags=tags)


def test_a_counter_of_increments_adds_up_and_drops_undeclared_tags(endpoint: PrometheusEndpoint) -> None:
    for version in ("1", "2", "3"):  # rollout/published: value 1 per trajectory, tag policy_version
        endpoint.record(event(mn.ROLLOUT_PUBLISHED, 1.0, source="rollout", policy_version=version))
    text = exposition(endpoint)
    assert samples(text)['rlstream_rollout_published_total{run_id="r",source="rollout"}'] == 3.0
    assert "# TYPE rlstream_rollout_published_total counter" in text
    assert "policy_version" not in text


def test_error_text_and_example_ids_are_never_labels(endpoint: PrometheusEndpoint) -> None:
    endpoint.record(event(mn.ROLLOUT_GENERATION_FAILED, 1.0, source="rollout", example_id="ex-17",
                          error="RuntimeError: boom"))
    text = exposition(endpoint)
    assert samples(text)['rlstream_rollout_generation_failed_total{run_id="r",source="rollout"}'] == 1.0
    assert "example_id" not in text and "ex-17" not in text and "boom" not in text


def test_a_counter_of_running_totals_adds_the_growth(endpoint: PrometheusEndpoint) -> None:
    """The stream app reports totals since the worker started: 2, 5, 5 is 5 in all; a smaller total (the emitter
    started again) counts from zero."""
    for total in (2.0, 5.0, 5.0):
        endpoint.record(event(mn.STREAMS_GROUPS_EMITTED, total, worker="w1", reason="full"))
    endpoint.record(event(mn.STREAMS_GROUPS_EMITTED, 4.0, worker="w2", reason="full"))
    series = 'rlstream_streams_groups_emitted_total{reason="full",run_id="r",source="svc",worker="%s"}'
    assert samples(exposition(endpoint))[series % "w1"] == 5.0
    endpoint.record(event(mn.STREAMS_GROUPS_EMITTED, 1.0, worker="w1", reason="full"))
    found = samples(exposition(endpoint))
    assert found[series % "w1"] == 6.0 and found[series % "w2"] == 4.0


def test_a_histogram_observes_seconds(endpoint: PrometheusEndpoint) -> None:
    endpoint.record(event(mn.INFERENCE_LOAD_SECONDS, 0.3, worker="w"))
    endpoint.record(event(mn.INFERENCE_LOAD_SECONDS, 2.0, worker="w"))
    text = exposition(endpoint)
    found = samples(text)
    labels = 'run_id="r",source="svc",worker="w"'
    assert "# TYPE rlstream_inference_load_seconds histogram" in text
    assert found[f'rlstream_inference_load_seconds_bucket{{le="0.25",{labels}}}'] == 0.0
    assert found[f'rlstream_inference_load_seconds_bucket{{le="0.5",{labels}}}'] == 1.0
    assert found[f'rlstream_inference_load_seconds_bucket{{le="+Inf",{labels}}}'] == 2.0
    assert found[f"rlstream_inference_load_seconds_count{{{labels}}}"] == 2.0
    assert found[f"rlstream_inference_load_seconds_sum{{{labels}}}"] == pytest.approx(2.3)


def test_a_gauge_holds_the_last_value(endpoint: PrometheusEndpoint) -> None:
    for lag in (3.0, 1.0):
        endpoint.record(event(mn.LEARNER_POLICY_LAG_MAX, lag, source="learner", policy="p", step_kind="step"))
    text = exposition(endpoint)
    assert samples(text)['rlstream_learner_policy_lag_max{policy="p",run_id="r",source="learner"}'] == 1.0
    assert "# TYPE rlstream_learner_policy_lag_max gauge" in text


def test_undeclared_and_topic_only_names(endpoint: PrometheusEndpoint) -> None:
    """An undeclared name is a gauge with only source and run_id; a topic-only name is not served."""
    endpoint.record(event("custom/thing-count", 4.0, reason="x"))
    endpoint.record(event(mn.STREAMS_DLQ_TOTAL, 9.0, worker="w"))
    found = samples(exposition(endpoint))
    assert found['rlstream_custom_thing_count{run_id="r",source="svc"}'] == 4.0
    assert not [k for k in found if "dlq" in k or "dead_letters" in k]
    assert prometheus_name(mn.STREAMS_DLQ_TOTAL) is None
    assert prometheus_name(mn.VALIDATION_REWARD_MEAN) == "rlstream_validation_reward_mean"


def test_process_gc_and_platform_collectors_are_served(endpoint: PrometheusEndpoint) -> None:
    found = samples(exposition(endpoint))
    names = {series.split("{")[0] for series in found}
    assert {"python_gc_objects_collected_total", "python_info"} <= names
    if sys.platform.startswith("linux"):
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names


def test_the_http_endpoint_serves_the_mirror(endpoint: PrometheusEndpoint) -> None:
    endpoint.record(event(mn.LEARNER_SECONDS, 1.5, source="learner", policy="p"))
    text = httpx.get(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5).text
    assert samples(text)['rlstream_learner_step_seconds_count{policy="p",run_id="r",source="learner"}'] == 1.0
    assert "process_cpu_seconds_total" in text or not sys.platform.startswith("linux")


def test_every_spec_follows_the_conventions() -> None:
    assert set(mn.SPECS) == set(mn.ALL)
    served = [s for s in mn.SPECS.values() if s.prometheus is not None]
    names = [s.prometheus for s in served]
    assert len(names) == len(set(names)), "two metric names share a Prometheus name"
    for spec in mn.SPECS.values():
        assert spec.name in mn.SPECS and mn.SPECS[spec.name] is spec
        if spec.prometheus is None:
            assert spec.topic, f"{spec.name}: neither on the topic nor on Prometheus"
            continue
        assert re.fullmatch(r"rlstream_[a-z0-9_]+", spec.prometheus), spec
        assert spec.prometheus.endswith("_total") == (spec.kind == "counter"), spec
        if spec.kind == "histogram":
            assert spec.prometheus.endswith("_seconds") and list(spec.buckets) == sorted(spec.buckets), spec
        assert not spec.cumulative or spec.kind == "counter", spec
        assert not set(spec.labels) & (set(mn.FIXED_LABELS) | UNBOUNDED_TAGS | {"le"}), spec
        assert all(re.fullmatch(r"[a-z][a-z0-9_]*", label) for label in spec.labels), spec
        assert spec.help, spec
    # a duration emitted in seconds is a histogram, a per-event count a counter
    assert metric_spec(mn.STREAMS_ASSEMBLY_LATENCY_S).kind == "histogram"
    assert metric_spec(mn.GATEWAY_OVERHEAD_S).kind == "histogram"
    assert metric_spec(mn.LEARNER_SECONDS).kind == "histogram"
    assert metric_spec(mn.ROLLOUT_PUBLISHED).kind == "counter"


async def test_gateway_reports_its_overhead_to_prometheus_only(endpoint: PrometheusEndpoint) -> None:
    """A captured call through the gateway is one observation of ``rlstream_gateway_overhead_seconds``; the producer
    is never started (the gateway's figures do not go to the metrics topic)."""
    from tests.unit.test_gateway_sessions import USER, FakePublisher, fake_upstream

    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:9")  # never started: a send would fail and be logged
    metrics = MetricsPublisher(producer, AvroCodec(), "metrics", "gateway", "r", prometheus_port=endpoint.port,
                               prometheus_addr="127.0.0.1")
    assert metrics.prometheus is endpoint
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p"), FakePublisher(), metrics=metrics,
                      client=httpx.AsyncClient(transport=httpx.MockTransport(fake_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            for _ in range(2):
                r = await c.post("/v1/chat/completions", content=json.dumps({"model": "m", "messages": [USER]}))
                assert r.status_code == 200
    finally:
        await gateway.stop()
        await producer.stop()
    found = samples(exposition(endpoint))
    labels = 'route="chat_completions",run_id="r",source="gateway",streamed="false"'
    assert found[f"rlstream_gateway_overhead_seconds_count{{{labels}}}"] == 2.0
    assert 0 < found[f"rlstream_gateway_overhead_seconds_sum{{{labels}}}"] < 2.0
    assert not metric_spec(mn.GATEWAY_OVERHEAD_S).topic
