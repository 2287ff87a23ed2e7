"""On the real broker: the learner skips and counts groups of other policies and runs and validation groups,
dead-letters what it cannot tokenise (and what does not decode) and trains on; the version's ``trained_on`` lists
exactly the groups trained; ``rlstream lineage`` resolves it to those groups and their trajectory offsets."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.learner.reporting import ReportingError, check_report_to
from rlstream.learner.service import Learner
from rlstream.ops.lineage import RecordRef, version_lineage
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig, dump_config
from rlstream.schemas.models import (DeadLetter, MetricEvent, PolicyVersion, SourceOffset, TrajectoryGroup,
                                     TrajectorySource)
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.kafka import make_producer
from tests.support.learner_helpers import random_group, read_topic, tiny_model

CODEC = AvroCodec()
PARTITION = 0


async def place(cfg: RlstreamConfig, topic: str, values: list[tuple[bytes, bytes]]) -> list[int]:
    """Send raw (key, value) records to one partition, in order; their offsets."""
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        return [(await producer.send_and_wait(topic, value, key=key, partition=PARTITION)).offset
                for key, value in values]
    finally:
        await producer.stop()


def _with_sources(group: TrajectoryGroup, names: TopicNames, first: int) -> TrajectoryGroup:
    """The group as the stream app emits it: where each member (and one late reward) was read."""
    offsets = [SourceOffset(topic=names.trajectories, partition=2, offset=first + i)
               for i in range(len(group.trajectories))]
    offsets.append(SourceOffset(topic=names.rewards, partition=1, offset=first))
    return group.model_copy(update={"source_offsets": offsets})


def test_skips_dead_letters_and_exact_lineage(rl_config: RlstreamConfig, created_topics: TopicNames,
                                              tmp_path: Path) -> None:
    try:
        check_report_to(["tensorboard"])
        report_to = ["tensorboard"]
    except ReportingError:
        report_to = []
    cfg = rl_config.model_copy(update={"learner": rl_config.learner.model_copy(update={
        "model": str(tiny_model(tmp_path)), "lora": rl_config.learner.lora.model_copy(update={"enabled": True}),
        "groups_per_step": 2, "publish_every": 1, "total_steps": 1, "device": "cpu", "lease_ttl_s": 3.0,
        "run_ids": [rl_config.run_id], "report_to": report_to})})
    names = created_topics
    good_a = _with_sources(random_group(cfg.policy, cfg.run_id, 1), names, first=10)
    good_b = _with_sources(random_group(cfg.policy, cfg.run_id, 2), names, first=20)
    other_policy = random_group("another-policy", cfg.run_id, 3)
    other_run = random_group(cfg.policy, "another-run", 4)
    validation = random_group(cfg.policy, cfg.run_id, 5)
    for trajectory in validation.trajectories:
        trajectory.source = TrajectorySource.validation
    out_of_vocab = random_group(cfg.policy, cfg.run_id, 6)
    out_of_vocab.trajectories[1].turns[0].completion_token_ids = [5, 10 ** 6]
    never_read = random_group(cfg.policy, cfg.run_id, 7)
    records = [(b"bad", CODEC.encode(good_a)[:40]), (b"other", CODEC.encode(other_policy)),
               (b"a", CODEC.encode(good_a)), (b"run", CODEC.encode(other_run)), (b"val", CODEC.encode(validation)),
               (b"oov", CODEC.encode(out_of_vocab)), (b"b", CODEC.encode(good_b)), (b"c", CODEC.encode(never_read))]
    offsets = asyncio.run(place(cfg, names.groups, records))

    learner = Learner(cfg, holder="lineage-test")
    state = asyncio.run(learner.run())

    # the learner went on past every bad record and trained on exactly the two usable groups
    assert state.step == 1 and state.offsets == {PARTITION: offsets[6] + 1} and state.groups_trained == 2
    assert dict(learner.skipped) == {"other_policy": 1, "other_run": 1, "validation": 1}
    base, version = asyncio.run(read_topic(cfg, names.policy_versions, PolicyVersion, expect=2))
    assert (base.version, base.group_count, base.trained_on) == (0, 0, [])  # the base weights, announced first
    assert version.version == 1 and version.group_count == 2
    assert [(r.topic, r.partition, r.first, r.last) for r in version.trained_on] == [
        (names.groups, PARTITION, offsets[2], offsets[2]), (names.groups, PARTITION, offsets[6], offsets[6])]

    # dead letters: what does not decode and what cannot be tokenised; skipped groups are not errors
    letters = sorted(asyncio.run(read_topic(cfg, names.dlq, DeadLetter, expect=2)), key=lambda d: d.source_offset)
    assert [(d.source_offset, d.key, d.error_type, d.service) for d in letters] == [
        (offsets[0], b"bad", "CorruptPayloadError", "learner"), (offsets[5], b"oov", "BatchError", "learner")]
    assert "outside the model's vocabulary" in letters[1].error_message

    # one step: its figures, three skip counters, the dead-letter total and the version's reward_mean
    metrics = asyncio.run(read_topic(cfg, names.metrics, MetricEvent, expect=len(mn.LEARNER) + 5))
    skipped = {m.tags["reason"]: m.value for m in metrics if m.name == mn.LEARNER_GROUPS_SKIPPED}
    assert skipped == {"other_policy": 1.0, "other_run": 1.0, "validation": 1.0}
    assert [m.value for m in metrics if m.name == mn.LEARNER_DLQ_TOTAL] == [2.0]
    assert [m.value for m in metrics if m.name == mn.LEARNER_GROUPS] == [2.0]
    if report_to:
        assert list((Path(cfg.learner.output_dir) / "logs").glob("events.out.tfevents.*"))

    # lineage: version -> groups -> trajectory offsets
    lineage = asyncio.run(version_lineage(cfg, 1))
    assert [(g.partition, g.offset, g.group_id) for g in lineage.groups] == [
        (PARTITION, offsets[2], good_a.group_id), (PARTITION, offsets[6], good_b.group_id)]
    assert lineage.groups[0].trajectory_ids == [t.trajectory_id for t in good_a.trajectories]
    assert lineage.trajectory_offsets == [RecordRef(names.trajectories, 2, 10 + i) for i in range(4)] + \
        [RecordRef(names.trajectories, 2, 20 + i) for i in range(4)]
    assert lineage.groups[1].rewards == [RecordRef(names.rewards, 1, 20)]
    assert lineage.unresolved == []

    config = tmp_path / "rlstream.yaml"
    config.write_text(dump_config(cfg))
    runner = CliRunner()
    result = runner.invoke(app, ["lineage", "1", "--format", "json", "-c", str(config)])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["version"] == 1 and shown["policy"] == cfg.policy and shown["group_count"] == 2
    assert [(g["offset"], g["group_id"]) for g in shown["groups"]] == [(offsets[2], good_a.group_id),
                                                                      (offsets[6], good_b.group_id)]
    assert [(t["topic"], t["partition"], t["offset"]) for t in shown["trajectories"]] == \
        [(names.trajectories, 2, o) for o in (10, 11, 12, 13, 20, 21, 22, 23)]
    table = runner.invoke(app, ["lineage", "1", "-c", str(config), "--policy", cfg.policy], env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    assert good_b.group_id in table.stdout and "trajectory records" in table.stdout
    missing = runner.invoke(app, ["lineage", "7", "-c", str(config)])
    assert missing.exit_code == 1 and "has no version 7" in missing.output and "latest versions: 0, 1" in missing.output
