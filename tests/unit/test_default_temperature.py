"""A call that names no temperature is recorded at the temperature the server sampled it at: vLLM's rule for its
defaults (the model's generation_config.json under --generation-config auto, --override-generation-config on top),
read by the gateway from the upstream's base model, or set with gateway.default_temperature. Negative control: an
upstream whose base model is no directory here leaves the neutral 1.0."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.sessions import recorded_call
from rlstream.gateway.upstreams import served_base_root
from rlstream.rollout.capture import request_temperature
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.sampling import server_default_temperature
from tests.unit.test_gateway_sessions import USER, FakePublisher


def model_dir(path: Path, temperature: float | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": 2}
    if temperature is not None:
        config["temperature"] = temperature
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_vllms_default_temperature_rule(tmp_path: Path) -> None:
    tuned = model_dir(tmp_path / "tuned", 0.6)
    assert server_default_temperature(tuned) == 0.6  # --generation-config auto: the model's own
    assert server_default_temperature(tuned, "vllm") == 1.0  # vLLM's neutral defaults
    assert server_default_temperature(tuned, "auto", {"temperature": 0.3}) == 0.3  # the override wins
    assert server_default_temperature(tuned, "vllm", {"temperature": 0.3}) == 0.3
    other = model_dir(tmp_path / "other", 0.8)
    assert server_default_temperature(tuned, str(other)) == 0.8  # --generation-config FOLDER
    assert server_default_temperature(model_dir(tmp_path / "plain", None)) == 1.0  # names none
    assert server_default_temperature(tmp_path / "missing") == 1.0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text("{not json")
    assert server_default_temperature(tmp_path / "bad") == 1.0


def test_a_request_without_temperature_takes_the_servers_default() -> None:
    assert request_temperature({"model": "m"}, 0.6) == 0.6
    assert request_temperature({"model": "m", "temperature": "NOT_GIVEN"}, 0.6) == 0.6
    assert request_temperature({"model": "m", "temperature": 0.9}, 0.6) == 0.9
    assert request_temperature({"model": "m"}) == 1.0  # no server default known: the neutral one
    call = recorded_call({"model": "m", "messages": [USER]}, {"role": "assistant", "content": "x"}, [1], [2], [-0.1],
                         "stop", "m", default_temperature=0.6)
    assert call.turn.temperature == 0.6


def test_the_base_model_of_a_models_listing() -> None:
    listing = {"data": [{"id": "adapter", "root": "/loras/a", "parent": "policy"},
                        {"id": "policy", "root": "/models/tiny", "parent": None}]}
    assert served_base_root(listing) == "/models/tiny"
    assert served_base_root({"data": [{"id": "adapter", "root": "/loras/a", "parent": "policy"}]}) is None
    assert served_base_root({"error": "x"}) is None and served_base_root([1]) is None


def upstream_serving(root: str) -> Any:
    """An upstream whose /v1/models lists its base model at ``root``; its chat answers carry token data."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "policy", "object": "model", "root": root, "parent": None, "max_model_len": 512}]})
        body = json.loads(request.content)
        return httpx.Response(200, json={
            "model": body["model"], "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop",
                         "token_ids": [3], "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}}]})
    return handler


async def recorded_temperatures(root: str, **settings: Any) -> list[float | None]:
    """The temperatures a gateway in front of :func:`upstream_serving` records for a call without temperature and
    one at 0.9."""
    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p", route_versions=False, **settings),
                      publisher, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream_serving(root))))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            for extra in ({}, {"temperature": 0.9}):
                answer = await c.post("/v1/chat/completions", json={"model": "p", "messages": [USER], **extra})
                assert answer.status_code == 200, answer.text
    finally:
        await gateway.stop()
    return [t.temperature for _, e in publisher.sent if isinstance(e, TrajectoryEvent) for t in e.turns]


async def test_the_gateway_records_the_upstreams_generation_default(tmp_path: Path) -> None:
    tuned = model_dir(tmp_path / "tuned", 0.6)
    assert await recorded_temperatures(str(tuned)) == [0.6, 0.9]
    # gateway.default_temperature (an upstream started with --generation-config vllm or an override) wins
    assert await recorded_temperatures(str(tuned), default_temperature=0.3) == [0.3, 0.9]
    # negative control: the base model is no directory here, so nothing tells the default: the neutral 1.0
    assert await recorded_temperatures("org/remote-model") == [1.0, 0.9]
