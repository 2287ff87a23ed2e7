"""Continuous mode reading prompts from a topic: good records become examples, bad ones are handed on."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from rlstream.transport.kafka import make_producer
from rlstream.rollout.runner import topic_examples
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames


def test_prompts_topic_yields_examples_and_reports_bad_records(rl_config: RlstreamConfig,
                                                               created_topics: TopicNames) -> None:
    topic = created_topics.trajectories.replace("trajectories", "prompts")

    async def scenario() -> tuple[list[tuple[dict[str, Any], int]], list[str]]:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        from rlstream.transport.kafka import client_options

        admin = AIOKafkaAdminClient(**client_options(rl_config.kafka))
        await admin.start()
        await admin.create_topics([NewTopic(topic, 1, 1)])
        await admin.close()
        producer = make_producer(rl_config.kafka)
        await producer.start()
        for value in (json.dumps({"id": "p1", "prompt": "a"}).encode(), b"{not json", json.dumps([1]).encode(),
                      json.dumps({"prompt": "no id"}).encode()):
            await producer.send_and_wait(topic, value)
        await producer.stop()
        stop = asyncio.Event()
        bad: list[str] = []

        async def on_bad(record: Any, exc: Exception) -> None:
            bad.append(record.value.decode(errors="replace"))

        got: list[tuple[dict[str, Any], int]] = []
        async for example, offset in topic_examples(rl_config, topic, stop, on_bad_record=on_bad):
            got.append((example, offset))
            if len(got) == 2:
                stop.set()
        return got, bad

    got, bad = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [(e["id"], off) for e, off in got] == [("p1", 0), ("0-3", 3)]
    assert bad == ["{not json", "[1]"]
