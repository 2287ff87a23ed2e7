"""The gateway's ids and wiring, in-process against a canned upstream: feedback addressed by a Chat Completions
response id, the session ids ``POST /v1/sessions`` issues, ``max_session_bytes``, and the feedback token lifetime
``rlstream gateway serve`` wires in."""
from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.feedback_tokens import FeedbackTokenError
from rlstream.gateway.service import GatewayOptions, prepare_gateway
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from tests.unit.test_gateway_limits import CHAT, gateway_client
from tests.unit.test_gateway_sessions import USER, FakePublisher, fake_upstream

ACME_KEY = "acme-key-0123456789abcdef"
GLOBEX_KEY = "globex-key-0123456789abcd"


def numbered_upstream() -> httpx.MockTransport:
    """A chat upstream whose answers carry ids ``chatcmpl-1``, ``chatcmpl-2``, ... (streamed or whole)."""
    counter = itertools.count(1)

    def answer(request: httpx.Request) -> httpx.Response:
        body, rid = json.loads(request.content), f"chatcmpl-{next(counter)}"
        if body.get("stream"):
            chunks = [{"id": rid, "prompt_token_ids": [1, 2], "choices": [
                          {"index": 0, "delta": {"role": "assistant", "content": "ok"}, "token_ids": [3]}]},
                      {"id": rid, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"id": rid, "object": "chat.completion", "model": body["model"],
                                         "prompt_token_ids": [1, 2], "choices": [
                                             {"index": 0, "message": {"role": "assistant", "content": "ok"},
                                              "finish_reason": "stop", "token_ids": [3]}]})
    return httpx.MockTransport(answer)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_feedback_by_chat_completion_id_reaches_its_trajectory_of_its_tenant_only(
        tmp_path: Path, stream: bool) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"key": ACME_KEY, "tenant": "acme"}, {"key": GLOBEX_KEY, "tenant": "globex"}]))
    keys.chmod(0o600)
    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="m", served_model="m"), publisher,
                      client=httpx.AsyncClient(transport=numbered_upstream()), access=AccessConfig(api_keys_file=keys))
    await gateway.start()
    acme, globex = {"authorization": f"Bearer {ACME_KEY}"}, {"authorization": f"Bearer {GLOBEX_KEY}"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            tids = []
            for _ in range(2):  # chatcmpl-1 and chatcmpl-2: feedback on the second must not land on the first
                r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=acme)
                assert r.status_code == 200, r.text
                tids.append(r.headers["x-rlstream-trajectory-id"])
            ok = await c.post("/v1/feedback", json={"response_id": "chatcmpl-2", "reward": 0.5}, headers=acme)
            assert ok.status_code == 202 and ok.json()["trajectory_id"] == tids[1], ok.text
            theirs = await c.post("/v1/feedback", json={"response_id": "chatcmpl-1", "reward": 0.5}, headers=globex)
            missing = await c.post("/v1/feedback", json={"response_id": "chatcmpl-9", "reward": 0.5}, headers=acme)
            assert theirs.status_code == missing.status_code == 404
            assert theirs.json()["error"]["message"].replace("chatcmpl-1", "X") == \
                missing.json()["error"]["message"].replace("chatcmpl-9", "X")
    finally:
        await gateway.stop()
    rewards = [(e.trajectory_id, e.reward) for _, e in publisher.sent if isinstance(e, RewardEvent)]
    assert rewards == [(tids[1], 0.5)]


async def test_issued_session_ids_are_unguessable_and_address_a_session() -> None:
    publisher = FakePublisher()
    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway",
                                                      session_idle_s=600), publisher=publisher)
    try:
        issued = []
        for _ in range(20):
            r = await c.post("/v1/sessions")
            assert r.status_code == 201
            issued.append(r.json()["session_id"])
        assert len(set(issued)) == 20
        assert all(re.fullmatch(r"[A-Za-z0-9_-]{32,}", sid) for sid in issued), issued  # 24 random bytes, url-safe
        sid = issued[0]
        first = await c.post(f"/s/{sid}/v1/chat/completions", json=CHAT)
        more = [USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        second = await c.post(f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": more})
        assert first.headers["x-rlstream-session-id"] == second.headers["x-rlstream-session-id"] == sid
        tid = first.headers["x-rlstream-trajectory-id"]
        assert second.headers["x-rlstream-trajectory-id"] == tid
        ended = await c.post(f"/v1/sessions/{sid}/end")
        assert ended.json() == {"session_id": sid, "trajectory_id": tid, "published": True}
    finally:
        await c.aclose()
        await gateway.stop()
    events = [e for _, e in publisher.sent if isinstance(e, TrajectoryEvent)]
    assert [(e.trajectory_id, e.metadata["session_id"], len(e.turns)) for e in events] == [(tid, sid, 2)]


@pytest.mark.parametrize("max_session_bytes,split", [(1024, True), (8 << 20, False)], ids=["over", "under-control"])
async def test_a_session_past_max_session_bytes_is_split_before_its_next_call(max_session_bytes: int,
                                                                             split: bool) -> None:
    """The bound is checked as a call begins: the call that crosses it still joins its trajectory; the next call
    that continues the conversation starts a new one, the full trajectory is published, the split counted."""
    publisher = FakePublisher()
    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway",
                                                      max_session_bytes=max_session_bytes, session_idle_s=600),
                                      publisher=publisher)
    try:
        history = [{"role": "user", "content": "x" * 600}]  # each call holds ~640 bytes: 2 calls pass 1024
        tids, sizes = [], []
        for turn in range(3):
            r = await c.post("/s/big/v1/chat/completions", json={"model": "m", "messages": history})
            tids.append(r.headers["x-rlstream-trajectory-id"])
            sizes.append(gateway.sessions.open["big"].approx_bytes)
            history = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"more {turn}"}]
        assert sizes[0] < 1024 <= sizes[1]
        assert tids[0] == tids[1]
        assert (tids[2] != tids[1]) is split
        assert (gateway.sessions.splits_long, gateway.sessions.splits) == ((1, 0) if split else (0, 0))
        assert (await c.get("/rlstream/stats")).json()["session_splits_long"] == int(split)
    finally:
        await c.aclose()
        await gateway.stop()  # publishes the session's open trajectory too
    published = [(e.trajectory_id, len(e.turns)) for _, e in publisher.sent if isinstance(e, TrajectoryEvent)]
    assert published == ([(tids[0], 2), (tids[2], 1)] if split else [(tids[0], 3)])


async def test_feedback_tokens_live_as_long_as_the_reward_window_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLSTREAM_GATEWAY_API_KEYS", raising=False)
    cfg = RlstreamConfig.model_validate({"streams": {"reward_window_s": 1234.0},  # not AccessConfig's 86,400
                                         "gateway": {"spool": False, "session_stitching": "gateway"}})
    explicit = cfg.model_copy(update={"gateway": cfg.gateway.model_copy(update={"feedback_token_ttl_s": 60.0})})
    assert prepare_gateway(explicit).access.feedback_token_ttl_s == 60.0  # an explicit lifetime wins
    prepared = prepare_gateway(cfg, GatewayOptions())
    assert prepared.access.feedback_token_ttl_s == 1234.0
    gateway = Gateway(prepared.gw, FakePublisher(), client=httpx.AsyncClient(transport=httpx.MockTransport(
        fake_upstream)), access=prepared.access)
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            before = time.time()
            token = (await c.post("/v1/chat/completions", json={"model": cfg.policy, "messages": [USER]})
                     ).headers["x-rlstream-feedback-token"]
            after = time.time()
    finally:
        await gateway.stop()
    assert gateway.signer.verify(token, now=before + 1233).target_id  # still valid just inside the window
    with pytest.raises(FeedbackTokenError) as expired:
        gateway.signer.verify(token, now=after + 1234)
    assert expired.value.expired
