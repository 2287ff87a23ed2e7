"""Nothing unevaluated serves, on the real broker and Redis: the fenced learner's version 0 (the base weights) is
what the gate serves first, production requests before any pointer get nothing (the gateway answers 503), LoRA
candidates every serve replica holds never answer production traffic, and ``rlstream rollback --to 0`` takes the
fleet, pinned sessions included, back to the base weights."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.gate.evaluation import EvaluationSet
from rlstream.gate.service import PromotionGate
from rlstream.ops.promotion import read_decisions
from rlstream.rollout.routing import FleetRouter, NoServingVersion
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, FileDigest, PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ReplicaAck, ServingControl
from tests.support.version_helpers import announce_versions

pytestmark = pytest.mark.integration
CODEC = AvroCodec()
REQUESTS = 200


def lora_version(cfg: RlstreamConfig, version: int) -> PolicyVersion:
    return PolicyVersion(policy=cfg.policy, version=version, base_model="m", kind=WeightsKind.lora,
                         uri=f"/versions/v{version:06d}", learner_step=version,
                         files=[FileDigest(path="adapter_model.safetensors", sha256=f"{version:064x}", size=1)])


async def start_fleet(cfg: RlstreamConfig, control: ControlPlane) -> ServingControl:
    """Versions 0-3 announced by the fenced learner; two serve replicas that loaded every LoRA candidate (what a
    serve replica does: each under its own name), the base weights answering as version 0."""
    await announce_versions(cfg, [lora_version(cfg, v) for v in range(4)])
    serving = ServingControl(control)
    for wid in ("a", "b"):
        await serving.record_replica(cfg.policy, ReplicaAck(wid, 3, f"{cfg.policy}-v3", url=f"http://{wid}:1", loaded={
            0: "base", **{v: f"{cfg.policy}-v{v}" for v in (1, 2, 3)}}), 120.0)
    return serving


async def production_versions(fleet: FleetRouter) -> list[int | None]:
    """The version each of ``REQUESTS`` production requests gets (half in sessions); None: refused (503)."""
    out: list[int | None] = []
    for i in range(REQUESTS):
        try:
            out.append((await fleet.route(session_id=f"s{i}" if i % 2 else None)).version)
        except NoServingVersion:
            out.append(None)
    return out


async def start_gate(cfg: RlstreamConfig, control: ControlPlane) -> PromotionGate:
    evaluation = EvaluationSet(examples=[{"id": "0", "prompt": "x"}], reward_function=lambda e, t: 0.0)
    gate = PromotionGate(cfg, control, evaluation, codec=CODEC)
    await gate._start()
    for _ in range(40):  # read the announced versions from the broker
        await gate.pump(timeout_ms=250)
        if len(gate.known) == 4:
            break
    assert sorted(gate.known) == [0, 1, 2, 3]
    return gate


def test_production_before_the_first_promotion_gets_only_version_0(rl_config: RlstreamConfig,
                                                                   created_topics: TopicNames) -> None:
    cfg = rl_config

    async def scenario() -> tuple[list[int | None], list[int | None], list[int | None], int | None]:
        control = ControlPlane(str(cfg.redis.url))
        try:
            await start_fleet(cfg, control)
            fleet = FleetRouter(control, cfg.policy, "base", ttl_s=0)
            before_gate = await production_versions(fleet)
            # control: the resolution without a pointer ("the newest version a replica loaded") on the same fleet
            legacy = await production_versions(FleetRouter(control, cfg.policy, "base", ttl_s=0,
                                                           serve_unpromoted=True))
            gate = await start_gate(cfg, control)
            try:
                await gate.step()  # no pointer and version 0 known: the base weights serve, without evaluation
            finally:
                await gate._stop()
            pointer = await ServingControl(control).serving(cfg.policy)
            after_gate = await production_versions(fleet)
            return before_gate, after_gate, legacy, pointer.version if pointer else None
        finally:
            await control.close()

    before_gate, after_gate, legacy, pointer = asyncio.run(scenario())
    assert before_gate == [None] * REQUESTS  # nothing serves before version 0 does: 503, never a candidate
    assert pointer == 0 and after_gate == [0] * REQUESTS
    assert set(legacy) == {3}  # control: without the pointer rule every request reached the unevaluated v3
    (decision,) = asyncio.run(read_decisions(cfg))
    assert (decision.version, decision.decision, decision.serving_before) == (0, DecisionKind.promote, None)
    assert "without evaluation" in decision.reason


def test_rollback_to_0_through_the_cli_moves_every_session(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                           tmp_path: Path) -> None:
    cfg = rl_config
    policy = cfg.policy

    async def promote_3() -> dict[str, int]:
        control = ControlPlane(str(cfg.redis.url))
        try:
            serving = await start_fleet(cfg, control)
            for version in (0, 3):  # what the gate did: the base, then a candidate that passed
                await serving.promote(policy, version, token=await serving.issue_token(policy), reason="passed",
                                      decided_by="gate")
            fleet = FleetRouter(control, policy, "base", ttl_s=0, session_ttl_s=600)
            return {f"s{i}": (await fleet.route(session_id=f"s{i}")).version for i in range(50)}
        finally:
            await control.close()

    pinned = asyncio.run(promote_3())
    assert set(pinned.values()) == {3}
    overrides = ["kafka.bootstrap_servers", cfg.kafka.bootstrap_servers, "redis.url", str(cfg.redis.url),
                 "topics.prefix", cfg.topics.prefix, "policy", policy]
    args = ["rollback", "--to", "0", "--reason", "bad canary", "--timeout", "10"]
    for key, value in zip(overrides[::2], overrides[1::2]):
        args += ["-o", f"{key}={value}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "3 -> 0" in result.output

    async def after() -> tuple[int, int, set[int], set[int]]:
        control = ControlPlane(str(cfg.redis.url))
        try:
            pointer = await ServingControl(control).serving(policy)
            assert pointer is not None
            fleet = FleetRouter(control, policy, "base", ttl_s=0, session_ttl_s=600)
            moved = {(await fleet.route(session_id=sid)).version for sid in pinned}
            fresh = {(await fleet.route()).version for _ in range(20)}
            return pointer.version, pointer.floor, moved, fresh
        finally:
            await control.close()

    version, floor, moved, fresh = asyncio.run(after())
    assert (version, floor) == (0, 3)
    assert moved == {0} and fresh == {0}  # pinned sessions left the rolled-back version at their next call
    decisions = asyncio.run(read_decisions(cfg))
    assert [(d.version, d.decision, d.serving_before) for d in decisions] == [(0, DecisionKind.rollback, 3)]


def test_serving_version_loaded_nowhere_falls_back_only_to_a_promoted_version(rl_config: RlstreamConfig) -> None:
    cfg, policy = rl_config, rl_config.policy

    async def scenario() -> tuple[set[int], set[int], str, set[int]]:
        control = ControlPlane(str(cfg.redis.url))
        try:
            serving = ServingControl(control)
            for version in (0, 1, 3):  # what the gate did: the base, 1 passed (the anchor), 2 rejected, 3 passed
                await serving.promote(policy, version, token=await serving.issue_token(policy), reason="passed",
                                      decided_by="gate")
            await serving.set_anchor(policy, 1, await serving.issue_token(policy))
            # 3 is on no replica yet (restarting); the replicas still hold the rejected 2
            await serving.record_replica(policy, ReplicaAck("a", 2, f"{policy}-v2", url="http://a:1", loaded={
                0: "base", 1: f"{policy}-v1", 2: f"{policy}-v2"}), 120.0)
            await serving.record_replica(policy, ReplicaAck("b", 2, f"{policy}-v2", url="http://b:1", loaded={
                2: f"{policy}-v2"}), 120.0)
            fleet = FleetRouter(control, policy, "base", ttl_s=0)
            with_anchor = set(await production_versions(fleet))
            ungated_fleet = FleetRouter(control, policy, "base", ttl_s=0, serve_unpromoted=True)
            ungated = {(await ungated_fleet.route()).version for _ in range(20)}  # sessionless: no pins
            await serving.record_replica(policy, ReplicaAck("a", 2, f"{policy}-v2", url="http://a:1", loaded={
                2: f"{policy}-v2"}), 120.0)  # now only the rejected version is loaded anywhere
            try:
                await fleet.route()
                refused = ""
            except NoServingVersion as exc:
                refused = str(exc)
            return with_anchor, ungated, refused, set(await production_versions(fleet))
        finally:
            await control.close()

    with_anchor, ungated, refused, only_rejected = asyncio.run(scenario())
    assert with_anchor == {1}  # the promoted anchor, never the rejected 2
    assert "serving version v3" in refused and "not loaded on any replica yet" in refused
    assert only_rejected == {None}  # 503 rather than a version the gate rejected
    assert ungated == {2}  # control: the fallback without the promotion rule reaches the rejected version
