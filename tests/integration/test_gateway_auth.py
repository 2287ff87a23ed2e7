"""Gateway authentication and trusted feedback: the authorization matrix over every endpoint, feedback tokens,
tenant isolation and rewards validated at the door; the real ASGI app in front of a canned OpenAI-compatible
upstream (bench/canned_upstream.py's answers), publishing to the real broker."""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bench.canned_upstream import chat_completions as canned_chat, models as canned_models
from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig, KeyStore, exposure_problem
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.feedback_tokens import FeedbackSigner
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from tests.support.learner_helpers import read_topic

POLICY = "toy"
SECRET = "s" * 32
ADMIN_KEY = "admin-key-0123456789"
ACME_KEY = "acme-inference-0123456789"  # inference + feedback, tasks acme / acme-eval
ACME_INFER_ONLY = "acme-inference-only-0123"
ACME_FEEDBACK_ONLY = "acme-feedback-only-01234"
GLOBEX_KEY = "globex-key-0123456789ab"
LIMITED_KEY = "limited-key-0123456789a"
KEYS_FILE = {"keys": [
    {"key": ADMIN_KEY, "name": "ops", "tenant": "ops", "scopes": ["admin"]},
    {"key": ACME_KEY, "name": "acme", "tenant": "acme", "tasks": ["acme", "acme-eval"],
     "models": [POLICY, "other-model"]},
    {"key": ACME_INFER_ONLY, "tenant": "acme", "scopes": ["inference"]},
    {"key": ACME_FEEDBACK_ONLY, "tenant": "acme", "scopes": ["feedback"]},
    {"key": GLOBEX_KEY, "name": "globex", "tenant": "globex"},
    {"key": LIMITED_KEY, "tenant": "limited", "rpm": 2},
]}
USER = {"role": "user", "content": "Repeat the letter c."}
CHAT = {"model": POLICY, "messages": [USER], "max_tokens": 8}


async def canned_responses(request: Request) -> Response:
    body = json.loads(await request.body())
    return JSONResponse({"id": f"resp_{time.monotonic_ns()}", "object": "response", "status": "completed",
                         "model": body.get("model"), "output": [{"type": "message", "role": "assistant",
                                                                 "content": [{"type": "output_text",
                                                                              "text": "ccc"}]}]})


async def counted_chat(request: Request) -> Response:
    request.app.state.calls.append(json.loads(await request.body()).get("model"))
    return await canned_chat(request)


def canned_upstream() -> Starlette:
    app = Starlette(routes=[Route("/v1/chat/completions", counted_chat, methods=["POST"]),
                            Route("/v1/responses", canned_responses, methods=["POST"]),
                            Route("/v1/models", canned_models)])
    app.state.calls = []
    return app


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
async def gateway_client(rl_config: Any, created_topics: Any, tmp_path: Path) -> AsyncIterator[
        tuple[httpx.AsyncClient, Gateway, Starlette, Path]]:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(json.dumps(KEYS_FILE))
    os.chmod(keys_file, 0o600)
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    upstream = canned_upstream()
    access = AccessConfig(api_keys_file=keys_file, feedback_secret=SecretStr(SECRET), feedback_token_ttl_s=600,
                          reward_range=(-1.0, 1.0))
    gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                      policy=POLICY, served_model=POLICY, run_id=rl_config.run_id, session_idle_s=60),
                      publisher, client=httpx.AsyncClient(transport=httpx.ASGITransport(upstream),
                                                          base_url="http://upstream"), access=access)
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            yield c, gateway, upstream, keys_file
    finally:
        await gateway.stop()
        await publisher.close()


def refused(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert isinstance(error["code"], str) or status not in (401, 403, 429)
    return error  # type: ignore[no-any-return]


ENDPOINTS = [("POST", "/v1/chat/completions", CHAT), ("POST", "/s/s1/v1/chat/completions", CHAT),
             ("POST", "/v1/responses", {"model": POLICY, "input": "hi"}), ("GET", "/v1/models", None),
             ("POST", "/s/s1/v1/responses", {"model": POLICY, "input": "hi"}), ("GET", "/s/s1/v1/models", None),
             ("POST", "/v1/sessions", None), ("POST", "/v1/sessions/s1/end", None),
             ("POST", "/v1/feedback", {"trajectory_id": "x", "reward": 0.5}), ("GET", "/rlstream/stats", None)]
SCOPE_OF = {"/v1/feedback": "feedback", "/rlstream/stats": "admin"}


async def test_every_endpoint_refuses_no_key_a_wrong_key_and_a_key_without_its_scope(
        gateway_client: tuple[httpx.AsyncClient, Gateway, Starlette, Path]) -> None:
    c, gateway, upstream, _ = gateway_client
    keys_of_scope = {"inference": ACME_INFER_ONLY, "feedback": ACME_FEEDBACK_ONLY, "admin": ADMIN_KEY}
    for method, path, body in ENDPOINTS:
        needed = SCOPE_OF.get(path, "inference")
        if path != "/v1/feedback":  # feedback without a key is for token holders: tested below
            error = refused(await c.request(method, path, json=body), 401)
            assert error["code"] == "missing_api_key"
        r = await c.request(method, path, json=body, headers=bearer("wrong-key-0123456789"))
        assert refused(r, 401)["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert refused(await c.request(method, path, json=body, headers={"authorization": "Basic abc"}), 401)
        for scope, key in keys_of_scope.items():
            r = await c.request(method, path, json=body, headers=bearer(key))
            if scope == needed:
                assert r.status_code not in (401, 403), (path, scope, r.text)
            else:
                assert refused(r, 403)["code"] == "scope_missing", (path, scope)
    assert (await c.get("/health")).status_code == 200  # liveness needs no key
    # nothing refused reached the upstream: only the calls of the inference key did
    assert len(upstream.state.calls) == 2


async def test_tenants_are_isolated_and_feedback_tokens_grant_one_trajectory(
        rl_config: Any, created_topics: Any,
        gateway_client: tuple[httpx.AsyncClient, Gateway, Starlette, Path]) -> None:
    c, gateway, upstream, _ = gateway_client
    acme, globex = bearer(ACME_KEY), bearer(GLOBEX_KEY)
    r = await c.post("/v1/chat/completions", json=CHAT, headers=acme)
    assert r.status_code == 200
    acme_tid, acme_token = r.headers["x-rlstream-trajectory-id"], r.headers["x-rlstream-feedback-token"]
    s = await c.post("/s/shared-name/v1/chat/completions", json=CHAT, headers=acme)
    assert s.headers["x-rlstream-session-id"] == "shared-name"
    g = await c.post("/s/shared-name/v1/chat/completions", json=CHAT, headers=globex)
    globex_tid, globex_token = g.headers["x-rlstream-trajectory-id"], g.headers["x-rlstream-feedback-token"]
    assert g.headers["x-rlstream-session-id"] == "shared-name"
    assert globex_tid != s.headers["x-rlstream-trajectory-id"]  # equal session names, two tenants, two sessions

    # another tenant's key can neither reward, end nor probe: the same 404 as for what does not exist
    theirs = await c.post("/v1/feedback", json={"trajectory_id": acme_tid, "reward": 0.5}, headers=globex)
    nothing = await c.post("/v1/feedback", json={"trajectory_id": "0" * 32, "reward": 0.5}, headers=globex)
    assert refused(theirs, 404)["code"] == refused(nothing, 404)["code"]
    assert theirs.json()["error"]["message"].replace(acme_tid, "X") == nothing.json()["error"]["message"].replace(
        "0" * 32, "X")
    assert refused(await c.post("/v1/sessions/only-acme/end", headers=globex), 404)
    await c.post("/s/only-acme/v1/chat/completions", json=CHAT, headers=acme)
    assert refused(await c.post("/v1/sessions/only-acme/end", headers=globex), 404)["message"] == refused(
        await c.post("/v1/sessions/never-was/end", headers=globex), 404)["message"].replace("never-was", "only-acme")
    assert refused(await c.post("/v1/feedback", json={"session_id": "only-acme", "reward": 1.0}, headers=globex),
                   404)
    # a token of another trajectory, a forged token, an expired token
    other = await c.post("/v1/feedback", json={"trajectory_id": acme_tid, "reward": 0.5},
                         headers={"x-rlstream-feedback-token": globex_token})
    assert refused(other, 404)
    forged = acme_token[:-4] + ("AAAA" if not acme_token.endswith("AAAA") else "BBBB")
    assert refused(await c.post("/v1/feedback", json={"reward": 0.5},
                                headers={"x-rlstream-feedback-token": forged}), 401)["code"] == "invalid_feedback_token"
    expired = FeedbackSigner(SECRET, ttl_s=600).issue("acme", "trajectory", acme_tid, now=time.time() - 601)
    assert refused(await c.post("/v1/feedback", json={"reward": 0.5}, headers={"x-rlstream-feedback-token": expired}),
                   401)["code"] == "feedback_token_expired"
    assert refused(await c.post("/v1/feedback", json={"reward": 0.5}), 401)["code"] == "missing_api_key"
    rejected = gateway.limit_stats.rejected  # counted by reason (metric gateway/requests_rejected)
    assert rejected["invalid_feedback_token"] == 1 and rejected["feedback_token_expired"] == 1

    # the right party: the token alone (a browser, no key; also as the bearer credential), or the tenant's key
    ok_token = await c.post("/v1/feedback", json={"reward": 1.0, "feedback_id": "thumb-1"},
                            headers={"x-rlstream-feedback-token": acme_token})
    assert ok_token.status_code == 202 and ok_token.json()["trajectory_id"] == acme_tid
    assert (await c.post("/v1/feedback", json={"reward": 0.25}, headers=bearer(globex_token))).status_code == 202
    by_response = await c.post("/v1/responses", json={"model": POLICY, "input": "hi"}, headers=acme)
    response_id = by_response.json()["id"]
    assert refused(await c.post("/v1/feedback", json={"response_id": response_id, "reward": 0.5}, headers=globex),
                   404)
    ok_key = await c.post("/v1/feedback", json={"response_id": response_id, "reward": -0.5},
                          headers=bearer(ACME_FEEDBACK_ONLY))
    assert ok_key.status_code == 202 and ok_key.json()["trajectory_id"] == by_response.headers[
        "x-rlstream-trajectory-id"]

    # a session token grants the session's latest trajectory, of its own tenant only
    signer = FeedbackSigner(SECRET, ttl_s=600)
    session_token = {"x-rlstream-feedback-token": signer.issue("acme", "session", "acme:shared-name")}
    by_session = await c.post("/v1/feedback", json={"reward": 0.75}, headers=session_token)
    assert by_session.status_code == 202 and by_session.json()["trajectory_id"] == s.headers[
        "x-rlstream-trajectory-id"]
    assert refused(await c.post("/v1/feedback", json={"reward": 0.75}, headers={
        "x-rlstream-feedback-token": signer.issue("globex", "session", "globex:only-acme")}), 404)

    # tasks: the key's default, one it may name, one it may not
    assert (await c.post("/v1/chat/completions", json=CHAT, headers={**acme, "x-rlstream-task": "acme-eval"})
            ).status_code == 200
    assert refused(await c.post("/v1/chat/completions", json=CHAT, headers={**acme, "x-rlstream-task": "globex"}),
                   403)["code"] == "task_not_allowed"
    # models: one the key may not call is refused; another the key may call passes through, not captured
    assert refused(await c.post("/v1/chat/completions", json={**CHAT, "model": "other-model"}, headers=globex),
                   403)["code"] == "model_not_allowed"
    passed = await c.post("/v1/chat/completions", json={**CHAT, "model": "other-model"}, headers=acme)
    assert passed.status_code == 200 and "x-rlstream-trajectory-id" not in passed.headers
    assert upstream.state.calls[-1] == "other-model"
    await gateway.stop()  # publishes the open sessions

    rewards = await read_topic(rl_config, created_topics.rewards, RewardEvent, expect=4)
    assert sorted((r.trajectory_id, r.reward, r.feedback_id) for r in rewards) == sorted([
        (acme_tid, 1.0, "thumb-1"), (globex_tid, 0.25, None), (s.headers["x-rlstream-trajectory-id"], 0.75, None),
        (by_response.headers["x-rlstream-trajectory-id"], -0.5, None)])
    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=6)
    tasks = {e.trajectory_id: e.metadata.get("task") for e in events}
    assert tasks[acme_tid] == "acme" and tasks[globex_tid] == "globex"
    assert {e.metadata.get("session_id") for e in events} >= {"acme:shared-name", "globex:shared-name"}
    assert "other-model" not in {t.model for e in events for t in e.turns}


@pytest.mark.parametrize("reward", ["NaN", "Infinity", "-Infinity", "1e200", '"1.0"', "true", "2.0", "-1000"])
async def test_rewards_are_validated_at_the_door(
        reward: str, rl_config: Any, created_topics: Any,
        gateway_client: tuple[httpx.AsyncClient, Gateway, Starlette, Path]) -> None:
    c, gateway, _, _ = gateway_client
    r = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(ACME_KEY))
    token = {"x-rlstream-feedback-token": r.headers["x-rlstream-feedback-token"]}
    before = gateway.capture.stats.queued
    for body in (f'{{"reward": {reward}}}', f'{{"reward": 0.5, "components": {{"c": {reward}}}}}'):
        bad = await c.post("/v1/feedback", content=body.encode(), headers=token)
        assert bad.status_code in (400, 422), (body, bad.text)  # NaN/Infinity literals: not JSON (400)
        assert bad.json()["error"]["message"]
        if bad.status_code == 422:
            problem = bad.json()["error"]["problems"][0]
            assert problem["field"].split(".")[0] in ("reward", "components"), problem
    assert (await c.post("/v1/feedback", json={"reward": 1}, headers=token)).status_code == 202  # an int is fine
    assert gateway.capture.stats.queued == before + 1  # only the valid reward went on
    rewards = await read_topic(rl_config, created_topics.rewards, RewardEvent, expect=1)
    assert [(e.trajectory_id, e.reward) for e in rewards] == [(r.headers["x-rlstream-trajectory-id"], 1.0)]


async def test_keys_file_reloads_without_a_restart_and_limits_answer_429(
        gateway_client: tuple[httpx.AsyncClient, Gateway, Starlette, Path]) -> None:
    c, gateway, _, keys_file = gateway_client
    new_key = "new-tenant-key-0123456789"
    assert refused(await c.get("/v1/models", headers=bearer(new_key)), 401)
    keys_file.write_text(json.dumps({"keys": [*KEYS_FILE["keys"], {"key": new_key, "tenant": "newco"}]}))
    gateway.keys._checked = 0.0  # the mtime check runs at most once a second
    assert (await c.get("/v1/models", headers=bearer(new_key))).status_code == 200
    keys_file.write_text("keys: [ {key: ")  # a broken edit fails closed: none of the file's keys is accepted
    gateway.keys._checked = 0.0
    assert refused(await c.get("/v1/models", headers=bearer(new_key)), 401)
    assert gateway.keys.reload_errors == 1
    keys_file.write_text(json.dumps(KEYS_FILE))  # fixed: its keys are back
    gateway.keys._checked = 0.0
    limited = bearer(LIMITED_KEY)
    assert [(await c.get("/v1/models", headers=limited)).status_code for _ in range(3)] == [200, 200, 429]
    assert refused(await c.get("/v1/models", headers=limited), 429)["code"] == "rate_limit_exceeded"
    assert gateway.limit_stats.rejected["rate_limit_exceeded"] == 2


def test_without_keys_only_loopback_serves_unless_insecure() -> None:
    assert exposure_problem("127.0.0.1", keys_enabled=False, insecure_no_auth=False) is None
    assert exposure_problem("::1", keys_enabled=False, insecure_no_auth=False) is None
    assert "--insecure-no-auth" in (exposure_problem("0.0.0.0", keys_enabled=False, insecure_no_auth=False) or "")
    assert exposure_problem("0.0.0.0", keys_enabled=True, insecure_no_auth=False) is None
    assert exposure_problem("10.1.2.3", keys_enabled=False, insecure_no_auth=True) is None
    assert KeyStore(["k" * 16]).authenticate("k" * 16) is not None
    with pytest.raises(ValueError):
        KeyStore(["short"])


async def test_simulated_users_send_the_key_and_are_refused_without_it(rl_config: Any, created_topics: Any) -> None:
    from rlstream.gateway.server import serving
    from rlstream.rollout.users import Population, UserPopulation

    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    key = "rls-" + "k" * 40
    gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                      port=0, policy=POLICY, served_model=POLICY, run_id=rl_config.run_id,
                                    session_idle_s=60), publisher,
                      client=httpx.AsyncClient(transport=httpx.ASGITransport(canned_upstream())),
                      access=AccessConfig(api_keys=[SecretStr(key)]))
    population = Population(concurrency=2, feedback_share=1.0, feedback_delay_s=(0.0, 0.0), second_turn_share=0.5,
                            langchain_share=0.0, task="toy", model=POLICY)
    examples = [{"prompt": "Repeat the letter c."}]
    try:
        async with serving(gateway) as url:
            figures = {}
            for sent_key in (key, None):  # the negative control: the same users without the key
                users = UserPopulation(url, examples, lambda example, answer: 1.0, population, api_key=sent_key)
                stop = asyncio.Event()
                asyncio.get_running_loop().call_later(1.5, stop.set)
                figures[sent_key] = await users.run(stop)
    finally:
        await publisher.close()
    with_key, without = figures[key], figures[None]
    assert with_key.requests > 0 and with_key.errors == 0 and with_key.feedback_sent > 0
    assert with_key.feedback_refused == 0
    assert without.errors > 0 and without.feedback_sent == 0


def test_gateway_serve_refuses_a_routable_address_without_keys(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rlstream.cli.app import app

    env = {"RLSTREAM_GATEWAY_API_KEYS": ""}
    refused_run = CliRunner().invoke(app, ["gateway", "serve", "--host", "0.0.0.0", "--port", "0"], env=env)
    assert refused_run.exit_code == 2 and "--insecure-no-auth" in refused_run.output, refused_run.output
    bad_keys = tmp_path / "keys.yaml"
    bad_keys.write_text(json.dumps({"keys": [{"key": "short-secret", "tenant": "acme"}]}))
    bad_keys.chmod(0o600)
    bad = CliRunner().invoke(app, ["gateway", "serve", "--api-keys-file", str(bad_keys)], env=env)
    assert bad.exit_code == 2 and "keys.0.key" in bad.output and "short-secret" not in bad.output, bad.output


def test_keys_are_masked_wherever_logs_and_reports_go() -> None:
    from rlstream.schemas.masking import mask_text

    key = "tenant-secret-key-" + "x" * 20
    store = KeyStore([key])
    assert key not in mask_text(f"error: bad header Bearer {key}")
    assert key not in repr(store.authenticate(key)) and store.authenticate(key + "!") is None
