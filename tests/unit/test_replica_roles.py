"""Replica roles: an ``evaluate`` replica (a dedicated evaluation server) is acknowledged like any other, but never
takes production traffic and never counts in the fleet rule; a ``serve`` replica with full weights holds the version
the serving pointer asks for (``inference.full_weights_follow: serving``) or the newest announced one."""
from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from rlstream.gate.service import PromotionGate
from rlstream.inference.sync import (adapters_to_unload, full_version_for_serve, loads_on_announcement,
                                     waits_for_evaluation)
from rlstream.rollout.routing import FleetRouter, NoServingVersion, Outstanding, VersionNotLoaded, production_version
from rlstream.schemas.config import InferenceConfig, RlstreamConfig
from rlstream.schemas.models import WeightsKind
from rlstream.transport.serving import (ReplicaAck, ServingPointer, WantedVersions, fleet_readiness,
                                        serve_replicas)

SERVE = ReplicaAck("serve-0", 1, "policy", url="http://serve:8000", loaded={1: "policy"}, role="serve",
                   follows="serving")
EVAL = ReplicaAck("eval-0", 3, "policy", url="http://eval:8000", loaded={3: "policy"}, role="evaluate")


def test_ack_role_round_trips_through_the_heartbeat_hash() -> None:
    raw = EVAL.to_hash(heartbeat_at=12.5)
    back = ReplicaAck.from_hash("eval-0", raw)
    assert (back.role, back.follows, back.loaded, back.url, back.heartbeat_at) == (
        "evaluate", "newest", {3: "policy"}, "http://eval:8000", 12.5)
    assert not back.serves
    served = ReplicaAck.from_hash("serve-0", SERVE.to_hash(heartbeat_at=1.0))
    assert (served.role, served.follows, served.serves) == ("serve", "serving", True)


def test_a_hash_without_a_role_is_a_serve_replica() -> None:
    old = {"version": "2", "name": "p-v2", "heartbeat_at": "1.0", "url": "", "loaded": '{"2": "p-v2"}'}
    ack = ReplicaAck.from_hash("old", old)
    assert (ack.role, ack.follows, ack.serves) == ("serve", "newest", True)


def test_fleet_readiness_leaves_evaluate_replicas_out() -> None:
    # the evaluation server lacks the serving version: the move may still go ahead
    assert fleet_readiness([SERVE, EVAL], 1).ready
    assert fleet_readiness([SERVE, EVAL], 1).loaded_on == ("serve-0",)
    # the candidate is only on the evaluation server: not ready
    blocked = fleet_readiness([SERVE, EVAL], 3)
    assert not blocked.ready and blocked.missing == ("serve-0",)
    # an evaluation server alone is no fleet
    alone = fleet_readiness([EVAL], 3)
    assert not alone.ready and "no inference replica is alive that serves" in alone.reason
    # control: the same acknowledgement with the serve role does count
    as_serve = ReplicaAck("eval-0", 3, "policy", loaded={3: "policy"}, role="serve")
    assert fleet_readiness([as_serve], 3).ready


def test_production_version_ignores_what_evaluate_replicas_loaded() -> None:
    assert production_version(None, [SERVE, EVAL], unpromoted=True) == 1
    assert production_version(None, [EVAL], unpromoted=True) is None
    control = [SERVE, ReplicaAck("x", 3, "policy", loaded={3: "policy"})]
    assert production_version(None, control, unpromoted=True) == 3  # control
    assert production_version(None, control) is None  # production: no pointer is no version


class _Serving:
    """What FleetRouter reads from Redis, in memory."""

    def __init__(self, acks: list[ReplicaAck], pointer: ServingPointer | None) -> None:
        self.acks, self.pointer = acks, pointer

    async def replicas(self, policy: str) -> list[ReplicaAck]:
        return list(self.acks)

    async def serve_replicas(self, policy: str) -> list[ReplicaAck]:
        return serve_replicas(self.acks)

    async def serving(self, policy: str) -> ServingPointer | None:
        return self.pointer


def _router(acks: list[ReplicaAck], pointer: ServingPointer | None, serve_unpromoted: bool = True) -> FleetRouter:
    router = FleetRouter.__new__(FleetRouter)  # the real routing choices over an in-memory pointer and acks
    router.serving, router.policy, router.base_model, router.ttl_s = _Serving(acks, pointer), "policy", "policy", 0.0
    router.serve_unpromoted = serve_unpromoted
    router._snapshot, router._latest, router._turn = None, 0, itertools.count()
    router.outstanding = Outstanding()
    return router


@pytest.mark.parametrize("pointer", [None, ServingPointer(version=1)], ids=["no-pointer", "serving-1"])
def test_fleet_router_never_routes_to_an_evaluate_replica(pointer: ServingPointer | None) -> None:
    router = _router([SERVE, EVAL], pointer)
    routes = [asyncio.run(router.route()) for _ in range(4)]
    assert {(r.version, r.worker_id, r.url) for r in routes} == {(1, "serve-0", "http://serve:8000")}
    with pytest.raises(VersionNotLoaded):  # a candidate only the evaluation server holds is loaded nowhere
        asyncio.run(router.route(pinned=3, scopes={"evaluate"}))
    # control: the same acknowledgement from a serve replica takes traffic
    as_serve = ReplicaAck("eval-0", 3, "policy", url="http://eval:8000", loaded={3: "policy"}, role="serve")
    assert asyncio.run(_router([SERVE, as_serve], pointer).route(pinned=3, scopes={"evaluate"})).worker_id == "eval-0"
    if pointer is None:  # without a pointer and without a gate (serve_unpromoted) the newest acknowledged serves
        assert asyncio.run(_router([SERVE, as_serve], None).route()).version == 3


def test_gate_prefers_an_evaluate_replica() -> None:
    gate = PromotionGate.__new__(PromotionGate)
    gate.cfg = RlstreamConfig()
    both = ReplicaAck("serve-1", 3, "policy", url="http://serve:8000", loaded={3: "policy"})
    route = gate.route_of([both, EVAL], 3)
    assert route is not None and (route.worker_id, route.base_url) == ("eval-0", "http://eval:8000/v1")
    fallback = gate.route_of([SERVE, EVAL], 1)  # only a serve replica has it: measured there
    assert fallback is not None and fallback.worker_id == "serve-0"
    assert gate.route_of([SERVE, EVAL], 7) is None


def test_which_full_version_a_serve_replica_holds() -> None:
    # newest: every announced version, whatever the pointer says
    assert full_version_for_serve("newest", 5, WantedVersions(serving=2)) == 5
    assert full_version_for_serve("newest", None, WantedVersions()) is None
    # serving: nothing asked for (no pointer yet) keeps the base weights
    assert full_version_for_serve("serving", 5, WantedVersions()) is None
    assert full_version_for_serve("serving", 5, WantedVersions(serving=2)) == 2
    # a promotion waiting for the fleet: the pending version
    assert full_version_for_serve("serving", 5, WantedVersions(serving=2, pending=4)) == 4
    assert full_version_for_serve("serving", 5, WantedVersions(pending=4)) == 4  # the first promotion
    # a rollback: pending is older than serving and wins
    assert full_version_for_serve("serving", 5, WantedVersions(serving=4, pending=2)) == 2
    # a canary runs on its share of the replicas only: the others keep serving
    wanted = WantedVersions(serving=2, canary=3, canary_workers=("w1",))
    assert full_version_for_serve("serving", 5, wanted, "w1") == 3
    assert full_version_for_serve("serving", 5, wanted, "w0") == 2
    # a pointer naming no canary replicas (or a replica that does not say who it is) keeps serving everywhere
    assert full_version_for_serve("serving", 5, WantedVersions(serving=2, canary=3), "w1") == 2
    assert full_version_for_serve("serving", 5, wanted) == 2


def test_which_announced_versions_load_at_once() -> None:
    assert loads_on_announcement("serve", "newest", WeightsKind.full)
    assert not loads_on_announcement("serve", "serving", WeightsKind.full)
    assert loads_on_announcement("serve", "serving", WeightsKind.lora)
    assert loads_on_announcement("evaluate", "serving", WeightsKind.full)
    assert loads_on_announcement("evaluate", "newest", WeightsKind.full)


def test_wanted_versions_from_the_pointer_hash() -> None:
    assert WantedVersions.from_hash({"pending_version": "3"}) == WantedVersions(pending=3)
    wants = WantedVersions.from_hash({"version": "2", "pending_version": "", "canary_version": "4"})
    assert wants == WantedVersions(serving=2, canary=4) and wants.all() == {2, 4}
    # version 0 (the base weights) is a version: a rollback to it asks the fleet to load it
    back = WantedVersions.from_hash({"version": "3", "pending_version": "0"})
    assert back == WantedVersions(serving=3, pending=0) and full_version_for_serve("serving", 5, back) == 0
    assert WantedVersions.from_hash({"version": "-1"}) == WantedVersions()


def test_inference_config_defaults_full_weights_follow_serving() -> None:
    cfg = InferenceConfig()
    assert (cfg.role, cfg.full_weights_follow) == ("serve", "serving")  # a candidate never replaces what serves
    assert not loads_on_announcement(cfg.role, cfg.full_weights_follow, WeightsKind.full)
    with pytest.raises(ValueError):
        InferenceConfig(role="shadow")  # type: ignore[arg-type]


def test_a_candidate_waits_only_on_an_evaluate_replica_held_on_its_loaded_version() -> None:
    assert waits_for_evaluation("evaluate", held_versions={3}, loaded_version=3)
    assert waits_for_evaluation("evaluate", held_versions={2, 3}, loaded_version=3)  # two evaluations at once
    assert not waits_for_evaluation("evaluate", held_versions=set(), loaded_version=3)  # no hold
    assert not waits_for_evaluation("evaluate", held_versions={2}, loaded_version=3)  # a stale hold on another version
    assert not waits_for_evaluation("serve", held_versions={3}, loaded_version=3)  # a serve replica loads on


def test_trimming_keeps_the_served_and_the_held_adapters() -> None:
    adapters = [f"toy-v{v}" for v in (3, 4, 5, 6, 7)]
    assert adapters_to_unload(adapters, set(), keep_adapters=2) == ["toy-v3", "toy-v4", "toy-v5"]
    # v3 serves and v4 is being scored: both stay, the two newest others stay, v5 goes
    assert adapters_to_unload(adapters, {3, 4}, keep_adapters=2) == ["toy-v5"]
    assert adapters_to_unload(adapters[:2], set(), keep_adapters=2) == []


def test_production_falls_back_only_to_a_promoted_version() -> None:
    # serving 3 is loaded nowhere yet; 2 (loaded) was rejected; 1 is the gate's anchor (promoted)
    acks = [ReplicaAck("serve-0", 2, "policy", loaded={0: "policy", 1: "p-v1", 2: "p-v2"})]
    pointer = ServingPointer(version=3, anchor_version=1)
    assert {asyncio.run(_router(acks, pointer, serve_unpromoted=False).route()).version for _ in range(4)} == {1}
    no_anchor = ServingPointer(version=3)  # only version 0 is known to be promoted
    assert asyncio.run(_router(acks, no_anchor, serve_unpromoted=False).route()).version == 0
    rolled_back = ServingPointer(version=3, anchor_version=2, floor=2)  # an anchor a rollback left is not served
    assert asyncio.run(_router(acks, rolled_back, serve_unpromoted=False).route()).version == 0
    without_base = [ReplicaAck("serve-0", 2, "policy", loaded={2: "p-v2"})]
    with pytest.raises(NoServingVersion, match="v3 of 'policy' is not loaded on any replica yet"):
        asyncio.run(_router(without_base, no_anchor, serve_unpromoted=False).route())
    # a full-weights replica that loaded the version a promotion waits for (pending) answers with it, labelled so
    reloading = [ReplicaAck("serve-0", 1, "policy", loaded={1: "policy"})]
    promoting = ServingPointer(version=0, pending_version=1)
    assert asyncio.run(_router(reloading, promoting, serve_unpromoted=False).route()).version == 1
    with pytest.raises(NoServingVersion):  # control: the same replica without a decision moving to it
        asyncio.run(_router(reloading, ServingPointer(version=0), serve_unpromoted=False).route())
    # control: without the promotion rule (no gate: serve_unpromoted) the newest loaded below serving answers
    assert asyncio.run(_router(acks, pointer, serve_unpromoted=True).route()).version == 2
    assert asyncio.run(_router(without_base, no_anchor, serve_unpromoted=True).route()).version == 2


class _MovingServing(_Serving):
    """A full-weights promotion from v10 to v11 landing right after the router's first read of Redis (whichever it
    reads first): the one serve replica swaps v10 for v11, and the pointer is confirmed at 11."""

    def __init__(self) -> None:
        super().__init__([ReplicaAck("serve-0", 10, "policy", url="http://serve:8000", loaded={10: "policy"})],
                         ServingPointer(version=10, anchor_version=7))
        self.reads = 0

    def _moved_after_this_read(self) -> None:
        self.reads += 1
        if self.reads == 1:
            self.acks = [ReplicaAck("serve-0", 11, "policy", url="http://serve:8000", loaded={11: "policy"})]
            self.pointer = ServingPointer(version=11, anchor_version=7)

    async def serve_replicas(self, policy: str) -> list[ReplicaAck]:
        acks = await super().serve_replicas(policy)
        self._moved_after_this_read()
        return acks

    async def serving(self, policy: str) -> ServingPointer | None:
        pointer = self.pointer
        self._moved_after_this_read()
        return pointer


def test_a_promotion_landing_between_the_routers_reads_is_served() -> None:
    # neither the old serving version (swapped out) nor a promoted version below it (v7, v0) is on a replica: a
    # pointer newer than the acknowledgements read with it would be a 503 for a request the fleet can serve
    router = _router([], None, serve_unpromoted=False)
    router.serving = _MovingServing()
    route = asyncio.run(router.route())
    assert route.version in (10, 11) and route.worker_id == "serve-0"
    assert asyncio.run(router.route()).version == 11  # every later read sees the move


def test_a_pointer_newer_than_its_acknowledgements_is_read_again_before_a_503() -> None:
    moving = _MovingServing()
    router = _router([], None, serve_unpromoted=False)
    router.serving = moving
    # the snapshot a racing read could give: the pointer confirmed at 11, the acknowledgement still v10
    router._snapshot = (time.monotonic() + 3600, ServingPointer(version=11, anchor_version=7), list(moving.acks))
    moving.reads = 1  # the move has landed in Redis
    moving.acks = [ReplicaAck("serve-0", 11, "policy", url="http://serve:8000", loaded={11: "policy"})]
    moving.pointer = ServingPointer(version=11, anchor_version=7)
    assert asyncio.run(router.route()).version == 11
    # control: with nothing of v11 or a promoted version below it on any replica, it stays a 503
    stuck = _router([ReplicaAck("serve-0", 10, "policy", url="http://serve:8000", loaded={10: "policy"})],
                    ServingPointer(version=11, anchor_version=7), serve_unpromoted=False)
    with pytest.raises(NoServingVersion):
        asyncio.run(stuck.route())
