"""Prometheus export of MetricsPublisher: the scrape shows the figures that went to the metrics topic."""
from __future__ import annotations

import httpx

from rlstream.transport.kafka import make_producer
from rlstream.transport.metrics import MetricsPublisher, label_name, prometheus_name, start_prometheus, stop_prometheus
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import MetricEvent
from tests.ops_helpers import read_all


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
        await publisher.emit("reward_mean", 0.25, step=1, tags={"step_kind": "version"})
        await publisher.emit("reward_mean", 0.75, step=2, tags={"step_kind": "version"})
        await publisher.emit("validation/reward_mean", 0.5, step=2)
        # a later event of the same name with another tag set is still mirrored
        await publisher.emit("validation/reward_mean", 0.625, step=3, tags={"split": "holdout"})
        await publisher.emit("groups/filtered", 3, tags={"reason": "zero-variance", "source": "clash", "1x": "y"})
        await producer.flush()
        samples = scrape(publisher.prometheus_port)
    finally:
        stop_prometheus(publisher.prometheus)
        await producer.stop()

    run = rl_config.run_id
    assert samples[f'rlstream_reward_mean{{run_id="{run}",source="learner",step_kind="version"}}'] == 0.75
    assert samples[f'rlstream_validation_reward_mean{{run_id="{run}",source="learner"}}'] == 0.625
    filtered = [v for k, v in samples.items() if k.startswith("rlstream_groups_filtered{")]
    assert filtered == [3.0]
    assert any('reason="zero-variance"' in k and 'tag_source="clash"' in k and 'tag_1x="y"' in k
               for k in samples if k.startswith("rlstream_groups_filtered{"))

    # the topic holds the same figures: the last value of each name equals the scraped gauge
    events = [e for _, _, e in await read_all(rl_config, created_topics.metrics, MetricEvent)]
    last = {}
    for event in sorted(events, key=lambda e: e.ts):
        last[event.name] = event.value
    assert last == {"reward_mean": 0.75, "validation/reward_mean": 0.625, "groups/filtered": 3.0}
    assert {e.source for e in events} == {"learner"} and {e.run_id for e in events} == {run}


async def test_publishers_of_one_process_share_a_port(rl_config, created_topics):
    producer = make_producer(rl_config.kafka)
    await producer.start()
    first = start_prometheus(0)
    try:
        a = MetricsPublisher(producer, AvroCodec(), created_topics.metrics, "streams", "r", prometheus_port=first.port)
        b = MetricsPublisher(producer, AvroCodec(), created_topics.metrics, "learner", "r", prometheus_port=first.port)
        assert a.prometheus is b.prometheus is first
        await a.emit("groups/emitted", 4)
        await b.emit("learner/loss", 0.125, step=7)
        samples = scrape(first.port)
    finally:
        stop_prometheus(first)
        await producer.stop()
    assert samples['rlstream_groups_emitted{run_id="r",source="streams"}'] == 4.0
    assert samples['rlstream_learner_loss{run_id="r",source="learner"}'] == 0.125


def test_prometheus_names():
    assert prometheus_name("validation/reward_mean") == "rlstream_validation_reward_mean"
    assert prometheus_name("curriculum/percentile") == "rlstream_curriculum_percentile"
    assert label_name("run_id") == "tag_run_id"
    assert label_name("a-b") == "a_b"
    assert label_name("__x") == "tag___x"


async def test_emit_survives_a_stopped_producer(rl_config, created_topics):
    producer = make_producer(rl_config.kafka)
    await producer.start()
    await producer.stop()
    publisher = MetricsPublisher(producer, AvroCodec(), created_topics.metrics, "learner", "r", prometheus_port=0)
    try:
        await publisher.emit("reward_mean", 1.5)  # must not raise
        assert scrape(publisher.prometheus_port)['rlstream_reward_mean{run_id="r",source="learner"}'] == 1.5
    finally:
        stop_prometheus(publisher.prometheus)
