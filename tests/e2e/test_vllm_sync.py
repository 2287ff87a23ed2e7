"""The sync worker against a real vLLM server, broker and Redis: LoRA then full versions are loaded and
served with transformers-exact logprobs; a bad checksum is refused and reported."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_consumer
from rlstream.ops.vllm import VllmServer
from rlstream.rollout.capture import Recording, instrument
from rlstream.rollout.routing import Route, VersionRouter
from rlstream.inference.sync import InferenceSyncWorker, adapter_name
from rlstream.inference.vllm_backend import VllmBackend
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames
from tests.e2e.vllm_support import (SERVED_MODEL, TOLERANCE, load_reference, make_full_version, make_lora_version,
                                    max_abs_diff, policy_version, reference_logprobs, tiny_model_dir, vllm_fixture,
                                    wait_until)
from tests.support.version_helpers import announce_versions

vllm = vllm_fixture()
MESSAGES = [{"role": "user", "content": "Say b again and again."}]


async def served_turn(server: VllmServer, model: str) -> Any:
    client = instrument(AsyncOpenAI(base_url=server.base_url, api_key="x"))
    with Recording(target_model=model) as rec:
        await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11)
    await client.close()
    return rec.turns()[0]


def assert_matches(turn: Any, reference: Any) -> None:
    ref = reference_logprobs(reference, turn.prompt_token_ids, turn.completion_token_ids)
    assert max_abs_diff(turn.completion_logprobs, ref) < TOLERANCE


async def loaded(control: ControlPlane, policy: str, worker_id: str, version: int) -> dict[str, str] | None:
    info = (await control.workers(policy)).get(worker_id)
    return info if info and int(info["version"]) == version else None


def test_lora_then_full_versions_are_loaded_served_and_bad_checksums_refused(
    vllm: VllmServer, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base_dir = tiny_model_dir(tmp_path_factory)
    cfg = rl_config.model_copy(deep=True)
    cfg.inference.url = vllm.url
    cfg.inference.worker_id = "w-e2e"
    cfg.inference.weights_roots = [str(tmp_path)]  # the versions below are written there (records are untrusted)
    cfg.inference.served_model = SERVED_MODEL
    cfg.inference.full_weights_follow = "newest"  # no gate here: each full version loads as it is announced
    cfg.inference.load_retries = 1
    cfg.inference.retry_backoff_s = 0.1
    codec = AvroCodec()
    lora_dir = make_lora_version(base_dir, tmp_path / "v1-lora")
    full_dir = make_full_version(base_dir, tmp_path / "v2-full")
    bad_dir = tmp_path / "v3-bad"
    shutil.copytree(lora_dir, bad_dir)
    bad = policy_version(cfg.policy, 3, WeightsKind.lora, bad_dir, base_dir)
    too_big_dir = make_lora_version(base_dir, tmp_path / "v4-rank16", rank=16)
    (bad_dir / "adapter_model.safetensors").write_bytes(b"tampered" + (bad_dir / "adapter_model.safetensors").read_bytes())

    async def scenario() -> None:
        control = ControlPlane(cfg.redis.url)
        lease = await control.acquire_lease(cfg.policy, "e2e-learner", ttl_s=600)  # versions count only from it
        assert lease is not None
        backend = VllmBackend(cfg.inference.url)
        stop = asyncio.Event()
        worker = InferenceSyncWorker(cfg, backend, control)
        task = asyncio.create_task(worker.run(stop))
        try:
            base_turn = await served_turn(vllm, SERVED_MODEL)

            # v1: LoRA, loaded under a new adapter name, logprobs equal transformers + peft
            v1 = policy_version(cfg.policy, 1, WeightsKind.lora, lora_dir, base_dir)
            await announce_versions(cfg, [v1], lease=lease)
            info = await wait_until(lambda: loaded(control, cfg.policy, "w-e2e", 1), 90, "version 1 in redis")
            assert info["name"] == adapter_name(cfg.policy, 1)
            assert info["name"] in await backend.models()
            # the runner's router sends policy requests to the newest loaded version
            assert await VersionRouter(control, cfg.policy, SERVED_MODEL).current() == Route(info["name"], 1, "w-e2e")
            lora_turn = await served_turn(vllm, info["name"])
            assert_matches(lora_turn, load_reference(base_dir, lora_dir))
            if lora_turn.completion_token_ids == base_turn.completion_token_ids:  # the adapter changes the model
                base_ref = reference_logprobs(load_reference(base_dir), lora_turn.prompt_token_ids,
                                              lora_turn.completion_token_ids)
                assert max_abs_diff(lora_turn.completion_logprobs, base_ref) > 1e-3

            # v2: full weights, pause -> reload -> reset prefix cache -> resume
            v2 = policy_version(cfg.policy, 2, WeightsKind.full, full_dir, base_dir)
            await announce_versions(cfg, [v2], lease=lease)
            info = await wait_until(lambda: loaded(control, cfg.policy, "w-e2e", 2), 120, "version 2 in redis")
            assert info["name"] == SERVED_MODEL
            assert await VersionRouter(control, cfg.policy, SERVED_MODEL).current() == Route(SERVED_MODEL, 2, "w-e2e")
            full_turn = await served_turn(vllm, SERVED_MODEL)
            assert_matches(full_turn, load_reference(full_dir))
            assert adapter_name(cfg.policy, 1) not in await backend.models()  # stale adapters unloaded

            # v3: the files do not match the manifest -> refused, reported, v2 still served
            await announce_versions(cfg, [bad], lease=lease)  # announced by the learner, but the files were changed
            info = await wait_until(
                lambda: _has_error(control, cfg.policy, "w-e2e"), 60, "the refusal in redis")
            assert int(info["version"]) == 2 and "version 3 refused" in info["last_error"]
            assert "sha256" in info["last_error"] or "size" in info["last_error"]
            assert adapter_name(cfg.policy, 3) not in await backend.models()
            assert worker.refused and worker.refused[0][0] == 3
            letter = await _first_dead_letter(cfg, created_topics)
            assert letter.error_type == "ManifestError" and codec.decode(letter.value, PolicyVersion).version == 3
            assert_matches(await served_turn(vllm, SERVED_MODEL), load_reference(full_dir))

            # v4: a valid manifest the server cannot load (rank above --max-lora-rank): retried, reported
            v4 = policy_version(cfg.policy, 4, WeightsKind.lora, too_big_dir, base_dir)
            await announce_versions(cfg, [v4], lease=lease)
            info = await wait_until(lambda: _error_for(control, cfg.policy, "w-e2e", 4), 60, "the failed load")
            assert int(info["version"]) == 2 and "version 4 failed" in info["last_error"]
            assert worker.failures == 2 and worker.state.version == 2
            assert adapter_name(cfg.policy, 4) not in await backend.models()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            # give the shared server its original weights back for the other tests
            await backend.load_full(base_dir)
            await backend.close()
            await control.close()

    asyncio.run(scenario())


async def _has_error(control: ControlPlane, policy: str, worker_id: str) -> dict[str, str] | None:
    info = (await control.workers(policy)).get(worker_id)
    return info if info and info.get("last_error") else None


async def _error_for(control: ControlPlane, policy: str, worker_id: str, version: int) -> dict[str, str] | None:
    info = (await control.workers(policy)).get(worker_id)
    return info if info and info.get("last_error_version") == str(version) else None


async def _first_dead_letter(cfg: RlstreamConfig, topics: TopicNames) -> DeadLetter:
    consumer = make_consumer(cfg.kafka, topics.dlq, group_id=None)
    await consumer.start()
    try:
        for _ in range(40):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    return AvroCodec().decode(record.value, DeadLetter)
    finally:
        await consumer.stop()
    raise AssertionError("no dead letter for the refused version")


def test_a_lora_policy_published_merged_is_loaded_as_full_weights_and_answers(
    vllm: VllmServer, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from rlstream.learner.policy import load_policy
    from rlstream.learner.publish import write_version
    from rlstream.learner.step import GRPOTrainerStep
    from rlstream.schemas.config import LearnerConfig, LoraConfig
    from rlstream.schemas.models import FileDigest
    from tests.support.learner_helpers import random_samples

    base_dir = tiny_model_dir(tmp_path_factory)
    cfg = rl_config.model_copy(deep=True)
    cfg.inference.url = vllm.url
    cfg.inference.worker_id = "w-merged"
    cfg.inference.weights_roots = [str(tmp_path)]
    cfg.inference.served_model = SERVED_MODEL
    cfg.inference.full_weights_follow = "newest"
    learner = LearnerConfig(model=str(base_dir), device="cpu", learning_rate=2e-2, micro_batch_size=4,
                            lora=LoraConfig(enabled=True, publish_merged=True))
    policy = load_policy(learner)
    GRPOTrainerStep(policy, learner).step(random_samples(seed=3))
    merged_dir, manifest = write_version(policy, tmp_path / "versions", cfg.policy, 1)
    assert manifest["kind"] == "full" and not (merged_dir / "adapter_config.json").exists()
    record = PolicyVersion(policy=cfg.policy, version=1, base_model=str(base_dir), kind=WeightsKind.full,
                           uri=str(merged_dir), learner_step=1,
                           files=[FileDigest(path=f["path"], sha256=f["sha256"], size=f["size"])
                                  for f in manifest["files"]])

    async def scenario() -> None:
        control = ControlPlane(cfg.redis.url)
        lease = await control.acquire_lease(cfg.policy, "e2e-learner", ttl_s=600)
        assert lease is not None
        backend = VllmBackend(cfg.inference.url)
        stop = asyncio.Event()
        task = asyncio.create_task(InferenceSyncWorker(cfg, backend, control).run(stop))
        try:
            await announce_versions(cfg, [record], lease=lease)
            info = await wait_until(lambda: loaded(control, cfg.policy, "w-merged", 1), 120, "version 1 in redis")
            assert info["name"] == SERVED_MODEL and not info.get("last_error")
            turn = await served_turn(vllm, SERVED_MODEL)
            assert turn.completion_token_ids
            merged = load_reference(merged_dir)
            assert_matches(turn, merged)
            base_ref = reference_logprobs(load_reference(base_dir), turn.prompt_token_ids, turn.completion_token_ids)
            assert max_abs_diff(turn.completion_logprobs, base_ref) > 1e-3  # the merged adapter is what answers
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await backend.load_full(base_dir)  # the shared server's original weights for the other tests
            await backend.close()
            await control.close()

    asyncio.run(scenario())
