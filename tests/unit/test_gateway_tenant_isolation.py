"""Hostile tenants: one tenant's flood never evicts another tenant's feedback state, `n` counts against rate limits,
feedback tokens only for keys that may give feedback (bound to that key, dead once it is revoked, two secrets while
rotating), and LangSmith's feedback-id map answers each tenant only about its own ids, after the credential."""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
from pydantic import SecretStr

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig, AuthRefusal, KeyStore, Principal
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.feedback_tokens import FeedbackSigner, FeedbackTokenError
from rlstream.gateway.service import GatewayOptions, prepare_gateway
from rlstream.gateway.sessions import SessionStore
from rlstream.gateway.upstreams import UpstreamAllowlist
from rlstream.schemas.config import RlstreamConfig
from tests.unit.test_gateway_sessions import FakePublisher

pytestmark = pytest.mark.unit

ACME = "acme-key-0123456789abcd"
ACME_2 = "acme-second-key-0123456"
ACME_INFER = "acme-inference-only-0123"
GLOBEX = "globex-key-0123456789ab"
GLOBEX_RPM = "globex-rpm-key-012345678"
SECRET = "s" * 32


def keys(*extra: dict[str, Any], drop: str | None = None) -> dict[str, Any]:
    entries = [{"key": ACME, "tenant": "acme"}, {"key": ACME_2, "tenant": "acme"},
               {"key": ACME_INFER, "tenant": "acme", "scopes": ["inference"]},
               {"key": GLOBEX, "tenant": "globex"},
               {"key": GLOBEX_RPM, "tenant": "globex", "rpm": 10}, *extra]
    return {"keys": [e for e in entries if e["key"] != drop]}


def upstream() -> Any:
    """vLLM's answers, each chat completion with its own id (``chatcmpl-N``) and ``n`` choices."""
    counter = itertools.count()

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        n = body.get("n") if isinstance(body.get("n"), int) else 1
        if request.url.path.endswith("/v1/completions"):  # a choice per prompt and n
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            return httpx.Response(200, json={"id": f"cmpl-{next(counter)}", "model": body.get("model"), "choices": [
                {"index": i, "text": "ok", "finish_reason": "stop", "prompt_token_ids": [1, 2], "token_ids": [3],
                 "logprobs": {"token_logprobs": [-0.25], "tokens": ["ok"]}} for i in range(n * len(prompts))]})
        return httpx.Response(200, json={
            "id": f"chatcmpl-{next(counter)}", "model": body.get("model"), "prompt_token_ids": [1, 2],
            "choices": [{"index": i, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                         "token_ids": [3], "logprobs": {"content": [{"token": "ok", "logprob": -0.25}]}}
                        for i in range(n)]})

    return answer


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Harness:
    def __init__(self, client: httpx.AsyncClient, gateway: Gateway, publisher: FakePublisher, keys_file: Path):
        self.c, self.gw, self.publisher, self.keys_file = client, gateway, publisher, keys_file

    async def chat(self, key: str, **extra: Any) -> httpx.Response:
        answer = await self.c.post("/v1/chat/completions", json={**CHAT, **extra}, headers=bearer(key))
        assert answer.status_code == 200, answer.text
        return answer


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(keys()))
    keys_file.chmod(0o600)
    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="m", served_model="m",
                                      remembered_trajectories=8, correction_window_s=600),  # updates are corrections
                      publisher, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream())),
                      access=AccessConfig(api_keys_file=keys_file, feedback_secret=SecretStr(SECRET)))
    gateway.keys.reload_check_s = 0.0
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            yield Harness(c, gateway, publisher, keys_file)
    finally:
        await gateway.stop()


# --- per-tenant bounds ----------------------------------------------------------------------------------------
async def _flood_then_reward(h: Harness, victim_key: str, flooder_key: str) -> list[int]:
    """The victim's call, then 10 calls with n=4 (40 trajectories, 10 response ids: past the bound of 8) by the
    flooder; the statuses of the victim's feedback by token, by response id and by trajectory id."""
    mine = await h.chat(victim_key)
    token, tid = mine.headers["x-rlstream-feedback-token"], mine.headers["x-rlstream-trajectory-id"]
    for _ in range(10):
        await h.chat(flooder_key, n=4)
    for _ in range(4):
        await h.chat(flooder_key)
    by_token = await h.c.post("/v1/feedback", json={"reward": 1.0}, headers={"x-rlstream-feedback-token": token})
    by_response = await h.c.post("/v1/feedback", json={"response_id": mine.json()["id"], "reward": 1.0},
                                 headers=bearer(victim_key))
    by_id = await h.c.post("/v1/feedback", json={"trajectory_id": tid, "reward": 1.0}, headers=bearer(victim_key))
    for answer in (by_token, by_response, by_id):
        assert answer.status_code != 202 or answer.json()["trajectory_id"] == tid
    return [by_token.status_code, by_response.status_code, by_id.status_code]


async def test_one_tenants_flood_does_not_evict_another_tenants_feedback(harness: Harness) -> None:
    assert await _flood_then_reward(harness, ACME, GLOBEX) == [202, 202, 202]


async def test_control_the_same_flood_within_one_shared_bound_evicts(harness: Harness) -> None:
    # the same flood from a key that shares the victim's bound (its own tenant) pushes the entry out: the bound is
    # real, and only per-tenant bounds keep another tenant's entry; the feedback token carries the trajectory's
    # example and group, so it needs no remembered entry
    assert await _flood_then_reward(harness, ACME, ACME_2) == [202, 404, 404]


def test_open_sessions_past_the_limit_close_the_newcomers_own_tenants_oldest() -> None:
    store = SessionStore(600, max_open=4, tenant_of=lambda s: s.split(":", 1)[0])
    victim, _ = store.begin("acme:keep", [1], [], 0)
    for i in range(10):
        store.begin(f"globex:{i}", [1], [], 0)
    assert "acme:keep" in store.open and store.open["acme:keep"] is victim
    assert sorted(store.open) == ["acme:keep", "globex:7", "globex:8", "globex:9"]
    # control: without tenants (one shared bound) the same flood closes it
    shared = SessionStore(600, max_open=4)
    shared.begin("acme:keep", [1], [], 0)
    for i in range(10):
        shared.begin(f"globex:{i}", [1], [], 0)
    assert "acme:keep" not in shared.open


async def test_n_counts_against_the_rate_limit(harness: Harness) -> None:
    await harness.chat(GLOBEX_RPM, n=8)  # 8 of its 10 a minute
    # control: a request with n=1 still fits (the 9th of 10)
    assert (await harness.c.post("/v1/chat/completions", json=CHAT, headers=bearer(GLOBEX_RPM))).status_code == 200
    refused = await harness.c.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers=bearer(GLOBEX_RPM))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "counts as 2" in refused.json()["error"]["message"]


async def test_n_as_a_whole_float_counts_as_its_integer(harness: Harness) -> None:
    # 8.0 is 8 choices for vLLM: it costs 8 of the key's 10 a minute, as n=8 does
    await harness.chat(GLOBEX_RPM, n=8.0)
    await harness.chat(GLOBEX_RPM)  # the 9th
    refused = await harness.c.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers=bearer(GLOBEX_RPM))
    assert refused.status_code == 429 and "counts as 2" in refused.json()["error"]["message"]


async def test_completions_count_each_choice_of_each_prompt_against_the_rate_limit(harness: Harness) -> None:
    completion = {"model": "m", "prompt": ["a", "b"], "n": 4}  # 8 choices
    answer = await harness.c.post("/v1/completions", json=completion, headers=bearer(GLOBEX_RPM))
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 8
    # control: one prompt with n=1 still fits (the 9th of 10); two prompts do not
    single = await harness.c.post("/v1/completions", json={"model": "m", "prompt": "a"}, headers=bearer(GLOBEX_RPM))
    assert single.status_code == 200
    refused = await harness.c.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]},
                                   headers=bearer(GLOBEX_RPM))
    assert refused.status_code == 429 and "counts as 2" in refused.json()["error"]["message"]


async def test_completions_past_max_choices_in_all_are_refused_before_the_upstream(harness: Harness) -> None:
    limit = harness.gw.config.max_choices
    many = {"model": "m", "prompt": ["a"] * (limit // 2 + 1), "n": 2}  # n alone is allowed; n x prompts is not
    refused = await harness.c.post("/v1/completions", json=many, headers=bearer(ACME))
    assert refused.status_code == 400 and f"at most {limit}" in refused.json()["error"]["message"]
    assert harness.gw.limit_stats.rejected.get("bad_n") == 1
    # control: the same prompts with n=1 fit (within max_choices) and are answered
    fits = await harness.c.post("/v1/completions", json={**many, "n": 1}, headers=bearer(ACME))
    assert fits.status_code == 200 and len(fits.json()["choices"]) == limit // 2 + 1


def test_charge_counts_n_minus_one_on_top_of_the_request() -> None:
    store = KeyStore()
    principal = Principal(tenant="t", label="l", key_id="k", scopes=frozenset({"inference"}), models=None,
                          tasks=("t",), rpm=10)
    store.acquire(principal, now=0.0)
    store.charge(principal, 7, now=0.0)  # n=8: 8 of 10
    store.acquire(principal, now=0.0)  # the 9th
    with pytest.raises(AuthRefusal):
        store.charge(principal, 2, now=0.0)  # n=3 needs 2 more: 1 is left
    store.charge(principal, 2, now=6.0)  # a minute refills 10: 6 s one more
    with pytest.raises(AuthRefusal, match="more than this API key's 10 per minute"):
        KeyStore().charge(principal, 10, now=0.0)  # n=11 can never fit


# --- feedback tokens ------------------------------------------------------------------------------------------
async def test_a_key_without_the_feedback_scope_gets_no_token(harness: Harness) -> None:
    answer = await harness.chat(ACME_INFER)
    assert "x-rlstream-feedback-token" not in answer.headers
    assert "x-rlstream-feedback-tokens" not in (await harness.chat(ACME_INFER, n=2)).headers
    tid = answer.headers["x-rlstream-trajectory-id"]
    refused = await harness.c.post("/v1/feedback", json={"trajectory_id": tid, "reward": 1.0},
                                   headers=bearer(ACME_INFER))
    assert refused.status_code == 403
    # control: a key of the same tenant with the feedback scope gets a token that rewards
    allowed = await harness.chat(ACME)
    token = allowed.headers["x-rlstream-feedback-token"]
    assert (await harness.c.post("/v1/feedback", json={"reward": 1.0},
                                 headers={"x-rlstream-feedback-token": token})).status_code == 202


async def test_a_token_dies_with_the_key_that_caused_it(harness: Harness) -> None:
    revoked = (await harness.chat(ACME)).headers["x-rlstream-feedback-token"]
    kept = (await harness.chat(ACME_2)).headers["x-rlstream-feedback-token"]
    assert harness.gw.signer.verify(revoked).key_id != harness.gw.signer.verify(kept).key_id
    harness.keys_file.write_text(json.dumps(keys(drop=ACME)))  # the keys file reloads without ACME
    answer = await harness.c.post("/v1/feedback", json={"reward": 1.0}, headers={"x-rlstream-feedback-token": revoked})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "feedback_token_revoked"
    assert (await harness.c.post("/v1/feedback", json={"reward": 0.5}, headers=bearer(revoked))).status_code == 401
    # control: the token of a key still in the file is accepted after the same reload
    assert (await harness.c.post("/v1/feedback", json={"reward": 1.0},
                                 headers={"x-rlstream-feedback-token": kept})).status_code == 202


@pytest.mark.parametrize("change", ["scope", "tenant"])
async def test_a_token_dies_when_its_key_may_no_longer_reward_its_tenant(harness: Harness, change: str) -> None:
    token = (await harness.chat(ACME)).headers["x-rlstream-feedback-token"]
    kept = (await harness.chat(ACME_2)).headers["x-rlstream-feedback-token"]
    changed = {"key": ACME, "tenant": "acme", "scopes": ["inference"]} if change == "scope" else {
        "key": ACME, "tenant": "initech"}
    entries = [changed if e["key"] == ACME else e for e in keys()["keys"]]
    harness.keys_file.write_text(json.dumps({"keys": entries}))  # the key stays, without the grant
    assert harness.gw.keys.authenticate(ACME) is not None  # not revoked
    answer = await harness.c.post("/v1/feedback", json={"reward": 1.0}, headers={"x-rlstream-feedback-token": token})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "feedback_token_revoked"
    # control: the token of a key of the same tenant that kept the feedback scope is accepted after the same reload
    assert (await harness.c.post("/v1/feedback", json={"reward": 1.0},
                                 headers={"x-rlstream-feedback-token": kept})).status_code == 202


def test_rotation_both_secrets_verify_only_the_current_signs() -> None:
    old, new = "o" * 32, "n" * 32
    before = FeedbackSigner(old, 60).issue("acme", "trajectory", "t-1", key_id="k")
    rotating = FeedbackSigner(new, 60, previous=old)
    assert rotating.verify(before).target_id == "t-1"
    issued = rotating.issue("acme", "trajectory", "t-2", key_id="k")
    assert FeedbackSigner(new, 60).verify(issued).target_id == "t-2"  # signed with the current secret
    with pytest.raises(FeedbackTokenError):
        FeedbackSigner(old, 60).verify(issued)
    # control: once the previous secret is dropped, its tokens are refused
    with pytest.raises(FeedbackTokenError):
        FeedbackSigner(new, 60).verify(before)


async def test_a_rotating_gateway_takes_the_tokens_of_the_previous_secret(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotation through the configuration (gateway.feedback_secret, gateway.feedback_secret_previous): a gateway
    signing with the new secret accepts what one with the old secret issued; without the previous secret it does
    not (the control)."""
    monkeypatch.delenv("RLSTREAM_GATEWAY_API_KEYS", raising=False)
    monkeypatch.delenv("RLSTREAM_GATEWAY_FEEDBACK_SECRET", raising=False)
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(keys()))
    keys_file.chmod(0o600)
    old, new = "o" * 32, "n" * 32

    async def post(secret: str, previous: str | None, path: str, headers: dict[str, str],
                   body: dict[str, Any]) -> httpx.Response:
        cfg = RlstreamConfig.model_validate({"policy": "m", "gateway": {
            "spool": False, "session_stitching": "gateway", "api_keys_file": str(keys_file),
            "feedback_secret": secret, "feedback_secret_previous": previous}})
        prepared = prepare_gateway(cfg, GatewayOptions())
        gateway = Gateway(prepared.gw, FakePublisher(), access=prepared.access,
                          client=httpx.AsyncClient(transport=httpx.MockTransport(upstream())))
        await gateway.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)),
                                         base_url="http://gw") as c:
                return await c.post(path, json=body, headers=headers)
        finally:
            await gateway.stop()

    issued = await post(old, None, "/v1/chat/completions", bearer(ACME), CHAT)
    token = {"x-rlstream-feedback-token": issued.headers["x-rlstream-feedback-token"]}
    assert (await post(new, old, "/v1/feedback", token, {"reward": 1.0})).status_code == 202
    refused = await post(new, None, "/v1/feedback", token, {"reward": 1.0})  # control: the old secret dropped
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_feedback_token"
    fresh = await post(new, old, "/v1/chat/completions", bearer(ACME), CHAT)  # signed with the new secret only
    fresh_token = {"x-rlstream-feedback-token": fresh.headers["x-rlstream-feedback-token"]}
    assert (await post(new, None, "/v1/feedback", fresh_token, {"reward": 1.0})).status_code == 202
    assert (await post(old, None, "/v1/feedback", fresh_token, {"reward": 1.0})).status_code == 401


# --- LangSmith's feedback ids -----------------------------------------------------------------------------------
async def _langsmith(h: Harness, key: str, feedback_id: str) -> str:
    tid = (await h.chat(key)).headers["x-rlstream-trajectory-id"]
    posted = await h.c.post("/feedback", json={"run_id": tid, "key": "q", "score": 1.0, "id": feedback_id},
                            headers={"x-api-key": key})
    assert posted.status_code == 200, posted.text
    return tid


async def test_another_tenants_feedback_id_is_unknown_and_names_nothing(harness: Harness) -> None:
    acme_tid = await _langsmith(harness, ACME, "fb-1")
    answer = await harness.c.patch("/feedback/fb-1", json={"score": 0.0}, headers={"x-api-key": GLOBEX})
    assert answer.status_code == 404 and acme_tid not in answer.text
    # control: the owner's update reaches its trajectory
    own = await harness.c.patch("/feedback/fb-1", json={"score": 0.0}, headers={"x-api-key": ACME})
    assert own.status_code == 200 and own.json()["run_id"] == acme_tid


async def test_an_unauthenticated_update_learns_nothing_about_ids(harness: Harness) -> None:
    await _langsmith(harness, ACME, "fb-known")
    known = await harness.c.patch("/feedback/fb-known", json={"score": 0.0})
    unknown = await harness.c.patch("/feedback/fb-never", json={"score": 0.0})
    assert known.status_code == unknown.status_code == 401
    assert known.json()["error"]["code"] == unknown.json()["error"]["code"]
    # control: with a key, an unknown id is a 404 (so the 401 above is the credential check, not the id)
    assert (await harness.c.patch("/feedback/fb-never", json={"score": 0.0},
                                  headers={"x-api-key": ACME})).status_code == 404


async def test_a_second_tenant_reusing_an_id_does_not_overwrite_the_first(harness: Harness) -> None:
    acme_tid = await _langsmith(harness, ACME, "shared-id")
    globex_tid = await _langsmith(harness, GLOBEX, "shared-id")
    acme = await harness.c.patch("/feedback/shared-id", json={"score": 0.0}, headers={"x-api-key": ACME})
    globex = await harness.c.patch("/feedback/shared-id", json={"score": 0.0}, headers={"x-api-key": GLOBEX})
    assert (acme.json()["run_id"], globex.json()["run_id"]) == (acme_tid, globex_tid)
    assert (acme.json()["rlstream"]["trajectory_id"], globex.json()["rlstream"]["trajectory_id"]) == (
        acme_tid, globex_tid)


# --- upstream allowlist ---------------------------------------------------------------------------------------
def test_the_upstream_allowlist_admits_listed_hosts_and_networks_only() -> None:
    allow = UpstreamAllowlist.parse(["vllm-0.internal", "10.1.0.0/16", "fd00::/8"])
    for url in ("http://vLLM-0.internal:8000/v1", "http://10.1.2.3:9000", "http://[fd00::1]:8000"):
        assert allow.allows(url), url
    for url in ("http://evil.example:8000", "http://10.2.0.1:8000", "http://vllm-0.internal@evil.example/v1",
                "http://vllm-0.internal.evil.example", "not a url", "http://[fe80::1]:8000"):
        assert not allow.allows(url), url
    assert allow.refused == 6
    # without entries: the configured upstreams' hosts (any port); '*': anything (the control)
    default = UpstreamAllowlist.parse([], ["http://127.0.0.1:8000", "https://user:pw@vllm.svc/v1"])
    assert default.allows("http://127.0.0.1:9001") and default.allows("http://vllm.svc:8000")
    assert not default.allows("http://127.0.0.2:8000")
    assert UpstreamAllowlist.parse(["*"]).allows("http://evil.example:8000")
    with pytest.raises(ValueError):
        UpstreamAllowlist.parse(["http://x/ y"])
