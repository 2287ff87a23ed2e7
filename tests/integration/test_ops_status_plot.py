"""``rlstream status`` and ``rlstream plot`` against the real broker and Redis; ``replay`` through the CLI."""
from __future__ import annotations

import asyncio
import json

from aiokafka import TopicPartition
from typer.testing import CliRunner

from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_consumer
from rlstream.schemas.config import dump_config
from rlstream.schemas.models import MetricEvent, PolicyVersion, TrajectoryEvent
from tests.support.factories import make_trajectory
from tests.support.ops_helpers import ops_app, publish, read_all
from tests.support.version_helpers import announce_versions


def config_file(rl_config, tmp_path) -> str:
    path = tmp_path / "rlstream.yaml"
    path.write_text(dump_config(rl_config))
    return str(path)


async def seed_deployment(cfg, names) -> None:
    """What running services leave behind: Redis keys, versions, metrics, a consumer group's commits."""
    plane = ControlPlane(cfg.redis.url)
    try:
        lease = await plane.acquire_lease(cfg.policy, "learner-a", ttl_s=60)
        assert lease is not None
        assert await plane.publish_latest(cfg.policy, 3, "file:///w/v3", "ab" * 32, lease)
        await plane.heartbeat_worker(cfg.policy, "worker-0", 3, "policy@3", ttl_s=60)
        await plane.heartbeat_worker(cfg.policy, "worker-1", 2, "policy@2", ttl_s=60)
        await plane.set_status(cfg.run_id, {"groups_trained": 12})
    finally:
        await plane.close()
    versions = [PolicyVersion(policy=cfg.policy, version=v, base_model="tiny", uri=f"file:///w/v{v}", learner_step=v,
                              run_id=cfg.run_id) for v in (1, 2, 3)]
    versions.append(PolicyVersion(policy=f"{cfg.policy}-another", version=9, base_model="tiny", uri="x",
                                  learner_step=9))
    await announce_versions(cfg, versions, lease=lease)
    metrics = [MetricEvent(source="learner", run_id=cfg.run_id, name=mn.LEARNER_LOSS, value=v, step=i)
               for i, v in enumerate([0.9, 0.5, 0.25])]
    metrics.append(MetricEvent(source="streams", run_id=cfg.run_id, name=mn.STREAMS_GROUPS_EMITTED, value=7))
    metrics.append(MetricEvent(source="streams", run_id="other", name=mn.STREAMS_GROUPS_EMITTED, value=99))
    await publish(cfg, names.metrics, metrics, lambda m: m.source)
    groups_placed = await publish(cfg, names.groups, [make_trajectory(example_id=f"e{i}") for i in range(6)],
                                  lambda t: t.example_id)  # any payload: only offsets matter for lag
    consumer = make_consumer(cfg.kafka, names.groups, group_id=f"learner-{cfg.run_id}")
    await consumer.start()
    try:
        partition = groups_placed[0][0]
        await consumer.commit({TopicPartition(names.groups, partition): 1})
    finally:
        await consumer.stop()


def test_status_json_and_table(rl_config, created_topics, tmp_path):
    asyncio.run(seed_deployment(rl_config, created_topics))
    cfg = config_file(rl_config, tmp_path)
    result = CliRunner().invoke(ops_app(), ["status", "--format", "json", "-c", cfg])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["latest"]["version"] == "3" and status["latest"]["uri"] == "file:///w/v3"
    assert status["lease_holder"].startswith("learner-a|")
    assert {w: info["version"] for w, info in status["workers"].items()} == {"worker-0": "3", "worker-1": "2"}
    assert [v["version"] for v in status["recent_versions"]] == [3, 2, 1]
    assert status["run_status"] == {"groups_trained": "12"}
    lags = {(g["group"], g["topic"]): g for g in status["lag"]}
    ours = lags[(f"learner-{rl_config.run_id}", created_topics.groups)]
    assert ours["committed"] == 1 and ours["lag"] == ours["end"] - 1 and ours["end"] >= 2
    latest = {(m["source"], m["name"]): m["value"] for m in status["metrics"]}
    assert latest == {("learner", mn.LEARNER_LOSS): 0.25, ("streams", mn.STREAMS_GROUPS_EMITTED): 7.0}
    assert status["errors"] == []

    result = CliRunner().invoke(ops_app(), ["status", "-c", cfg], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in ("learner-a", "worker-1", "file:///w/v3", f"learner-{rl_config.run_id}", mn.LEARNER_LOSS):
        assert text in result.stdout


def test_status_reports_an_unreachable_redis(rl_config, created_topics, tmp_path):
    cfg = config_file(rl_config, tmp_path)
    result = CliRunner().invoke(ops_app(), ["status", "--format", "json", "-c", cfg,
                                            "-o", "redis.url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert any("redis" in e for e in status["errors"]) and status["recent_versions"] == []


def test_plot_from_metrics_topic(rl_config, created_topics, tmp_path):
    run = rl_config.run_id
    tags = {mn.STEP_TAG: mn.STEP_EPOCH}
    events = [MetricEvent(source="finetune", run_id=run, name=mn.REWARD_MEAN, value=0.1 * e, step=e, tags=tags)
              for e in range(5)]
    events += [MetricEvent(source="finetune", run_id=run, name=mn.REWARD_MEAN_FILTERED, value=0.2 * e, step=e,
                           tags=tags) for e in range(5)]
    events += [MetricEvent(source="finetune", run_id=run, name=mn.VALIDATION_REWARD_MEAN, value=v, step=e, tags=tags)
               for e, v in ((0, 0.0), (2, 0.3), (4, 0.5))]
    events += [MetricEvent(source="finetune", run_id=run, name=mn.CURRICULUM_PERCENTILE, value=p, step=e, tags=tags)
               for e, p in enumerate([0.3, 0.3, 0.5, 0.5, 0.7])]
    # two reward events at one step average; another run's events are ignored
    events.append(MetricEvent(source="finetune", run_id=run, name=mn.REWARD_MEAN, value=0.5, step=4, tags=tags))
    events.append(MetricEvent(source="finetune", run_id="other", name=mn.REWARD_MEAN, value=50.0, step=1))
    asyncio.run(publish(rl_config, created_topics.metrics, events, lambda m: m.source))

    from rlstream.ops.plot import load_run_metrics

    metrics = asyncio.run(load_run_metrics(rl_config, run))
    assert metrics.step_kind == mn.STEP_EPOCH
    xs, ys = metrics.of(mn.REWARD_MEAN)[0].xy()
    assert xs == [0, 1, 2, 3, 4] and ys[:4] == [0.0, 0.1, 0.2, 0.1 * 3] and abs(ys[4] - 0.45) < 1e-9
    assert metrics.of(mn.VALIDATION_REWARD_MEAN)[0].xy() == ([0, 2, 4], [0.0, 0.3, 0.5])
    assert metrics.of(mn.CURRICULUM_PERCENTILE)[0].xy()[1] == [0.3, 0.3, 0.5, 0.5, 0.7]

    out = tmp_path / "plots" / "run.png"
    result = CliRunner().invoke(ops_app(), ["plot", "--run", run, "--out", str(out), "-c", config_file(rl_config, tmp_path)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "4 series, 18 points" in result.stdout

    result = CliRunner().invoke(ops_app(), ["plot", "--run", "no-such-run", "--out", str(tmp_path / "x.png"),
                                            "-c", config_file(rl_config, tmp_path)])
    assert result.exit_code == 1 and "no-such-run" in result.output and not (tmp_path / "x.png").exists()


def test_replay_through_the_cli(rl_config, created_topics, tmp_path):
    events = [make_trajectory(run_id=rl_config.run_id, example_id=f"e{i}", policy_version=i % 3) for i in range(9)]
    asyncio.run(publish(rl_config, created_topics.trajectories, events, lambda t: t.example_id))
    cfg = config_file(rl_config, tmp_path)
    result = CliRunner().invoke(ops_app(), ["replay", "--run-id", "cli-replay", "--min-version", "1", "--from-run",
                                            rl_config.run_id, "--format", "json", "-c", cfg])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["published"] == 6 and report["filtered"] == 3
    replayed = [e for _, _, e in asyncio.run(read_all(rl_config, created_topics.trajectories, TrajectoryEvent))
                if e.run_id == "cli-replay"]
    assert sorted(e.metadata["replay_of_trajectory_id"] for e in replayed) == \
        sorted(e.trajectory_id for e in events if e.policy_version >= 1)

    result = CliRunner().invoke(ops_app(), ["replay", "--run-id", "x", "--from", "sometime", "-c", cfg])
    assert result.exit_code == 2 and "ISO-8601" in result.output


def test_the_up_summary_reads_the_control_plane_again_at_the_end(rl_config) -> None:
    # `rlstream up --until-version N` stops as soon as version N is scored, which can be within the 2 s between two
    # polls of Redis: the summary must show what the workers have loaded then, not at the last poll
    from rlstream.ops.live import LiveFigures, Watcher

    async def scenario() -> list[dict[str, str]]:
        plane = ControlPlane(rl_config.redis.url)
        watcher = Watcher(rl_config, plane, LiveFigures())
        seen = []
        try:
            await plane.heartbeat_worker(rl_config.policy, "worker-0", 0, "base", ttl_s=60)
            await watcher.refresh_control()
            seen.append(dict(watcher.figures.loaded))
            await plane.heartbeat_worker(rl_config.policy, "worker-0", 2, "policy@2", ttl_s=60)
            await watcher.refresh_control()
            seen.append(dict(watcher.figures.loaded))
        finally:
            await plane.close()
        return seen

    assert asyncio.run(scenario()) == [{"worker-0": "0"}, {"worker-0": "2"}]


def test_the_up_summary_lists_the_versions_that_answered_production_calls_beside_the_promoted_ones(
        rl_config, created_topics) -> None:
    # the summary's promotion section: served_versions from the calls topic, promoted and canary versions from the
    # gate's decisions, and served_unvetted naming any version that answered production without passing the gate
    from rlstream.ops.live import LiveFigures, Watcher
    from rlstream.schemas.models import CallEvent, DecisionKind, Message, PromotionDecision

    names = created_topics
    answered = [0, 0, 2, 2, 2, 4, 5]  # 4 is a canary; 5 never passed the gate
    calls = [CallEvent(session_id=f"s{i}", policy=rl_config.policy, policy_version=v,
                       response_message=Message(role="assistant", content="b")) for i, v in enumerate(answered)]
    calls.append(CallEvent(session_id="s-end", kind="end", policy=rl_config.policy, policy_version=9))
    calls.append(CallEvent(session_id="s-other", policy="another-policy", policy_version=7))
    decisions = [PromotionDecision(policy=rl_config.policy, version=v, decision=d) for v, d in (
        (0, DecisionKind.promote), (2, DecisionKind.promote), (3, DecisionKind.reject), (4, DecisionKind.canary))]

    async def scenario() -> dict:
        await publish(rl_config, names.calls, calls, lambda c: c.session_id)
        await publish(rl_config, names.promotions, decisions, lambda d: d.policy)
        plane = ControlPlane(rl_config.redis.url)
        figures = LiveFigures()
        figures.promotion.gate = True
        watcher = Watcher(rl_config, plane, figures)
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.follow_topics(stop))
        try:
            for _ in range(100):
                if sum(figures.promotion.served_calls.values()) >= len(answered) and len(figures.promotion.marks) == 4:
                    break
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await task
            await plane.close()
        return figures.promotion.summary()

    summary = asyncio.run(scenario())
    assert summary["served_versions"] == {"0": 2, "2": 3, "4": 1, "5": 1}
    assert summary["promoted_versions"] == [0, 2]
    assert summary["canary_versions"] == [4]
    assert summary["served_unvetted"] == [5]
