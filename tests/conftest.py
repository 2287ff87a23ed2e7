"""Shared fixtures: one real broker (noida-db) and one real redis-server per test session,
a unique topic prefix, policy name and consumer group per test.

Tiers come from the directory: tests/unit -> ``unit``, tests/integration -> ``integration`` (real broker and
Redis), tests/chaos -> ``chaos`` (processes killed, brokers restarted), tests/e2e -> ``slow`` (real vLLM).
The run goes tier by tier in that order, so a broken unit shows in seconds, not after the vLLM tests.
"""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from rlstream.ops.infra import LocalStack
from rlstream.transport.log import configure_logging
from rlstream.schemas.config import RlstreamConfig, load_config
from rlstream.schemas.topics import TopicNames

TIER_BY_DIR = {"unit": "unit", "integration": "integration", "chaos": "chaos", "e2e": "slow"}
TIER_ORDER = ["unit", "integration", "chaos", "slow"]


def _tier(item: pytest.Item) -> str:
    parts = Path(str(item.fspath)).parts
    return next((marker for directory, marker in TIER_BY_DIR.items() if directory in parts), "slow")


#: Tests that must share one pytest-xdist worker (``--dist loadgroup``): the modules of the session's one vLLM
#: server (every module that uses ``vllm_fixture``); the whole-system runs (each starts its own vLLM and learner:
#: run side by side on 2 cores they starve each other's timing-based assertions); and each module whose module-scoped
#: fixtures are expensive.
#: Everything else is spread over the workers.
XDIST_GROUP_OF_MODULE = {
    "test_vllm_capture": "vllm", "test_vllm_runner": "vllm", "test_vllm_sync": "vllm", "test_finetune_toy": "vllm",
    "test_gateway": "vllm", "test_gateway_responses": "vllm", "test_gateway_agents_example": "vllm",
    "test_gateway_apis": "vllm",
    "test_nat_finetune": "vllm", "test_vllm_zombie_learner": "vllm",
    "test_nat_serve": "vllm", "test_nat_doc_configs": "vllm", "test_gate_vllm": "vllm",
    "test_tool_agent_data_path": "vllm", "test_shadow_sampling": "vllm", "test_gateway_fleet_vllm": "vllm",
    "test_vllm_fleet_switch": "vllm", "test_vllm_temperature": "vllm", "test_vllm_seeded_prefill": "vllm",
    "test_up_models_vllm": "vllm",
    "test_vllm_engine_restart": "vllm",  # a vLLM server of its own (it is killed), never beside the shared one's tests
    "test_vllm_api_key": "vllm-key",  # its module's keyed server, started once on one worker instead of on each
    "test_wheel_install": "up", "test_up_production": "up",
    "test_streams_recovery": "streams-chaos",
    "test_streams_shutdown": "streams-chaos",
    "test_streams_broker_kill": "streams-chaos",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker hook, which reads the groups to suffix the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, _tier(item)))
        group = XDIST_GROUP_OF_MODULE.get(Path(str(item.fspath)).stem)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: TIER_ORDER.index(_tier(item)))  # stable: file order kept within a tier


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a ``--dist loadgroup`` worker, every grouped test's node id carries its group (``...@vllm``): that suffix is
    all the scheduler groups by. pytest 9.2 derives node ids from a field pytest-xdist 3.8 does not set, which leaves
    every group spread over the workers without a word; this stops the run instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist's loadgroup did not group {len(lost)} tests (e.g. {lost[0]}): pin "
                                "a pytest whose node ids pytest-xdist can suffix (constraints-cpu.txt)")


@pytest.fixture(scope="session", autouse=True)
def _logging() -> None:
    configure_logging("console", level="WARNING")


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The session's broker and Redis (external ones when RLSTREAM_KAFKA_BOOTSTRAP / _REDIS_URL are set)."""
    stack = LocalStack.start(tmp_path_factory.mktemp("infra"))
    yield stack
    stack.stop()


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:10]


_redis_databases_handed_out = 0


@pytest.fixture
def own_redis_url(local_stack: LocalStack) -> str:
    """The session's Redis with a database of this test's own (emptied first), for whole-system runs whose
    policy name is fixed ("toy"): rlstream's keys are ``rlstream:{policy}:...`` (DESIGN.md), so two runs of one
    policy on one database share the latest-version pointer, and the second run's streams worker would drop
    every group of version 0 as stale against the first run's versions."""
    import redis

    global _redis_databases_handed_out
    _redis_databases_handed_out = _redis_databases_handed_out % 15 + 1  # 1..15; 0 is every other test's
    url = local_stack.redis_url.rsplit("/", 1)[0] + f"/{_redis_databases_handed_out}"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


@pytest.fixture
def rl_config(local_stack: LocalStack, unique: str, tmp_path: Path) -> RlstreamConfig:
    """A config pointing at the session's services, with names no other test uses."""
    return load_config(
        None,
        [
            ("kafka.bootstrap_servers", local_stack.bootstrap),
            ("kafka.session_timeout_ms", "6000"),
            ("redis.url", local_stack.redis_url),
            ("topics.prefix", f"t{unique}."),
            ("topics.partitions", "4"),
            ("run_id", f"run-{unique}"),
            ("policy", f"policy-{unique}"),
            ("streams.app_id", f"streams-{unique}"),
            ("streams.data_dir", str(tmp_path / "streams")),
            ("learner.output_dir", str(tmp_path / "learner")),
        ],
    )


@pytest.fixture
def topic_names(rl_config: RlstreamConfig) -> TopicNames:
    return TopicNames.from_config(rl_config.topics)


@pytest.fixture
def consumer_group(unique: str) -> str:
    return f"group-{unique}"


@pytest.fixture
def created_topics(rl_config: RlstreamConfig) -> TopicNames:
    """Every rlstream topic created under this test's prefix."""
    from rlstream.transport.kafka import create_topics

    asyncio.run(create_topics(rl_config.kafka, rl_config.topics))
    return TopicNames.from_config(rl_config.topics)
