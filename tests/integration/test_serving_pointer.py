"""The serving pointer on a real Redis: forward compare-and-set, fencing, rollback only by the explicit call, the
fleet rule over the replicas' acknowledgements, and a decision recorded on the real broker's ``promotions`` topic."""
from __future__ import annotations

import asyncio
import time

import pytest

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, PromotionDecision
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_consumer, make_producer
from rlstream.transport.serving import (MoveKind, NotForward, ReplicaAck, ServingConflict, ServingControl,
                                        ServingFenced, evaluation_hold_key, move_serving_when_loaded, parse_model_name,
                                        publish_decision)

pytestmark = pytest.mark.integration
CODEC = AvroCodec()


def test_model_names_address_versions() -> None:
    assert parse_model_name("toy", "toy") == (True, None)
    assert parse_model_name("toy@12", "toy") == (True, 12)
    assert parse_model_name("toy@x", "toy") == (False, None)
    assert parse_model_name("other@3", "toy") == (False, None)
    assert parse_model_name("toy@", "toy") == (False, None)


def test_forward_compare_and_set_fencing_and_explicit_rollback(rl_config: RlstreamConfig) -> None:
    policy = rl_config.policy

    async def scenario() -> None:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        try:
            assert await serving.serving(policy) is None
            with pytest.raises(ServingFenced):  # a token Redis never issued
                await serving.promote(policy, 1, token=99, reason="x", decided_by="test")
            old_token = await serving.issue_token(policy)
            token = await serving.issue_token(policy)
            pointer = await serving.promote(policy, 2, token=token, reason="better", decided_by="gate",
                                            expected_version=-1)
            assert (pointer.version, pointer.fencing_token, pointer.reason) == (2, token, "better")
            with pytest.raises(ServingFenced):  # a decider holding an older token (paused while this one moved)
                await serving.promote(policy, 5, token=old_token, reason="late", decided_by="zombie")
            newer = await serving.issue_token(policy)
            with pytest.raises(NotForward):  # a forward move never goes back, or stays
                await serving.promote(policy, 1, token=newer, reason="back", decided_by="gate")
            with pytest.raises(NotForward):
                await serving.promote(policy, 2, token=newer, reason="same", decided_by="gate")
            with pytest.raises(ServingConflict):  # compare-and-set: the decider expected another serving version
                await serving.promote(policy, 4, token=newer, reason="x", decided_by="gate", expected_version=3)
            await serving.promote(policy, 4, token=newer, reason="better", decided_by="gate", expected_version=2)
            rollback_token = await serving.issue_token(policy)
            pointer = await serving.rollback(policy, 2, token=rollback_token, reason="operator", decided_by="ops")
            assert (pointer.version, pointer.floor) == (2, 4)
            gate_token = await serving.issue_token(policy)
            with pytest.raises(NotForward):  # the rolled-back version never comes back by itself
                await serving.promote(policy, 4, token=gate_token, reason="again", decided_by="gate")
            with pytest.raises(NotForward):  # a rollback only goes back
                await serving.rollback(policy, 3, token=gate_token, reason="x", decided_by="ops")
            pointer = await serving.promote(policy, 5, token=gate_token, reason="newer", decided_by="gate")
            assert pointer.version == 5
            forced = await serving.move(policy, 4, kind=MoveKind.force, token=await serving.issue_token(policy),
                                        reason="operator", decided_by="ops")
            assert (forced.version, forced.floor) == (4, 5)
        finally:
            await control.close()

    asyncio.run(scenario())


def test_fleet_rule_and_recorded_decision(rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    policy = rl_config.policy

    async def scenario() -> list[PromotionDecision]:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        producer = make_producer(rl_config.kafka)
        await producer.start()
        try:
            no_fleet = await move_serving_when_loaded(serving, policy, 1, decision=DecisionKind.promote,
                                                      reason="x", decided_by="gate", timeout_s=0.2)
            assert not no_fleet.moved and "no inference replica is alive" in no_fleet.reason
            await serving.record_replica(policy, ReplicaAck("a", 1, "p-v1", loaded={0: "base", 1: "p-v1"}), 30)
            await serving.record_replica(policy, ReplicaAck("b", 0, "base", loaded={0: "base"},
                                                            failed={1: "sha256 mismatch"}), 30)
            refused = await move_serving_when_loaded(serving, policy, 1, decision=DecisionKind.promote,
                                                     reason="x", decided_by="gate", timeout_s=0.3)
            assert not refused.moved and "b failed to load it: sha256 mismatch" in refused.reason
            assert await serving.serving(policy) is None
            assert await serving.wanted_versions(policy) == set()  # the request was withdrawn
            await serving.record_replica(policy, ReplicaAck("b", 1, "p-v1", loaded={1: "p-v1"}), 30)
            await serving.record_replica(policy, ReplicaAck("down", 0, "base", loaded={0: "base"}), 1)
            await asyncio.sleep(2.2)  # its heartbeat expires: a replica that is down is excluded
            moved = await move_serving_when_loaded(serving, policy, 1, decision=DecisionKind.promote,
                                                   reason="passed", decided_by="gate", timeout_s=5,
                                                   producer=producer, codec=CODEC, topic=created_topics.promotions)
            assert moved.moved and moved.pointer is not None and moved.pointer.version == 1
            assert moved.readiness is not None and moved.readiness.loaded_on == ("a", "b")
        finally:
            await producer.stop()
            await control.close()
        consumer = make_consumer(rl_config.kafka, created_topics.promotions, group_id=None,
                                 auto_offset_reset="earliest")
        await consumer.start()
        try:
            batches = await consumer.getmany(timeout_ms=5000)
            return [CODEC.decode(r.value, PromotionDecision) for records in batches.values() for r in records]
        finally:
            await consumer.stop()

    decisions = asyncio.run(scenario())
    assert [(d.version, d.decision, d.serving_before, d.reason) for d in decisions] == [
        (1, DecisionKind.promote, None, "passed")]
    assert decisions[0].fencing_token >= 1


def test_routers_follow_serving_pin_versions_and_sessions(rl_config: RlstreamConfig) -> None:
    from rlstream.rollout.routing import (FleetRouter, NoServingVersion, VersionForbidden, VersionNotLoaded,
                                          VersionRouter)

    policy = rl_config.policy

    async def scenario() -> None:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        try:
            await serving.record_replica(policy, ReplicaAck("a", 3, "p-v3", url="http://a:1",
                                                            loaded={0: "base", 2: "p-v2", 3: "p-v3"}), 30)
            await serving.record_replica(policy, ReplicaAck("b", 2, "p-v2", url="http://b:1",
                                                            loaded={0: "base", 2: "p-v2"}), 30)
            fleet = FleetRouter(control, policy, "base", ttl_s=0)
            # no serving pointer yet: training traffic gets the newest acknowledged version (no gate) ...
            assert (await VersionRouter(control, policy, "base", ttl_s=0).current()).version == 3
            with pytest.raises(NoServingVersion):  # ... production traffic gets nothing, never a candidate
                await fleet.route()
            with pytest.raises(NoServingVersion):
                await fleet.route(session_id="early")
            # control: a gateway told there is no gate (serve_unpromoted) routes to the newest acknowledged
            assert (await FleetRouter(control, policy, "base", ttl_s=0, serve_unpromoted=True).route()).version == 3
            await serving.promote(policy, 2, token=await serving.issue_token(policy), reason="x", decided_by="t")
            assert (await VersionRouter(control, policy, "base", ttl_s=0).current()).model == "p-v2"
            routes = [await fleet.route() for _ in range(4)]
            assert {(r.version, r.model) for r in routes} == {(2, "p-v2")}
            assert {r.url for r in routes} == {"http://a:1", "http://b:1"}  # both replicas acknowledged it
            with pytest.raises(VersionForbidden):  # an unpromoted version needs the evaluate scope
                await fleet.route(pinned=3, scopes={"inference"})
            assert (await fleet.route(pinned=2)).version == 2  # the serving version needs none
            pinned = [await fleet.route(pinned=3, scopes={"inference", "evaluate"}) for _ in range(3)]
            assert {(r.version, r.url) for r in pinned} == {(3, "http://a:1")}  # only the replica that has it
            assert (await VersionRouter(control, policy, f"{policy}@3", ttl_s=0).current()).model == "p-v3"
            with pytest.raises(VersionNotLoaded):
                await fleet.route(pinned=7, scopes={"evaluate"})
            # a session cannot carry a caller onto a candidate either
            assert (await fleet.route(session_version=3, session_id="s")).version == 2
            await serving.set_canary(policy, 3, 0.5, await serving.issue_token(policy))
            assert (await fleet.route(pinned=3)).version == 3  # the canary may be named without the scope
            picks = {sid: (await fleet.route(session_id=sid)).version for sid in (f"s{i}" for i in range(200))}
            canary = sum(1 for v in picks.values() if v == 3)
            assert 60 < canary < 140 and set(picks.values()) == {2, 3}
            again = {sid: (await fleet.route(session_id=sid)).version for sid in list(picks)[:20]}
            assert again == {sid: picks[sid] for sid in again}  # a session id keeps its pick
            await serving.set_canary(policy, None, 0.0, await serving.issue_token(policy))
            assert {(await fleet.route(session_id=f"t{i}")).version for i in range(50)} == {2}

            # sessions are pinned in Redis: another gateway sends a session's calls to the version it started on
            other_gateway = FleetRouter(control, policy, "base", ttl_s=0, session_ttl_s=60)
            assert (await fleet.route(session_id="long")).version == 2
            await serving.promote(policy, 3, token=await serving.issue_token(policy), reason="x", decided_by="t")
            assert (await other_gateway.route(session_id="long")).version == 2
            assert (await other_gateway.route(session_id="started-after")).version == 3
            assert (await other_gateway.route()).version == 3
            for wid, url in (("a", "http://a:1"), ("b", "http://b:1")):  # version 2 unloaded everywhere
                await serving.record_replica(policy, ReplicaAck(wid, 3, "p-v3", url=url, loaded={0: "b", 3: "p-v3"}),
                                             30)
            assert (await other_gateway.route(session_id="long")).version == 3  # the session moves on
            assert (await fleet.route(session_id="long")).version == 3
        finally:
            await control.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("rolled_back", [True, False], ids=["rollback", "control-no-rollback"])
def test_a_rollback_moves_pinned_sessions_at_their_next_call(rl_config: RlstreamConfig, rolled_back: bool) -> None:
    from rlstream.rollout.routing import FleetRouter

    policy = rl_config.policy

    async def scenario() -> tuple[set[int], set[int], set[int]]:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        try:
            for wid in ("a", "b"):  # both replicas keep every version loaded: only the pointer decides
                await serving.record_replica(policy, ReplicaAck(wid, 3, "p-v3", url=f"http://{wid}:1", loaded={
                    0: "base", 2: "p-v2", 3: "p-v3"}), 30)
            await serving.promote(policy, 2, token=await serving.issue_token(policy), reason="x", decided_by="t")
            await serving.set_canary(policy, 3, 0.5, await serving.issue_token(policy))
            fleet = FleetRouter(control, policy, "base", ttl_s=0, session_ttl_s=600)
            sessions = [f"s{i}" for i in range(100)]
            first = {sid: (await fleet.route(session_id=sid)).version for sid in sessions}
            on_canary = [sid for sid, v in first.items() if v == 3]
            on_serving = [sid for sid, v in first.items() if v == 2]
            assert on_canary and on_serving
            if rolled_back:  # the canary ends and its version is rolled back below the serving one
                await serving.set_canary(policy, None, 0.0, await serving.issue_token(policy))
                await serving.rollback(policy, 0, token=await serving.issue_token(policy), reason="bad",
                                       decided_by="ops")
            else:  # control: the canary goes on; its sessions stay on it
                pass
            canary_next = {(await fleet.route(session_id=sid)).version for sid in on_canary}
            serving_next = {(await fleet.route(session_id=sid)).version for sid in on_serving}
            fresh = {(await fleet.route(session_id=f"new{i}")).version for i in range(50)}
            return canary_next, serving_next, fresh
        finally:
            await control.close()

    canary_next, serving_next, fresh = asyncio.run(scenario())
    if rolled_back:  # every session, pinned or not, is on version 0 at its next call
        assert (canary_next, serving_next, fresh) == ({0}, {0}, {0})
    else:
        assert (canary_next, serving_next, fresh) == ({3}, {2}, {2, 3})


def test_status_tail_and_lineage_show_the_decisions(rl_config: RlstreamConfig,
                                                          created_topics: TopicNames) -> None:
    import io
    import json

    from rich.console import Console

    from rlstream.ops.promotion import read_decisions
    from rlstream.ops.status import collect_status, render_status
    from rlstream.ops.tail import TailOptions, build_table, run_tail

    policy = rl_config.policy

    async def scenario() -> tuple[dict, str, list[PromotionDecision]]:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        producer = make_producer(rl_config.kafka)
        await producer.start()
        try:
            await serving.promote(policy, 4, token=await serving.issue_token(policy), reason="passed",
                                  decided_by="gate")
            for version, kind, reason in ((5, DecisionKind.reject, "reward 0.2 below 0.5 - 0.05"),
                                          (4, DecisionKind.promote, "passed")):
                await publish_decision(producer, CODEC, created_topics.promotions, PromotionDecision(
                    policy=policy, version=version, decision=kind, reason=reason, serving_before=3,
                    candidate_metrics={"eval/reward": 0.2}, decided_by="gate", fencing_token=1))
        finally:
            await producer.stop()
            await control.close()
        status = await collect_status(rl_config)
        out = io.StringIO()
        await run_tail(rl_config, "promotions", TailOptions(from_beginning=True), "json", out=out)
        return status, out.getvalue(), await read_decisions(rl_config, policy, version=5)

    status, tailed, about_5 = asyncio.run(scenario())
    assert status["serving"]["version"] == 4 and status["serving"]["reason"] == "passed"
    assert [(d["version"], d["decision"]) for d in status["promotions"]] == [(4, "promote"), (5, "reject")]
    console = Console(file=io.StringIO(), width=200)
    render_status(status, console)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert "serving version: 4" in shown and "reward 0.2 below" in shown
    rows = [json.loads(line) for line in tailed.splitlines()]
    assert [(r["version"], r["decision"]) for r in rows] == [(5, "reject"), (4, "promote")]
    assert [(d.version, d.decision) for d in about_5] == [(5, DecisionKind.reject)]
    assert build_table("promotions", [], "") is not None


def test_evaluation_holds_are_per_replica_released_expire_and_ignore_garbage(rl_config: RlstreamConfig) -> None:
    policy = rl_config.policy

    async def scenario() -> None:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        try:
            assert await serving.evaluation_holds(policy, "eval-0") == set()
            await serving.hold_for_evaluation(policy, "eval-0", 7, ttl_s=60, holder="gate")
            assert await serving.evaluation_holds(policy, "eval-0") == {7}
            assert await serving.evaluation_holds(policy, "eval-1") == set()  # another replica is not held
            await serving.release_evaluation(policy, "eval-0", 7, "gate")
            assert await serving.evaluation_holds(policy, "eval-0") == set()
            await serving.hold_for_evaluation(policy, "eval-0", 8, ttl_s=1, holder="gate")  # died mid-evaluation
            await asyncio.sleep(2.2)
            assert await serving.evaluation_holds(policy, "eval-0") == set()
            await control.redis.delete(evaluation_hold_key(policy, "eval-0"))
            await control.redis.set(evaluation_hold_key(policy, "eval-0"), "not-a-version")  # written by anyone
            assert await serving.evaluation_holds(policy, "eval-0") == set()
            await control.redis.delete(evaluation_hold_key(policy, "eval-0"))
            await control.redis.zadd(evaluation_hold_key(policy, "eval-0"), {"x|y": time.time() + 60})
            assert await serving.evaluation_holds(policy, "eval-0") == set()
        finally:
            await control.close()

    asyncio.run(scenario())


def test_two_evaluations_hold_one_replica_side_by_side(rl_config: RlstreamConfig) -> None:
    # the gate and rlstream up's held-out scoring evaluate on the same replica at once: each hold stands until its own
    # holder releases it (one value per replica, as holds were kept before, lost the first hold when the second
    # evaluation started and when it ended)
    policy = rl_config.policy

    async def scenario() -> list[set[int]]:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        seen = []
        try:
            async with serving.held_for_evaluation(policy, "serve-0", 3, ttl_s=60):
                seen.append(await serving.evaluation_holds(policy, "serve-0"))
                async with serving.held_for_evaluation(policy, "serve-0", 4, ttl_s=60):
                    seen.append(await serving.evaluation_holds(policy, "serve-0"))
                seen.append(await serving.evaluation_holds(policy, "serve-0"))
            seen.append(await serving.evaluation_holds(policy, "serve-0"))
        finally:
            await control.close()
        return seen

    assert asyncio.run(scenario()) == [{3}, {3, 4}, {3}, set()]
