"""The dashboard and the alert rules against a live service: a real streams worker assembles groups (some complete,
one filtered, one dead letter), its Prometheus endpoint is scraped, and every ``rlstream_streams_*`` series the dashboard or
the alerts name must be in that scrape (the unit tests check the names against the spec table; this checks them
against what a running worker really serves)."""
from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx

from rlstream.ops.ports import free_port
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from tests.support.factories import make_trajectory
from tests.support.streams_helpers import CODEC, Worker, interleaved_stream, publish, wait_for_count
from tests.unit.test_prometheus_assets import SERIES_NAME, alert_rules, dashboard_expressions


def scraped_series(text: str) -> set[str]:
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def missing_streams_series(expressions: list[str], served: set[str]) -> list[str]:
    """The streams-worker series named in ``expressions`` that the live scrape does not hold."""
    named = {name for e in expressions for name in SERIES_NAME.findall(e) if name.startswith("rlstream_streams_")}
    return sorted(named - served)


def test_every_streams_series_of_the_dashboard_and_alerts_is_served_by_a_live_worker(
        rl_config: RlstreamConfig, tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    records, expected = interleaved_stream(rl_config, n_examples=20, group_size=2, seed=3, late_fraction=0.2)
    garbage = [(names.trajectories, b"ex0", b"not avro")]  # one dead letter, so its counters exist
    flat = [(names.trajectories, b"flat", CODEC.encode(make_trajectory(  # all rewards equal: filtered
        run_id=rl_config.run_id, example_id="flat", group_size=2, generation_index=i, policy=rl_config.policy,
        reward=0.5, seed=i))) for i in range(2)]
    port = free_port()
    worker = Worker(rl_config, "w1", tmp_path, **{"streams.prometheus_port": port}).start()
    try:
        asyncio.run(publish(rl_config, records + garbage + flat))
        asyncio.run(wait_for_count(rl_config, names.groups, len(expected), timeout_s=90))
        expressions = [rule["expr"] for rule in alert_rules()] + dashboard_expressions()
        named = {n for e in expressions for n in SERIES_NAME.findall(e) if n.startswith("rlstream_streams_")}
        assert len(named) >= 5, named  # the check below has something to check
        deadline = time.monotonic() + 30  # totals reach the endpoint with the worker's next metrics report
        while True:
            served = scraped_series(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
            missing = missing_streams_series(expressions, served)
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert worker.alive(), worker.log_tail()
        assert not missing, f"named by the dashboard or alerts, not served by a live streams worker: {missing}"
        assert "process_cpu_seconds_total" in served
        # negative control: a name the worker does not serve is reported
        assert missing_streams_series(["rate(rlstream_streams_no_such_total[5m])"], served) == \
            ["rlstream_streams_no_such_total"]
    finally:
        worker.stop()
