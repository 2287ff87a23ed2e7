"""Gateway keys and feedback tokens on their own: signatures, expiry, tampering, the keys file, per-key limits."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig, AuthRefusal, KeyStore, Principal, task_for
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.feedback import Feedback
from rlstream.gateway.feedback_tokens import FeedbackSigner, FeedbackTokenError, is_feedback_token
from tests.unit.test_gateway_fuzz import canned_upstream
from tests.unit.test_gateway_sessions import FakePublisher


def test_a_token_grants_its_tenant_and_trajectory_until_it_expires() -> None:
    signer = FeedbackSigner(b"k" * 32, ttl_s=60)
    token = signer.issue("acme", "trajectory", "t-1", now=1000.0)
    assert is_feedback_token(token)
    grant = signer.verify(token, now=1059.0)
    assert (grant.tenant, grant.kind, grant.target_id) == ("acme", "trajectory", "t-1")
    with pytest.raises(FeedbackTokenError) as expired:
        signer.verify(token, now=1060.0)
    assert expired.value.expired


def test_a_token_of_another_secret_or_with_an_edited_payload_is_refused() -> None:
    signer = FeedbackSigner(b"k" * 32, ttl_s=60)
    token = signer.issue("acme", "trajectory", "t-1")
    with pytest.raises(FeedbackTokenError):
        FeedbackSigner(b"j" * 32, ttl_s=60).verify(token)
    prefix, payload, mac = token.split(".")
    other = signer.issue("globex", "trajectory", "t-1").split(".")[1]
    for forged in (f"{prefix}.{other}.{mac}", f"{prefix}.{payload}.", token + "x", "rlsft1.", "rlsft1.a.b.c"):
        with pytest.raises(FeedbackTokenError) as refused:
            signer.verify(forged)
        assert not refused.value.expired
    with pytest.raises(ValueError):
        FeedbackSigner(b"short", ttl_s=60)


def test_keys_file_as_a_bare_list_and_per_key_concurrency(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "a" * 20, "tenant": "acme", "max_concurrent": 1, "tasks": ["t1", "t2"]}]))
    path.chmod(0o600)
    store = KeyStore(keys_file=path)
    principal = store.authenticate("a" * 20)
    assert isinstance(principal, Principal) and principal.tenant == "acme" and store.authenticate("b" * 20) is None
    store.acquire(principal)
    with pytest.raises(AuthRefusal) as busy:
        store.acquire(principal)
    assert busy.value.status == 429 and busy.value.code == "concurrency_limit_exceeded"
    store.release(principal)
    store.acquire(principal)  # a slot again once the first finished
    assert task_for(principal, None) == "t1" and task_for(principal, "t2") == "t2"
    with pytest.raises(AuthRefusal):
        task_for(principal, "t3")


def test_rpm_refills_over_the_minute() -> None:
    store = KeyStore()
    principal = Principal(tenant="t", label="l", key_id="k", scopes=frozenset({"inference"}), models=None,
                          tasks=("t",), rpm=60)
    for _ in range(60):
        store.acquire(principal, now=0.0)
        store.release(principal)
    with pytest.raises(AuthRefusal):
        store.acquire(principal, now=0.5)
    store.acquire(principal, now=1.0)  # one more a second


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), 1e200, "1.0", True, None, 2.0])
def test_feedback_rewards_are_strict_finite_numbers_in_range(reward: object) -> None:
    context = {"reward_range": (-1.0, 1.0)}
    with pytest.raises(ValueError):
        Feedback.model_validate({"trajectory_id": "t", "reward": reward}, context=context)
    with pytest.raises(ValueError):
        Feedback.model_validate({"trajectory_id": "t", "reward": 0.0, "components": {"c": reward}},
                                context=context)
    ok = Feedback.model_validate({"trajectory_id": "t", "reward": 1, "components": {"c": -1},
                                  "feedback_id": "f"}, context=context)
    assert ok.reward == 1.0 and ok.feedback_id == "f"


# --- fuzzing the keyed app: credentials, tokens and feedback bodies never get a 500 ---------------------------
_KEY = "fuzz-key-0123456789abcdef"
_SIGNER_SECRET = "f" * 32
_credentials = st.one_of(
    st.none(), st.text(max_size=60), st.just(f"Bearer {_KEY}"), st.just("Bearer "), st.just("bearer rlsft1."),
    st.builds(lambda t: f"Bearer rlsft1.{t}", st.text(alphabet="abcAB09-_.", max_size=60)),
    st.builds(lambda tenant, tid, ttl: "Bearer " + FeedbackSigner(_SIGNER_SECRET, ttl).issue(tenant, "trajectory", tid),
              st.sampled_from(["default", "acme", "", "a:b"]), st.text(max_size=40), st.sampled_from([-5.0, 60.0])))
_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.booleans(), st.text(max_size=5),
                     st.none(), st.lists(st.integers(), max_size=2))
_feedback = st.fixed_dictionaries({}, optional={
    "trajectory_id": st.text(max_size=40), "response_id": st.text(max_size=40), "session_id": st.text(max_size=40),
    "reward": _numbers, "components": st.dictionaries(st.text(max_size=8), _numbers, max_size=3),
    "feedback_id": st.one_of(st.text(max_size=20), st.integers()), "feedback_token": st.text(max_size=80),
    "other": st.text(max_size=5)})
_paths = st.sampled_from(["/v1/feedback", "/v1/feedback", "/v1/chat/completions", "/s/x/v1/chat/completions",
                          "/v1/sessions/x/end", "/v1/sessions", "/v1/models", "/rlstream/stats", "/nope"])


@settings(max_examples=int(os.environ.get("RLSTREAM_FUZZ_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(_paths, _credentials, _feedback, st.booleans()), min_size=1, max_size=6))
def test_keyed_gateway_never_answers_500(requests: list[tuple[str, str | None, dict[str, Any], bool]]) -> None:
    async def run() -> None:
        gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="m", served_model="m"), FakePublisher(),
                          client=httpx.AsyncClient(transport=httpx.MockTransport(canned_upstream)),
                          access=AccessConfig(api_keys=[SecretStr(_KEY)], feedback_secret=SecretStr(_SIGNER_SECRET)))
        await gateway.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)),
                                         base_url="http://gw") as c:
                tid = (await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                             "content": "hi"}]},
                                    headers={"authorization": f"Bearer {_KEY}"})).headers["x-rlstream-trajectory-id"]
                for path, credential, body, name_it in requests:
                    headers = {"authorization": credential.encode()} if credential is not None else {}
                    if path == "/v1/chat/completions":
                        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                    elif name_it:
                        body = {**body, "trajectory_id": tid}
                    if path in ("/v1/models", "/rlstream/stats"):
                        r = await c.get(path, headers=headers)
                    else:  # NaN and Infinity go out as the literals a hostile client would send
                        r = await c.post(path, content=json.dumps(body).encode(),
                                         headers={**headers, "content-type": "application/json"})
                    assert r.status_code < 500 or r.status_code == 503, (path, credential, body, r.text)
                    if r.status_code >= 400 and path != "/nope":  # an unknown path: the router's own 404
                        assert set(r.json()["error"]) >= {"message", "type", "code"}
                assert (await c.get("/health")).status_code == 200
        finally:
            await gateway.stop()

    asyncio.run(run())


def test_the_range_is_what_refuses_a_large_finite_reward() -> None:
    # negative control: without a range 1e200 and 2.0 pass the type checks; the task's range refuses them
    assert Feedback.model_validate({"trajectory_id": "t", "reward": 1e200}).reward == 1e200
    assert Feedback.model_validate({"trajectory_id": "t", "reward": 2.0},
                                   context={"reward_range": (-10.0, 10.0)}).reward == 2.0
    with pytest.raises(ValueError, match="outside the task's reward range"):
        Feedback.model_validate({"trajectory_id": "t", "reward": 2.0}, context={"reward_range": (-1.0, 1.0)})
