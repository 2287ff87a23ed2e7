"""Who the canary gets: sessionless callers by a stable hash of their identity (API key id, ``user`` field) at the
canary's share within a binomial bound (control: without an identity a sessionless request never reaches it), the
serve replicas a full-weights canary runs on, and the canary test state's round trip through its Redis hash."""
from __future__ import annotations

import math

import pytest

from rlstream.rollout.routing import FleetRouter, caller_identity, in_canary_share
from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ArmStats, CanaryState, ReplicaAck, ServingPointer, canary_replicas

pytestmark = pytest.mark.unit


def within_binomial(hits: int, n: int, p: float, z: float = 4.0) -> bool:
    return abs(hits - n * p) <= z * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("share", [0.05, 0.2, 0.5])
def test_sessionless_callers_reach_the_canary_at_its_share(share: float) -> None:
    identities = [caller_identity(f"key-{i % 97}", f"user-{i}") for i in range(20_000)]
    hits = sum(in_canary_share(identity, share) for identity in identities if identity is not None)
    assert within_binomial(hits, len(identities), share), (hits, share)


def test_the_assignment_is_stable_and_depends_on_the_caller() -> None:
    identity = caller_identity("k1", "alice")
    assert identity is not None
    assert all(in_canary_share(identity, 0.3) == in_canary_share(identity, 0.3) for _ in range(10))
    assert caller_identity("k1", "alice") != caller_identity("k1", "bob") != caller_identity("k2", "bob")
    assert caller_identity("k1", None) == "key:k1\x00user:" and caller_identity(None, None) is None
    # the key and the user field are separated: ("ab", "c") and ("a", "bc") are different callers
    assert caller_identity("ab", "c") != caller_identity("a", "bc")
    assert not in_canary_share(identity, 0.0) and in_canary_share(identity, 1.0)


def test_fleet_router_sends_sessionless_callers_to_the_canary() -> None:
    router = FleetRouter(ControlPlane("redis://127.0.0.1:1/0"), "p", "p")  # _pick reads no Redis
    pointer = ServingPointer(version=1, canary_version=2, canary_share=0.25)
    replicas = [ReplicaAck("w0", 2, "p-v2", loaded={1: "p-v1", 2: "p-v2"})]
    callers = [caller_identity(f"key-{i}", None) for i in range(4000)]
    versions = [router._pick(pointer, replicas, None, caller).version for caller in callers]
    assert within_binomial(versions.count(2), len(versions), 0.25)
    # control: the same requests without a caller identity never reach the canary
    assert {router._pick(pointer, replicas, None, None).version for _ in range(200)} == {1}


def test_a_full_weights_canary_runs_on_a_share_of_the_replicas() -> None:
    ids = [f"w{i}" for i in range(10)]
    chosen = canary_replicas(ids, 0.2)
    assert len(chosen) == 2 and set(chosen) <= set(ids)
    assert canary_replicas(list(reversed(ids)), 0.2) == chosen  # stable, whatever the order
    assert len(canary_replicas(ids[:2], 0.9)) == 1  # never every replica: serving keeps one
    assert len(canary_replicas(ids[:4], 0.01)) == 1  # at least one
    assert canary_replicas(ids[:1], 0.5) == ()  # one replica holds one set of full weights: no canary beside it
    assert canary_replicas(ids, 0.0) == ()


def test_canary_state_round_trips_through_its_hash() -> None:
    state = CanaryState(3, 2, 0.2, 1_700_000_000.123456, ArmStats(25, 0.31, 4.2), ArmStats(40, 0.8, 6.1), 3, True,
                        {"reward_mean": 0.5}, {"reward_mean": 0.4}, "/v3", "abc")
    assert CanaryState.from_hash(state.to_hash()) == state
    assert CanaryState.from_hash({}) is None
    assert CanaryState.from_hash({**state.to_hash(), "canary_count": "x"}) is None  # unreadable: ignored


def test_the_canary_is_on_by_default_with_production_traffic() -> None:
    from rlstream.ops.up import canary_overrides
    from rlstream.schemas.config import GateConfig

    defaults = GateConfig()
    assert defaults.canary_share > 0 and defaults.canary_undecided == "reject"
    assert canary_overrides("production") == []  # rlstream up --traffic production keeps the config's canary
    assert canary_overrides("rollout") == ["-o", "gate.canary_share", "0"]  # no production feedback: no canary
