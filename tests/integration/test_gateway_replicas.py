"""One gateway in front of two replicas that acknowledged their versions in Redis (the sync workers' heartbeats):
requests outside sessions spread over both, the one with fewer requests in flight first (the control, a gateway that
does not count them, goes round robin); a session's calls all go to one replica; a request pinned to a version one
replica has not loaded never reaches it."""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx

from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.routing import FleetRouter
from rlstream.schemas.config import RlstreamConfig
from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ReplicaAck, ServingControl
from tests.support.fleet_support import canned_replica


class Discard:
    """A publisher that takes every event at once (what is captured is not under test here)."""

    trajectories_topic, rewards_topic, calls_topic = "trajectories", "rewards", "calls"

    async def submit(self, topic: str, key: str, event: Any) -> "asyncio.Future[Any]":
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_spread_sticky_sessions_and_pinned_versions(rl_config: RlstreamConfig) -> None:
    policy = rl_config.policy
    control = ControlPlane(str(rl_config.redis.url))
    serving_control = ServingControl(control)
    try:
        async with canned_replica(delay_s=0.3) as slow, canned_replica() as fast:
            await serving_control.record_replica(policy, ReplicaAck("slow", 3, "p-v3", url=slow.url, loaded={
                2: "p-v2", 3: "p-v3"}), 60)
            await serving_control.record_replica(policy, ReplicaAck("fast", 2, "p-v2", url=fast.url, loaded={
                2: "p-v2"}), 60)
            await serving_control.promote(policy, 2, token=await serving_control.issue_token(policy), reason="t",
                                          decided_by="test")
            gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                              port=0, policy=policy, served_model="base", run_id=rl_config.run_id),
                              Discard(), fleet=FleetRouter(control, policy, "base", ttl_s=0.2))
            async with serving(gateway) as url, httpx.AsyncClient(timeout=30) as http:
                async def ask(model: str, user: str, session: str | None = None) -> None:
                    headers = {"x-session-id": session} if session else {}
                    answer = await http.post(f"{url}/v1/chat/completions", headers=headers, json={
                        "model": model, "messages": [{"role": "user", "content": user}]})
                    assert answer.status_code == 200, answer.text

                # outside sessions, 4 clients one call after another: both replicas serve, the fast one (fewer
                # requests in flight whenever a call is routed) most
                async def client(c: int) -> None:
                    for i in range(6):
                        await ask(policy, f"free-{c}-{i}")

                await asyncio.gather(*(client(c) for c in range(4)))
                free = Counter("slow" if (m, u) in slow.requests else "fast" for m, u in
                               slow.requests + fast.requests if u.startswith("free-"))
                assert free["slow"] >= 1 and free["fast"] > free["slow"], free

                # sessions: every call of one session on one replica (its prefix cache), sessions on both
                for turn in range(3):
                    for s in range(8):
                        await ask(policy, f"session-{s}", session=f"sticky-{s}")
                where = {u: {name for name, log in (("slow", slow), ("fast", fast))
                             if any(q == u for _, q in log.requests)} for u in (f"session-{s}" for s in range(8))}
                assert all(len(replicas) == 1 for replicas in where.values()), where
                assert set().union(*where.values()) == {"slow", "fast"}, where

                # policy@3: only the replica that acknowledged version 3
                await asyncio.gather(*(ask(f"{policy}@3", f"pinned-{i}") for i in range(6)))
                assert sum(1 for _, u in fast.requests if u.startswith("pinned-")) == 0
                assert [m for m, u in slow.requests if u.startswith("pinned-")] == ["p-v3"] * 6
                assert all(m == "p-v2" for m, u in fast.requests)
            # the control: a gateway whose client does not count requests in flight goes round robin, half to the
            # slow replica
            blind = Gateway(GatewaySettings(session_stitching="gateway",
                                            port=0, policy=policy, served_model="base", run_id=rl_config.run_id),
                            Discard(), fleet=FleetRouter(control, policy, "base", ttl_s=0.2),
                            client=httpx.AsyncClient(timeout=30))
            async with serving(blind) as blind_url, httpx.AsyncClient(timeout=30) as http:
                async def blind_client(c: int) -> None:
                    for i in range(6):
                        answer = await http.post(f"{blind_url}/v1/chat/completions", json={
                            "model": policy, "messages": [{"role": "user", "content": f"blind-{c}-{i}"}]})
                        assert answer.status_code == 200

                await asyncio.gather(*(blind_client(c) for c in range(4)))
            await blind.client.aclose()
            assert sum(u.startswith("blind-") for _, u in slow.requests) == 12
    finally:
        await control.close()


async def test_upstreams_named_without_redis_spread_keep_sessions_and_refuse_other_versions() -> None:
    from rlstream.rollout.routing import StaticFleet

    async with canned_replica() as a, canned_replica() as b:
        fleet = StaticFleet([a.url, b.url], "policy", "base", version=4)
        gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                          port=0, policy="policy", served_model="base", policy_version=4), Discard(),
                          fleet=fleet)
        async with serving(gateway) as url, httpx.AsyncClient(timeout=30) as http:
            async def ask(model: str, user: str, session: str | None = None) -> int:
                headers = {"x-session-id": session} if session else {}
                answer = await http.post(f"{url}/v1/chat/completions", headers=headers, json={
                    "model": model, "messages": [{"role": "user", "content": user}]})
                return answer.status_code

            assert {await ask("policy", f"free-{i}") for i in range(6)} == {200}
            for _ in range(2):
                assert {await ask("policy", f"s-{s}", session=f"sid-{s}") for s in range(6)} == {200}
            assert await ask("policy@3", "other-version") == 404
        assert sum(u.startswith("free-") for _, u in a.requests) == 3  # one at a time: round robin
        for s in range(6):
            assert {r.url for r in (a, b) if any(u == f"s-{s}" for _, u in r.requests)} in ({a.url}, {b.url})
        assert {m for r in (a, b) for m, _ in r.requests} == {"base"}
        assert not any(u == "other-version" for r in (a, b) for _, u in r.requests)


async def test_naming_an_unpromoted_version_needs_the_evaluate_scope(rl_config: RlstreamConfig, tmp_path) -> None:
    import json

    from rlstream.gateway.auth import AccessConfig

    policy = rl_config.policy
    user_key, evaluator_key = "user-key-0123456789abcdef", "eval-key-0123456789abcdef"
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"key": user_key, "tenant": "t", "scopes": ["inference"], "tasks": ["*"]},
        {"key": evaluator_key, "tenant": "t", "scopes": ["inference", "evaluate"], "tasks": ["*"]}]}))
    keys.chmod(0o600)
    control = ControlPlane(str(rl_config.redis.url))
    serving_control = ServingControl(control)
    try:
        async with canned_replica() as replica:
            await serving_control.record_replica(policy, ReplicaAck("r", 3, "p-v3", url=replica.url, loaded={
                0: "base", 3: "p-v3"}), 60)
            gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                              port=0, policy=policy, served_model="base", run_id=rl_config.run_id),
                              Discard(), access=AccessConfig(api_keys_file=keys),
                              fleet=FleetRouter(control, policy, "base", ttl_s=0))
            async with serving(gateway) as url, httpx.AsyncClient(timeout=30) as http:
                async def ask(model: str, key: str) -> httpx.Response:
                    return await http.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                           json={"model": model, "messages": [{"role": "user", "content": "hi"}]})

                before = await ask(policy, user_key)  # nothing promoted yet: no version serves
                assert before.status_code == 503 and "no version" in before.text, before.text
                await serving_control.promote(policy, 0, token=await serving_control.issue_token(policy),
                                              reason="base", decided_by="gate")
                assert (await ask(policy, user_key)).status_code == 200
                refused = await ask(f"{policy}@3", user_key)
                assert refused.status_code == 403 and "evaluate" in refused.text, refused.text
                assert (await ask(f"{policy}@3", evaluator_key)).status_code == 200
                assert (await ask(f"{policy}@0", user_key)).status_code == 200  # the serving version needs no scope
        assert [m for m, _ in replica.requests] == ["base", "p-v3", "base"]
    finally:
        await control.close()
