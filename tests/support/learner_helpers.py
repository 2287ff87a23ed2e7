"""Helpers shared by the learner tests: the tiny model and synthetic samples/groups."""
from __future__ import annotations

import random
from pathlib import Path

from rlstream.learner.batch import Sample
from rlstream.ops.toy import build_tiny_model

_CACHE: dict[str, Path] = {}


def tiny_model(root: Path) -> Path:
    """The tiny Qwen2 under ``root`` (built once per process and directory)."""
    key = str(root)
    if key not in _CACHE:
        _CACHE[key] = build_tiny_model(root / "tiny-qwen2", seed=0)
    return _CACHE[key]


def random_samples(groups: int = 2, per_group: int = 4, seed: int = 0, vocab: int = 1000,
                   with_behaviour: bool = True) -> list[Sample]:
    """Samples with varied prompt/completion lengths, distinct rewards per group and behaviour logprobs."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for _ in range(per_group):
            p = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 7))]
            c = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
            lp = [-rng.uniform(6.0, 7.8) for _ in c] if with_behaviour else None
            out.append(Sample(p, c, lp, reward=rng.random(), group=g, policy_version=0))
    return out


def make_group(*, policy: str, run_id: str, example_id: str, prompt_ids: list[int],
               completions: list[tuple[list[int], list[float] | None]], rewards: list[float], version: int = 0,
               messages_prompt: str = "question"):
    """A TrajectoryGroup whose trajectories carry one trainable turn with token ids (and behaviour logprobs)."""
    from rlstream.schemas.models import Message, TrajectoryEvent, TrajectoryGroup, Turn

    trajs = []
    for i, ((ids, lps), r) in enumerate(zip(completions, rewards)):
        trajs.append(TrajectoryEvent(
            run_id=run_id, example_id=example_id, group_id=f"{run_id}:{example_id}", group_size=len(completions),
            generation_index=i, policy=policy, policy_version=version,
            messages=[Message(role="user", content=messages_prompt), Message(role="assistant", content="x")],
            turns=[Turn(message_index=1, model=policy, function="<workflow>", prompt_token_ids=list(prompt_ids),
                        completion_token_ids=list(ids), completion_logprobs=lps)],
            reward=float(r), target="<workflow>", producer_id="tests"))
    rs = [float(r) for r in rewards]
    mean = sum(rs) / len(rs)
    std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
    return TrajectoryGroup(group_id=f"{run_id}:{example_id}", run_id=run_id, example_id=example_id, policy=policy,
                           min_policy_version=version, max_policy_version=version, expected_size=len(completions),
                           trajectories=trajs, reward_mean=mean, reward_std=std, reward_min=min(rs),
                           reward_max=max(rs))


def random_group(policy: str, run_id: str, index: int, seed: int = 0, size: int = 4):
    rng = random.Random(seed * 100003 + index)
    prompt = [rng.randrange(3, 1000) for _ in range(6)]
    comps = [([rng.randrange(3, 1000) for _ in range(rng.randint(2, 5))], None) for _ in range(size)]
    return make_group(policy=policy, run_id=run_id, example_id=f"ex-{index}", prompt_ids=prompt, completions=comps,
                      rewards=[rng.random() for _ in range(size)])


async def produce_groups(cfg, groups) -> list[tuple[int, int]]:
    """Send groups to the groups topic (keyed by example id); returns (partition, offset) of each."""
    from rlstream.transport.kafka import make_producer
    from rlstream.schemas.codec import AvroCodec
    from rlstream.schemas.topics import TopicNames

    codec, topic = AvroCodec(), TopicNames.from_config(cfg.topics).groups
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        out = []
        for g in groups:
            md = await producer.send_and_wait(topic, codec.encode(g), key=g.example_id.encode())
            out.append((md.partition, md.offset))
        return out
    finally:
        await producer.stop()


async def read_topic(cfg, topic: str, model_cls, expect: int, timeout_s: float = 20.0) -> list:
    """Every record of ``topic`` (decoded) once at least ``expect`` are there."""
    import asyncio
    import time

    from rlstream.transport.kafka import make_consumer
    from rlstream.schemas.codec import AvroCodec

    codec = AvroCodec()
    consumer = make_consumer(cfg.kafka, topic, group_id=None)
    await consumer.start()
    out: list = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < expect and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                out.extend(codec.decode(r.value, model_cls) for r in records)
            await asyncio.sleep(0)
        return out
    finally:
        await consumer.stop()


async def read_whole_topic(cfg, topic: str, model_cls) -> list:
    """Every record of ``topic`` (decoded), up to the end offsets it has now."""
    from rlstream.schemas.codec import AvroCodec
    from rlstream.transport.topic_reader import open_reader, partitions_of, read_to_end

    codec = AvroCodec()
    consumer = await open_reader(cfg.kafka)
    try:
        consumer.assign(await partitions_of(consumer, topic))
        return [codec.decode(r.value, model_cls) async for r in read_to_end(consumer, topic)]
    finally:
        await consumer.stop()
