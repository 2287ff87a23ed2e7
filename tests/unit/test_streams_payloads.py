"""Small state and members placed as consumed (streams.assembly, streams.payloads, AvroCodec.encode_with_bodies)."""
from __future__ import annotations

import json

import pytest

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import TrajectoryEvent, TrajectoryGroup
from rlstream.streams.assembly import AssemblyRules, GroupAssembler, SourceRef
from rlstream.streams.payloads import PayloadCache
from tests.support.factories import make_reward, make_trajectory

CODEC = AvroCodec()
T, R = "p.trajectories", "p.rewards"


def big(example: str, n: int, index: int, reward: float | None) -> TrajectoryEvent:
    return make_trajectory(example_id=example, group_size=n, generation_index=index, reward=reward, turns=4,
                           completion_tokens=256, prompt_tokens=64, seed=index)


def test_a_group_record_with_members_placed_as_consumed_equals_the_group_encoded_whole() -> None:
    groups: dict = {}
    payloads: dict = {}
    asm = GroupAssembler(groups, payloads, CODEC, AssemblyRules(60, 2))
    members = [big("ex", 3, i, reward=float(i)) for i in (2, 0)] + [big("ex", 3, 1, reward=None)]
    members = [m.model_copy(update={"group_id": members[0].group_id}) for m in members]
    outs = [asm.on_trajectory(m, CODEC.encode(m), b"ex", SourceRef(T, 0, i), 0.0, 0.0) for i, m in enumerate(members)]
    assert not any(o.finished for o in outs)
    late = asm.on_reward(make_reward(members[2], 0.5), b"", b"ex", SourceRef(R, 0, 7), 0.0, 1.0)  # a joined reward
    (finished,) = late.finished
    assert [m.joined for m in finished.members] == [False, True, False]  # generation order 0, 1, 2
    whole = CODEC.encode(finished.group)
    assert finished.encode() == whole  # byte for byte: two members placed as they are, the joined one re-encoded
    decoded = CODEC.decode(whole, TrajectoryGroup)
    assert [t.reward for t in decoded.trajectories] == [0.0, 0.5, 2.0]
    assert decoded.trajectories[1].turns == members[2].turns
    assert payloads == {}  # a closed group's records leave the cache


def test_encode_with_bodies_refuses_a_non_empty_array_and_the_empty_case_is_the_plain_encoding() -> None:
    t = big("ex", 1, 0, 1.0)
    group = TrajectoryGroup(group_id="g", run_id="r", example_id="ex", policy="p", min_policy_version=0,
                            max_policy_version=0, expected_size=1, trajectories=[t], reward_mean=1.0, reward_std=0.0,
                            reward_min=1.0, reward_max=1.0, completion="full", source_offsets=[])
    with pytest.raises(ValueError, match="must be empty"):
        CODEC.encode_with_bodies(group, "trajectories", [])
    header = group.model_copy(update={"trajectories": []})
    assert CODEC.encode_with_bodies(header, "trajectories", []) == CODEC.encode(header)
    assert CODEC.encode_with_bodies(header, "trajectories", [CODEC.body_as_written(CODEC.encode(t),
                                                                                   TrajectoryEvent.avro_name)]) \
        == CODEC.encode(group)


def test_the_state_of_a_waiting_trajectory_is_small_whatever_its_size() -> None:
    groups: dict = {}
    asm = GroupAssembler(groups, PayloadCache(1 << 30), CODEC, AssemblyRules(60, 2))
    sizes = []
    for n, example in ((1, "a"), (64, "b")):
        for i in range(n):
            m = big(example, n, i, reward=None)
            asm.on_trajectory(m, CODEC.encode(m), example.encode(), SourceRef(T, 0, 100 * n + i), 0.0, 0.0)
        (state,) = [v for v in groups.values() if v["e"] == example]
        sizes.append(len(json.dumps(state).encode()) / n)
    assert len(CODEC.encode(big("x", 1, 0, None))) > 10_000  # each record is ~11 KiB
    assert max(sizes) < 1024, sizes  # bytes of changelog state per waiting trajectory


def test_the_payload_cache_evicts_the_least_recently_used_first() -> None:
    cache = PayloadCache(max_bytes=10)
    a, b, c = (SourceRef(T, 0, i) for i in range(3))
    cache[a] = b"aaaa"
    cache[b] = b"bbbb"
    assert cache[a] == b"aaaa"  # a is now the most recently used
    cache[c] = b"cccc"  # 12 bytes > 10: b goes
    assert b not in cache and a in cache and c in cache and cache.size_bytes == 8
    del cache[a]
    assert cache.size_bytes == 4 and len(cache) == 1
    cache[c] = b"cc"
    assert cache.size_bytes == 2
