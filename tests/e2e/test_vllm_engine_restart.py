"""The serving fleet through version churn and engine death, on a vLLM server of its own (it gets killed), with the
sync worker, a real broker and Redis.

The server runs with ``--max-loras 1``: every switch between adapters makes vLLM read an adapter's files from disk
again, so a request that names an adapter the worker has unloaded meets its files, or their absence, for sure.

1. Churn with the retention rule: requests pinned to the newest and to older versions keep arriving while the worker
   loads one version after another and trims all but two: vLLM never dies, every request is answered or refused with
   a 404 naming the version, the unloaded versions' files outlive their unload.
2. SIGKILL of the server under its supervisor: the replica leaves routing at once, the server is restarted on its
   port, the worker loads the versions it held again, and only then is the replica routed to again.
3. Negative controls, the supervisor stopped: the same churn with the immediate-delete rule (``trim_grace_s`` 0) kills
   the engine (``LoRAAdapterNotFoundError`` in vLLM's log, requests fail), and the dead replica stays out of routing.
"""
from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import pytest

from rlstream.inference.sync import InferenceSyncWorker, adapter_name
from rlstream.inference.vllm_backend import VllmBackend
from rlstream.ops.ports import free_port
from rlstream.ops.processes import pid_alive, stop_pid
from rlstream.ops.vllm import VllmServer, VllmSupervisor, start_vllm_server
from rlstream.rollout.routing import VersionRouter
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ServingControl
from tests.e2e.vllm_support import SERVED_MODEL, make_lora_version, policy_version, tiny_model_dir, wait_until
from tests.support.version_helpers import announce_versions

#: versions loaded and trimmed in the churn with the retention rule (measured: see the test's log line)
CHURN_VERSIONS = 200
CLIENTS = 6
MESSAGES = [{"role": "user", "content": "Say b again and again."}]


@dataclass
class ChurnResult:
    answered: int = 0
    refused: int = 0  # 404 naming the version that is no longer loaded
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def churn(cfg: RlstreamConfig, worker: InferenceSyncWorker, server: VllmServer, versions: list[PolicyVersion],
                lease: object, timeout_s: float, until_dead: bool = False) -> ChurnResult:
    """Announce ``versions`` while ``CLIENTS`` clients send requests pinned to the newest loaded version or up to
    four before it; until the worker has loaded the last one (or, ``until_dead``, the server stops answering)."""
    result = ChurnResult()
    done = asyncio.Event()
    last = versions[-1].version
    started = time.monotonic()

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=server.url, timeout=20.0) as http:
            while not done.is_set():
                version = max(1, worker.state.version - rng.choice([0, 0, 1, 2, 3, 4]))
                name = adapter_name(cfg.policy, version)
                body = {"model": name, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0,
                        "ignore_eos": True}
                try:
                    response = await http.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    result.failures.append(f"{name}: {type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.2)
                    continue
                if response.status_code == 200:
                    result.answered += 1
                elif response.status_code == 404 and name in response.text:
                    result.refused += 1
                else:
                    result.failures.append(f"{name}: HTTP {response.status_code}: {response.text[:200]}")
                    await asyncio.sleep(0.2)

    async def watch() -> None:
        while time.monotonic() - started < timeout_s:
            if worker.state.version >= last:
                break
            if until_dead and (worker.engine_down or not server.alive()):
                break
            await asyncio.sleep(0.2)
        done.set()

    clients = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    announcing = asyncio.create_task(announce_versions(cfg, versions, lease=lease))  # type: ignore[arg-type]
    await watch()
    await asyncio.gather(*clients)
    await asyncio.wait_for(announcing, 60)
    result.seconds = time.monotonic() - started
    return result


async def routed(serving: ServingControl, policy: str, worker_id: str) -> bool:
    return any(r.worker_id == worker_id for r in await serving.serve_replicas(policy))


@pytest.mark.timeout(1200)  # two vLLM starts (the second after a SIGKILL) take minutes each on a loaded 2-core machine
def test_churn_keeps_vllm_up_a_killed_server_is_restarted_and_the_unguarded_rule_kills_it(
    rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base_dir = tiny_model_dir(tmp_path_factory)
    start = partial(start_vllm_server, base_dir, SERVED_MODEL, port=free_port(), max_loras=1,
                    workdir=tmp_path / "vllm", timeout_s=600)  # a start takes minutes on a loaded 2-core machine
    supervisor = VllmSupervisor("vllm", start(), start, interval_s=1.0, health_failures=2)
    log_file = Path(supervisor.server.log_file)
    cfg = rl_config.model_copy(deep=True)
    cfg.inference.url = supervisor.server.url
    cfg.inference.worker_id = "w-churn"
    cfg.inference.served_model = SERVED_MODEL
    cfg.inference.weights_roots = [tmp_path]
    cfg.inference.staging_dir = tmp_path / "staging"
    cfg.inference.keep_adapters = 2
    cfg.inference.trim_grace_s = 300.0  # above the clients' 20 s request timeout and the churn's length
    cfg.inference.health_interval_s = 0.5
    cfg.inference.health_failures = 2
    cfg.inference.heartbeat_ttl_s = 120.0  # leaving routing must come from the health check, not an expiry
    cfg.inference.load_retries = 1
    cfg.inference.retry_backoff_s = 0.1
    adapter = make_lora_version(base_dir, tmp_path / "adapter")

    def version(number: int) -> PolicyVersion:
        directory = tmp_path / f"v{number}"
        shutil.copytree(adapter, directory)
        return policy_version(cfg.policy, number, WeightsKind.lora, directory, base_dir)

    async def scenario() -> None:
        control = ControlPlane(cfg.redis.url)
        serving = ServingControl(control)
        lease = await control.acquire_lease(cfg.policy, "churn-learner", ttl_s=900)
        assert lease is not None
        backend = VllmBackend(cfg.inference.url)
        stop = asyncio.Event()
        worker = InferenceSyncWorker(cfg, backend, control)
        task = asyncio.create_task(worker.run(stop))
        try:
            await wait_until(lambda: routed(serving, cfg.policy, "w-churn"), 60, "the replica in routing")

            # 1. churn with the retention rule
            guarded = await churn(cfg, worker, supervisor.server, [version(n) for n in range(1, CHURN_VERSIONS + 1)],
                                  lease, timeout_s=300)
            print(f"churn: {CHURN_VERSIONS} versions loaded and trimmed in {guarded.seconds:.1f} s; "
                  f"{guarded.answered} answered, {guarded.refused} refused with 404, {len(guarded.failures)} failed")
            assert worker.state.version == CHURN_VERSIONS
            assert guarded.failures == []
            assert guarded.answered > 0 and guarded.refused > 0  # old versions were asked for after their unload
            assert supervisor.server.alive() and await backend.healthy()
            assert "LoRAAdapterNotFoundError" not in log_file.read_text(errors="replace")
            assert supervisor.restarts == []
            kept = [r for r in worker._retired.values() if r.path.exists()]
            assert len(kept) >= CHURN_VERSIONS - 4  # unloaded, not listed, files still there within the grace
            listed = set(await backend.models())
            assert not {adapter_name(cfg.policy, r.version) for r in kept} & listed

            # 2. SIGKILL under the supervisor: out of routing at once, restarted, versions loaded again, back
            held = sorted(worker.adapters)
            supervisor.start_thread()
            killed = supervisor.server.pid
            os.kill(killed, signal.SIGKILL)
            await wait_until(lambda: _not(routed(serving, cfg.policy, "w-churn")), 15, "the replica out of routing")
            info = (await control.workers(cfg.policy))["w-churn"]
            assert info.get("down"), info
            await wait_until(lambda: routed(serving, cfg.policy, "w-churn"), 700, "the replica back in routing")
            # the worker can see the new server healthy before the supervisor's start() returns and records it
            await wait_until(lambda: _true(bool(supervisor.restarts)), 30, "the supervisor's record of the restart")
            assert [r.reason.startswith("process exited") for r in supervisor.restarts] == [True]
            assert supervisor.server.pid != killed and supervisor.server.url == cfg.inference.url
            assert set(held) <= set(await backend.models())  # the versions it held, loaded again
            route = await VersionRouter(control, cfg.policy, SERVED_MODEL).current()
            assert (route.model, route.version) == (adapter_name(cfg.policy, CHURN_VERSIONS), CHURN_VERSIONS)
            async with httpx.AsyncClient(base_url=supervisor.server.url, timeout=60) as http:
                answer = await http.post("/v1/chat/completions", json={"model": route.model, "messages": MESSAGES,
                                                                       "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            print(f"restart: the SIGKILLed server was back after {supervisor.restarts[0].down_s:.0f} s")

            # 3. negative controls: no supervisor, and the immediate-delete rule
            supervisor.stop()
            cfg.inference.trim_grace_s = 0.0
            offset = log_file.stat().st_size
            unguarded = await churn(cfg, worker, supervisor.server,
                                    [version(n) for n in range(CHURN_VERSIONS + 1, CHURN_VERSIONS + 61)], lease,
                                    timeout_s=180, until_dead=True)
            died = log_file.read_text(errors="replace")[offset:]
            print(f"unguarded churn: engine dead after {unguarded.seconds:.1f} s; {len(unguarded.failures)} failed "
                  f"requests, e.g. {unguarded.failures[:1]}")
            assert "LoRAAdapterNotFoundError" in died or "adapter_config.json" in died
            assert unguarded.failures
            await wait_until(lambda: _not(routed(serving, cfg.policy, "w-churn")), 30, "the dead replica out")
            for _ in range(20):  # nobody restarts it: it stays out of routing
                assert not await routed(serving, cfg.policy, "w-churn")
                await asyncio.sleep(0.5)
            assert not await backend.healthy()
        finally:
            stop.set()
            await asyncio.wait_for(task, 180)  # a worker mid-recovery of a dead server ends its current try first
            await backend.close()
            await control.close()

    try:
        asyncio.run(scenario())
    finally:
        supervisor.stop()
        stop_pid(supervisor.server.pid, timeout_s=10)
        assert not pid_alive(supervisor.server.pid)


async def _not(check: object) -> bool:
    return not await check  # type: ignore[misc]


async def _true(value: bool) -> bool:
    return value
