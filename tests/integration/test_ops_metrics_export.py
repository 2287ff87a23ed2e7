"""Prometheus export of MetricsPublisher: the topic carries every event as emitted, the scrape serves them as
``metric_names.SPECS`` declares (counters add up, histograms observe, gauges hold the last value)."""
from __future__ import annotations

import httpx

from rlstream.transport import metric_names as mn
from rlstream.transport.kafka import make_producer
from rlstream.transport.metrics import MetricsPublisher, prometheus_name, start_prometheus, stop_prometheus
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import MetricEvent
from tests.support.ops_helpers import read_all


def scrape(port: int) -> dict[str, float]:
    """``{'name{labels}': value}`` of every sample line of the endpoint."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


async def test_scrape_matches_metrics_topic(rl_config, created_topics):
    producer = make_producer(rl_config.kafka)
    await producer.start()
    publisher = MetricsPublisher(producer, AvroCodec(), created_topics.metrics, "learner", rl_config.run_id,
                                 prometheus_port=0)
    try:
        assert publisher.prometheus_port and publisher.prometheus_port > 0
        await publisher.emit(mn.REWARD_MEAN, 0.25, step=1, tags={"step_kind": "version", "policy": "p"})
        await publisher.emit(mn.REWARD_MEAN, 0.75, step=2, tags={"step_kind": "version", "policy": "p"})
        for version in (1, 2, 2):
            await publisher.emit(mn.ROLLOUT_PUBLISHED, 1.0, tags={"policy_version": str(version)})
        await publisher.emit(mn.LEARNER_SECONDS, 0.4, step=1, tags={"policy": "p"})
        await publisher.emit("custom/figure", 3, tags={"reason": "any"})  # not declared: a gauge without tags
        await publisher.emit(mn.GATEWAY_OVERHEAD_S, 0.002, tags={"route": "chat_completions", "streamed": "false"})
        await producer.flush()
        samples = scrape(publisher.prometheus_port)
    finally:
        stop_prometheus(publisher.prometheus)
        await producer.stop()

    run = rl_config.run_id
    assert samples[f'rlstream_reward_mean{{policy="p",run_id="{run}",source="learner",step_kind="version"}}'] == 0.75
    assert samples[f'rlstream_rollout_published_total{{run_id="{run}",source="learner"}}'] == 3.0
    assert samples[f'rlstream_learner_step_seconds_count{{policy="p",run_id="{run}",source="learner"}}'] == 1.0
    assert samples[f'rlstream_custom_figure{{run_id="{run}",source="learner"}}'] == 3.0
    assert samples[f'rlstream_gateway_overhead_seconds_count{{route="chat_completions",run_id="{run}",'
                   f'source="learner",streamed="false"}}'] == 1.0
    assert not [k for k in samples if "policy_version" in k]

    # the topic holds every event as emitted (tags included), except the Prometheus-only gateway figure
    events = sorted([e for _, _, e in await read_all(rl_config, created_topics.metrics, MetricEvent)],
                    key=lambda e: e.ts)
    assert [(e.name, e.value) for e in events] == [
        (mn.REWARD_MEAN, 0.25), (mn.REWARD_MEAN, 0.75), (mn.ROLLOUT_PUBLISHED, 1.0), (mn.ROLLOUT_PUBLISHED, 1.0),
        (mn.ROLLOUT_PUBLISHED, 1.0), (mn.LEARNER_SECONDS, 0.4), ("custom/figure", 3.0)]
    assert [e.tags.get("policy_version") for e in events if e.name == mn.ROLLOUT_PUBLISHED] == ["1", "2", "2"]
    assert {e.source for e in events} == {"learner"} and {e.run_id for e in events} == {run}


async def test_publishers_of_one_process_share_a_port(rl_config, created_topics):
    producer = make_producer(rl_config.kafka)
    await producer.start()
    first = start_prometheus(0)
    try:
        a = MetricsPublisher(producer, AvroCodec(), created_topics.metrics, "streams", "r", prometheus_port=first.port)
        b = MetricsPublisher(producer, AvroCodec(), created_topics.metrics, "learner", "r", prometheus_port=first.port)
        assert a.prometheus is b.prometheus is first
        await a.emit(mn.STREAMS_GROUPS_EMITTED, 4, tags={"worker": "w", "reason": "full"})
        await b.emit(mn.LEARNER_LOSS, 0.125, step=7, tags={"step_kind": "step", "policy": "p"})
        samples = scrape(first.port)
    finally:
        stop_prometheus(first)
        await producer.stop()
    assert samples['rlstream_streams_groups_emitted_total{reason="full",run_id="r",source="streams",worker="w"}'] == 4.0
    assert samples['rlstream_learner_loss{policy="p",run_id="r",source="learner",step_kind="step"}'] == 0.125


def test_prometheus_names():
    assert prometheus_name(mn.VALIDATION_REWARD_MEAN) == "rlstream_validation_reward_mean"
    assert prometheus_name(mn.STREAMS_DLQ) == "rlstream_streams_dead_letters_total"
    assert prometheus_name(mn.LEARNER_SECONDS) == "rlstream_learner_step_seconds"
    assert prometheus_name(mn.STREAMS_EVENTS_IN_PER_S) is None  # Prometheus computes the rate itself
    assert prometheus_name("not/declared-x") == "rlstream_not_declared_x"


async def test_emit_survives_a_stopped_producer(rl_config, created_topics):
    producer = make_producer(rl_config.kafka)
    await producer.start()
    await producer.stop()
    publisher = MetricsPublisher(producer, AvroCodec(), created_topics.metrics, "learner", "r", prometheus_port=0)
    try:
        await publisher.emit(mn.REWARD_MEAN, 1.5)  # must not raise
        samples = scrape(publisher.prometheus_port)
        assert samples['rlstream_reward_mean{policy="",run_id="r",source="learner",step_kind=""}'] == 1.5
    finally:
        stop_prometheus(publisher.prometheus)
