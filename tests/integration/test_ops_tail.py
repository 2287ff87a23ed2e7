"""``rlstream tail`` against the real broker: JSON lines, run filter, lag, follow with a bound, live table."""
from __future__ import annotations

import asyncio
import io
import json

from typer.testing import CliRunner

from rlstream.ops.tail import TailOptions, run_tail
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import dump_config
from rlstream.schemas.models import DeadLetter, MetricEvent, PolicyVersion, TrajectoryGroup
from tests.support.factories import make_trajectory
from tests.support.ops_helpers import publish, publish_raw
from tests.support.ops_helpers import ops_app
from tests.support.version_helpers import announce_versions

CODEC = AvroCodec()


def metric(run: str, name: str, value: float, step: int | None = None, source: str = "learner") -> MetricEvent:
    return MetricEvent(source=source, run_id=run, name=name, value=value, step=step)


def group(run: str, example: str, rewards: list[float]) -> TrajectoryGroup:
    members = [make_trajectory(run_id=run, example_id=example, generation_index=i, group_size=len(rewards), reward=r)
               for i, r in enumerate(rewards)]
    mean = sum(rewards) / len(rewards)
    return TrajectoryGroup(group_id=members[0].group_id, run_id=run, example_id=example, policy="p",
                           min_policy_version=0, max_policy_version=0, expected_size=len(rewards),
                           trajectories=members, reward_mean=mean, reward_std=0.5, reward_min=min(rewards),
                           reward_max=max(rewards))


def config_file(rl_config, tmp_path):
    path = tmp_path / "rlstream.yaml"
    path.write_text(dump_config(rl_config))
    return str(path)


async def test_json_lines_with_run_filter_and_lag(rl_config, created_topics):
    run, other = rl_config.run_id, "other-run"
    events = [metric(run, "reward_mean", i / 10, step=i) for i in range(5)] + [metric(other, "reward_mean", 9.0)]
    await publish(rl_config, created_topics.metrics, events, lambda e: e.source)  # one key: one partition
    out = io.StringIO()
    shown = await run_tail(rl_config, "metrics", TailOptions(run=run, from_beginning=True), "json", out=out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert shown == len(lines) == 5
    assert [(r["run_id"], r["name"], r["value"], r["step"]) for r in lines] == \
        [(run, "reward_mean", i / 10, i) for i in range(5)]
    # the reader's lag: records still behind each one in its partition (the other run's event is last)
    assert [r["_kafka"]["lag"] for r in lines] == [5, 4, 3, 2, 1]
    assert {r["_kafka"]["topic"] for r in lines} == {created_topics.metrics}

    # without --from-beginning: the last N per partition
    out = io.StringIO()
    await run_tail(rl_config, "metrics", TailOptions(last=2), "json", out=out)
    assert [json.loads(line)["value"] for line in out.getvalue().splitlines()] == [0.4, 9.0]


async def test_follow_is_bounded_by_max_messages_and_idle_timeout(rl_config, created_topics):
    await publish(rl_config, created_topics.groups, [group("old", "ex-old", [0.0, 1.0])], lambda g: g.example_id)
    fresh = [group(rl_config.run_id, f"ex{i}", [0.0, 1.0, 1.0]) for i in range(3)]

    async def produce_later() -> None:
        await asyncio.sleep(1.0)
        for g in fresh:
            await publish(rl_config, created_topics.groups, [g], lambda g: g.example_id)

    out = io.StringIO()
    options = TailOptions(follow=True, last=0, max_messages=3, idle_timeout_s=20)
    shown, _ = await asyncio.wait_for(asyncio.gather(
        run_tail(rl_config, "groups", options, "json", out=out), produce_later()), timeout=30)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert shown == 3 and sorted(r["example_id"] for r in rows) == ["ex0", "ex1", "ex2"]
    assert all(len(r["trajectories"]) == 3 and r["run_id"] == rl_config.run_id for r in rows)

    # idle timeout: nothing new arrives, follow mode ends by itself
    out = io.StringIO()
    loop = asyncio.get_running_loop()
    began = loop.time()
    shown = await run_tail(rl_config, "groups", TailOptions(follow=True, last=0, idle_timeout_s=1.0), "json", out=out)
    assert shown == 0 and out.getvalue() == "" and 0.9 <= loop.time() - began < 10


def test_cli_follow_live_table_and_dlq_run_filter(rl_config, created_topics, tmp_path):
    mine = make_trajectory(run_id=rl_config.run_id, example_id="ex-mine")
    theirs = make_trajectory(run_id="someone-else", example_id="ex-theirs")
    letters = [
        DeadLetter(source_topic=created_topics.trajectories, source_partition=0, source_offset=i, key=b"k",
                   value=CODEC.encode(t), error_type="ValidationError", error_message=f"bad {t.example_id}",
                   service="streams")
        for i, t in enumerate([mine, theirs])
    ] + [DeadLetter(source_topic=created_topics.trajectories, source_partition=1, source_offset=7, key=None,
                    value=b"\x00garbage", error_type="CorruptPayloadError", error_message="unknown run", service="streams")]
    asyncio.run(publish(rl_config, created_topics.dlq, letters, lambda d: "k"))
    asyncio.run(publish_raw(rl_config, created_topics.dlq, b"not a dead letter", key=b"k"))
    cfg = config_file(rl_config, tmp_path)
    runner = CliRunner()

    result = runner.invoke(ops_app(), ["tail", "dlq", "--run", rl_config.run_id, "--from-beginning",
                                       "--format", "json", "-c", cfg])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r.get("error_message", r.get("_error", "")[:7]) for r in rows] == ["bad ex-mine", "unknown run", "Corrupt"]

    # follow mode renders a live table and stops on --idle-timeout; lag in the caption
    result = runner.invoke(ops_app(), ["tail", "dlq", "--follow", "--from-beginning", "--idle-timeout", "1",
                                       "--group", "nobody", "-c", cfg], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "bad ex-theirs" in result.stdout and "ValidationError" in result.stdout
    assert "reader lag 0" in result.stdout and "group nobody: no committed offsets" in result.stdout


def test_cli_tail_versions_table_and_missing_topic(rl_config, created_topics, tmp_path):
    versions = [PolicyVersion(policy=rl_config.policy, version=v, base_model="tiny", uri=f"file:///w/v{v}",
                              learner_step=v * 10, group_count=4, run_id=rl_config.run_id) for v in (1, 2)]
    asyncio.run(announce_versions(rl_config, versions))
    cfg = config_file(rl_config, tmp_path)
    result = CliRunner().invoke(ops_app(), ["tail", "versions", "-c", cfg], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "file:///w/v2" in result.stdout and "rlstream tail versions" in result.stdout

    result = CliRunner().invoke(ops_app(), ["tail", "metrics", "-c", cfg, "-o", "topics.prefix", "missing."])
    assert result.exit_code == 1 and "does not exist" in result.output
