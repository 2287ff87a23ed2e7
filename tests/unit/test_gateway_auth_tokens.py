"""Gateway keys and feedback tokens on their own: signatures, expiry, tampering, the keys file, per-key limits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.rollout.gateway.auth import AuthRefusal, KeyStore, Principal, task_for
from rlstream.rollout.gateway.feedback import Feedback
from rlstream.rollout.gateway.feedback_tokens import FeedbackSigner, FeedbackTokenError, is_feedback_token


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
