"""Published versions (LoRA and full) reload with transformers/peft to identical logprobs, their sha256 manifest
verifies, and a second learner cannot publish while the first holds the lease."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlstream.learner.batch import collate
from rlstream.learner.checkpoint import CheckpointError, verify_manifest
from rlstream.learner.policy import completion_logprobs
from rlstream.learner.publish import (Announcer, announce, load_published, manifest_digest, version_dir,
                                      write_version)
from rlstream.learner.service import Learner
from rlstream.transport.control import ControlPlane, LeaseLost
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames
from tests.support.learner_helpers import produce_groups, random_group, random_samples, read_topic, tiny_model


def _configure(cfg: RlstreamConfig, model: Path, lora: bool, steps: int, merged: bool = False) -> RlstreamConfig:
    return cfg.model_copy(update={"learner": cfg.learner.model_copy(update={
        "model": str(model), "lora": cfg.learner.lora.model_copy(update={"enabled": lora, "publish_merged": merged}),
        "learning_rate": 5e-3, "groups_per_step": 2, "publish_every": 1, "checkpoint_every": 5,
        "total_steps": steps, "device": "cpu", "lease_ttl_s": 3.0})})


@pytest.mark.parametrize("lora,merged", [(True, False), (False, False), (True, True)], ids=["lora", "full", "merged"])
def test_published_version_reloads_to_identical_logprobs(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                         tmp_path: Path, lora: bool, merged: bool) -> None:
    """``merged``: a LoRA learner publishing full weights (``learner.lora.publish_merged``)."""
    cfg = _configure(rl_config, tiny_model(tmp_path), lora, steps=2, merged=merged)
    asyncio.run(produce_groups(cfg, [random_group(cfg.policy, cfg.run_id, i) for i in range(4)]))
    learner = Learner(cfg, holder="first")
    state = asyncio.run(learner.run())
    assert state.step == 2 and state.version == 2
    versions = asyncio.run(read_topic(cfg, created_topics.policy_versions, PolicyVersion, expect=3))
    assert [v.version for v in versions] == [0, 1, 2]  # version 0: the base weights, announced first
    assert (versions[0].learner_step, versions[0].group_count, versions[0].trained_on) == (0, 0, [])
    latest = versions[-1]
    assert latest.kind == (WeightsKind.lora if lora and not merged else WeightsKind.full)
    directory = Path(latest.uri)
    assert directory == version_dir(Path(cfg.learner.output_dir) / "versions", 2).resolve()

    # manifest verifies and matches the announced digests and the Redis pointer
    manifest = verify_manifest(directory)
    assert {(f["path"], f["sha256"]) for f in manifest["files"]} == {(f.path, f.sha256) for f in latest.files}

    async def pointer() -> dict:
        control = ControlPlane(cfg.redis.url)
        try:
            return await control.latest(cfg.policy)
        finally:
            await control.close()

    ptr = asyncio.run(pointer())
    assert int(ptr["version"]) == 2 and ptr["sha256"] == manifest_digest(directory) and ptr["uri"] == latest.uri
    names = {f["path"] for f in manifest["files"]}
    if lora and not merged:
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    else:
        assert "model.safetensors" in names and not any(n.startswith("adapter_") for n in names)
        assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is False
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())

    # identical logprobs: the learner's final model vs the published version reloaded with transformers/peft
    batch = collate(random_samples(groups=2, per_group=2, seed=7), learner.policy.pad_id)
    learner.policy.model.eval()
    with torch.no_grad():
        ours = completion_logprobs(learner.policy.model, batch)
        reloaded = completion_logprobs(load_published(directory).eval(), batch)
        base = completion_logprobs(load_published(version_dir(directory.parent, 1)).eval(), batch)
        untrained = completion_logprobs(load_published(version_dir(directory.parent, 0)).eval(), batch)
        pretrained = completion_logprobs(AutoModelForCausalLM.from_pretrained(cfg.learner.model).eval(), batch)
    if merged:  # the adapter's low-rank product folded into the weights: equal up to float rounding
        assert torch.allclose(ours * batch.completion_mask, reloaded * batch.completion_mask, atol=1e-4)
    else:
        assert torch.equal(ours * batch.completion_mask, reloaded * batch.completion_mask)
    assert not torch.allclose(base, reloaded)  # version 2 differs from version 1: training moved the weights
    assert torch.allclose(untrained, pretrained, atol=1e-5)  # version 0 answers as the base model does

    # tampering is detected
    victim = directory / sorted(names)[0]
    victim.write_bytes(victim.read_bytes() + b" ")
    with pytest.raises(CheckpointError):
        verify_manifest(directory)


def test_second_learner_waits_and_a_fenced_out_learner_cannot_publish(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path) -> None:
    cfg = _configure(rl_config, tiny_model(tmp_path), lora=True, steps=1)
    asyncio.run(produce_groups(cfg, [random_group(cfg.policy, cfg.run_id, i) for i in range(2)]))

    async def scenario() -> None:
        control = ControlPlane(cfg.redis.url)
        first = await control.acquire_lease(cfg.policy, "first", ttl_s=30)
        assert first is not None
        second = Learner(cfg, holder="second")
        task = asyncio.create_task(second.run())
        await asyncio.sleep(4.0)  # the second learner is waiting for the lease: it trains and publishes nothing
        assert not task.done()
        assert await control.latest_version(cfg.policy) == -1
        assert not (Path(cfg.learner.output_dir) / "versions").exists()

        # a learner whose lease was taken over cannot announce a version (fencing)
        await control.release_lease(cfg.policy, first)
        await asyncio.wait_for(task, timeout=120)
        assert await control.latest_version(cfg.policy) == 1  # the second learner published once it held the lease
        assert (await second.loop.announce_base()) is None  # version 0 exists: never announced twice
        stale = first  # its token is older than the second learner's
        from rlstream.transport.kafka import make_producer

        producer = make_producer(cfg.kafka)
        await producer.start()
        try:
            directory, manifest = write_version(second.policy, tmp_path / "stale", cfg.policy, 5)
            takeover = await control.acquire_lease(cfg.policy, "third", ttl_s=30)
            assert takeover is not None
            with pytest.raises(LeaseLost):
                await announce(announcer=Announcer(producer, None), codec=AvroCodec(), control=control, lease=stale,
                               topic=created_topics.policy_versions, groups_topic=created_topics.groups,
                               policy_name=cfg.policy, run_id=cfg.run_id, directory=directory, manifest=manifest,
                               version=5, step=5, kind=WeightsKind.lora, base_model=cfg.learner.model, ranges={},
                               group_count=0, metrics={}, lease_ttl_s=30)
            with pytest.raises(LeaseLost):  # even straight to the pointer, the fence refuses it
                await control.publish_latest(cfg.policy, 5, str(directory), manifest_digest(directory), stale)
            assert await control.latest_version(cfg.policy) == 1
        finally:
            await producer.stop()
            await control.close()
        versions = await read_topic(cfg, created_topics.policy_versions, PolicyVersion, expect=2, timeout_s=3)
        assert [v.version for v in versions] == [0, 1]

    asyncio.run(scenario())


def test_validation_groups_are_consumed_but_never_trained(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                          tmp_path: Path) -> None:
    from rlstream.schemas.models import DeadLetter, TrajectorySource

    cfg = _configure(rl_config, tiny_model(tmp_path), lora=True, steps=1)
    held_out = random_group(cfg.policy, cfg.run_id, 99)
    for trajectory in held_out.trajectories:
        trajectory.source = TrajectorySource.validation
    placed = asyncio.run(produce_groups(cfg, [held_out] + [random_group(cfg.policy, cfg.run_id, i) for i in range(2)]))
    learner = Learner(cfg, holder="only")
    state = asyncio.run(learner.run())
    assert state.step == 1 and learner.validation_groups_skipped == 1
    base, version = asyncio.run(read_topic(cfg, created_topics.policy_versions, PolicyVersion, expect=2))
    assert (base.version, version.version) == (0, 1)
    assert version.group_count == 2  # the two training groups; the validation group was only consumed
    # exact lineage: the two trained groups' offsets, not the consumed validation group's (was: 3, ranges of reads)
    assert sum(r.last - r.first + 1 for r in version.trained_on) == 2
    assert {(r.partition, o) for r in version.trained_on for o in range(r.first, r.last + 1)} == set(placed[1:])
    assert asyncio.run(read_topic(cfg, created_topics.dlq, DeadLetter, expect=1, timeout_s=3.0)) == []


def test_version_0_is_announced_once_and_a_restart_leaves_the_serving_pointer_alone(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path) -> None:
    from rlstream.transport.serving import ServingControl

    cfg = _configure(rl_config, tiny_model(tmp_path), lora=True, steps=1)
    asyncio.run(produce_groups(cfg, [random_group(cfg.policy, cfg.run_id, i) for i in range(2)]))
    assert asyncio.run(Learner(cfg, holder="first").run()).version == 1

    async def serve_base() -> tuple[int, int]:
        control = ControlPlane(cfg.redis.url)
        try:
            serving = ServingControl(control)
            pointer = await serving.promote(cfg.policy, 0, token=await serving.issue_token(cfg.policy),
                                            reason="base", decided_by="gate", expected_version=-1)
            return pointer.version, pointer.fencing_token
        finally:
            await control.close()

    before = asyncio.run(serve_base())
    restarted = _configure(rl_config, Path(cfg.learner.model), lora=True, steps=2)
    asyncio.run(produce_groups(restarted, [random_group(cfg.policy, cfg.run_id, i) for i in range(2, 4)]))
    assert asyncio.run(Learner(restarted, holder="second").run()).version == 2

    async def after() -> tuple[tuple[int, int], int]:
        control = ControlPlane(cfg.redis.url)
        try:
            pointer = await ServingControl(control).serving(cfg.policy)
            assert pointer is not None
            return (pointer.version, pointer.fencing_token), await control.latest_version(cfg.policy)
        finally:
            await control.close()

    pointer, latest = asyncio.run(after())
    assert (pointer, latest) == (before, 2)  # the restart neither re-announced version 0 nor touched serving
    versions = asyncio.run(read_topic(cfg, created_topics.policy_versions, PolicyVersion, expect=4, timeout_s=3))
    assert [v.version for v in versions] == [0, 1, 2]


def test_a_learner_with_nothing_to_read_says_so_and_stops_saying_it_once_groups_come(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path) -> None:
    """What a paused rollout runner reads to tell groups on their way from groups that will never come."""
    cfg = _configure(rl_config, tiny_model(tmp_path), lora=True, steps=1)

    async def scenario() -> tuple[list[float], float | None, int]:
        control = ControlPlane(cfg.redis.url)
        learner = Learner(cfg, holder="only")
        run = asyncio.create_task(learner.run())
        marks: list[float] = []
        try:
            for _ in range(600):  # the learner starts, reads the empty topic, then says it waits
                waited = await control.learner_waiting_s(cfg.policy)
                if waited is not None:
                    marks.append(waited)
                if marks and marks[-1] >= 2.0:
                    break
                await asyncio.sleep(0.1)
            await produce_groups(cfg, [random_group(cfg.policy, cfg.run_id, i) for i in range(2)])
            state = await asyncio.wait_for(run, timeout=120)
            return marks, await control.learner_waiting_s(cfg.policy), state.step
        finally:
            run.cancel()
            await control.close()

    marks, after, step = asyncio.run(scenario())
    assert marks and marks[-1] >= 2.0 and marks == sorted(marks)  # refreshed while it waits, and growing
    assert step == 1 and after is None  # groups came: the mark is gone


def _announce_kwargs(cfg: RlstreamConfig, topics: TopicNames, control: ControlPlane, lease, directory: Path,
                     manifest: dict, version: int) -> dict:
    return dict(codec=AvroCodec(), control=control, lease=lease, topic=topics.policy_versions,
                groups_topic=topics.groups, policy_name=cfg.policy, run_id=cfg.run_id, directory=directory,
                manifest=manifest, version=version, step=version, kind=WeightsKind.lora, base_model="tiny",
                ranges={}, group_count=0, metrics={}, lease_ttl_s=30)


async def _committed_versions(cfg: RlstreamConfig, topic: str) -> list[int]:
    """The versions a read_committed consumer (every sync worker) sees."""
    from rlstream.transport.kafka import make_consumer

    consumer = make_consumer(cfg.kafka, topic, group_id=None, isolation_level="read_committed")
    await consumer.start()
    out: list[int] = []
    try:
        for _ in range(10):
            batch = await consumer.getmany(timeout_ms=300)
            out.extend(AvroCodec().decode(r.value, PolicyVersion).version for rs in batch.values() for r in rs)
        return sorted(out)
    finally:
        await consumer.stop()


def _fake_version(root: Path, version: int) -> tuple[Path, dict]:
    from rlstream.learner.checkpoint import write_manifest

    directory = version_dir(root, version)
    directory.mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(bytes([version]) * 64)
    return directory, write_manifest(directory, {"policy": "p", "version": version, "kind": "lora"})


@pytest.mark.parametrize("same_id", [True, False], ids=["same-transactional-id", "different-ids"])
def test_a_zombie_learners_announcement_is_fenced_by_kafka(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                          tmp_path: Path, same_id: bool) -> None:
    """Two producers with the policy's transactional id: starting the second fences the first (ProducerFenced),
    so the zombie announces nothing and the Redis pointer is not moved. Negative control: different ids both
    announce. The lease check is bypassed here (both hold a lease-like token) to isolate Kafka's fence."""
    from rlstream.learner.publish import PublicationFenced, transactional_id
    from rlstream.transport.kafka import make_producer

    cfg = rl_config
    root = Path(cfg.learner.output_dir) / "versions"

    async def scenario() -> None:
        control = ControlPlane(cfg.redis.url)
        lease = await control.acquire_lease(cfg.policy, "both", ttl_s=60)  # Kafka's fence alone is under test
        zombie_announcer = Announcer.for_policy(cfg.kafka, cfg.policy)
        new_id = transactional_id(cfg.policy) + ("" if same_id else "-b")
        new_announcer = Announcer(make_producer(cfg.kafka, transactional_id=new_id), new_id)
        zombie, new = zombie_announcer.producer, new_announcer.producer
        await zombie.start()
        try:
            d1, m1 = _fake_version(root, 1)
            await announce(announcer=zombie_announcer,
                           **_announce_kwargs(cfg, created_topics, control, lease, d1, m1, 1))
            await new.start()  # the new learner's producer: fences the zombie when the id is the same
            d2, m2 = _fake_version(root, 2)
            if same_id:
                with pytest.raises(PublicationFenced):
                    await announce(announcer=zombie_announcer,
                                   **_announce_kwargs(cfg, created_topics, control, lease, d2, m2, 2))
                assert await control.latest_version(cfg.policy) == 1  # the zombie did not move the pointer
                await announce(announcer=new_announcer,
                               **_announce_kwargs(cfg, created_topics, control, lease, d2, m2, 2))
            else:
                await announce(announcer=zombie_announcer,
                               **_announce_kwargs(cfg, created_topics, control, lease, d2, m2, 2))
                d3, m3 = _fake_version(root, 3)
                await announce(announcer=new_announcer,
                               **_announce_kwargs(cfg, created_topics, control, lease, d3, m3, 3))
        finally:
            for producer in (new, zombie):
                try:
                    await producer.stop()
                except Exception:  # noqa: BLE001 - a fenced producer may not close cleanly
                    pass
        assert await control.latest_version(cfg.policy) == (2 if same_id else 3)
        await control.close()
        assert await _committed_versions(cfg, created_topics.policy_versions) == ([1, 2] if same_id else [1, 2, 3])

    asyncio.run(scenario())
