"""Gateways that share their state through Redis (rlstream/gateway/shared_ids.py), in-process over real sockets,
behind the project's round-robin balancer, in front of canned replicas, publishing to the real broker:

* feedback by id on any gateway: a call served by one gateway is scored on the other by trajectory id, response id,
  OTel ``gen_ai.response.id``, Langfuse ``traceId`` (the call's W3C trace id), LangSmith ``run_id`` (and its update
  on the first gateway), the feedback token alone, and after both gateways restarted: each reward reaches
  ``rewards`` once with its value. Control: gateways that keep the ids in memory answer the same feedback 404.
* the ids are bounded per tenant: one tenant's flood pushes out only its own oldest (control: the same flood by the
  victim's own tenant pushes its entry out).
* stateful Responses: a three-turn conversation by ``previous_response_id`` alternating between two gateways, each in
  front of its own replica (vLLM-like: no store), then a fourth turn after a restart, and a ``conversation`` across
  both: every upstream gets the whole input and never the state fields, every turn is captured once. Control:
  without shared state the second gateway answers 404."""
from __future__ import annotations

import base64
import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from pydantic import SecretStr

from rlstream.gateway.app import Gateway
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from tests.support.fleet_support import ReplicaLog, RoundRobinProxy, canned_replica
from tests.support.learner_helpers import read_topic

MODEL = "toy"
SECRET = "s" * 32
ACME = "acme-key-0123456789abcd"
GLOBEX = "globex-key-0123456789ab"
KEYS = {"keys": [{"key": ACME, "tenant": "acme"}, {"key": GLOBEX, "tenant": "globex"}]}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def traceparent(n: int) -> tuple[str, str, str]:
    """(header, trace id, span id) of the n-th traced call."""
    trace, span = f"{n + 1:032x}", f"{n + 0xabc:016x}"
    return f"00-{trace}-{span}-01", trace, span


class Fleet:
    """Gateways started and stopped on demand, all with the same keys, secret, publisher and (when ``shared``)
    Redis; each in front of the replica it is given."""

    def __init__(self, cfg: RlstreamConfig, keys_file: Path, publisher: TrajectoryPublisher, shared: bool,
                 capacity: int = 10_000, correction_window_s: float = 600.0) -> None:
        self.cfg, self.keys_file, self.publisher = cfg, keys_file, publisher
        self.shared, self.capacity, self.correction_window_s = shared, capacity, correction_window_s
        self.stack = contextlib.AsyncExitStack()

    async def start(self, replica: ReplicaLog) -> str:
        control = ControlPlane(str(self.cfg.redis.url)) if self.shared else None
        if control is not None:
            self.stack.push_async_callback(control.close)
        gateway = Gateway(GatewaySettings(port=0, policy=self.cfg.policy, served_model=MODEL, run_id=self.cfg.run_id,
                                          upstream_url=replica.url, remembered_trajectories=self.capacity,
                                          correction_window_s=self.correction_window_s, spool=False),
                          self.publisher, control=control,
                          access=AccessConfig(api_keys_file=self.keys_file, feedback_secret=SecretStr(SECRET),
                                              reward_range=(-1.0, 1.0)))
        return await self.stack.enter_async_context(serving(gateway))

    async def stop_all(self) -> None:
        await self.stack.aclose()
        self.stack = contextlib.AsyncExitStack()


@contextlib.asynccontextmanager
async def fleet(cfg: RlstreamConfig, tmp_path: Path, shared: bool, capacity: int = 10_000,
                correction_window_s: float = 600.0) -> AsyncIterator[Fleet]:
    """Gateways whose corrections (LangSmith's update) fall within the correction window unless it is given."""
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    keys_file.chmod(0o600)
    names = TopicNames.from_config(cfg.topics)
    publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards)
    await publisher.start()
    gateways = Fleet(cfg, keys_file, publisher, shared, capacity, correction_window_s)
    try:
        yield gateways
    finally:
        await gateways.stop_all()
        await publisher.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def chat(http: httpx.AsyncClient, url: str, key: str, text: str, trace: str | None = None) -> httpx.Response:
    headers = {**bearer(key), "connection": "close"}  # one connection per call: the balancer alternates
    if trace:
        headers["traceparent"] = trace
    answer = await http.post(f"{url}/v1/chat/completions", headers=headers,
                             json={"model": MODEL, "messages": [{"role": "user", "content": text}]})
    assert answer.status_code == 200, answer.text
    return answer


def otlp(response_id: str, name: str, score: float) -> dict[str, Any]:
    attributes = [{"key": "gen_ai.response.id", "value": {"stringValue": response_id}},
                  {"key": "gen_ai.evaluation.name", "value": {"stringValue": name}},
                  {"key": "gen_ai.evaluation.score.value", "value": {"doubleValue": score}}]
    return {"resourceLogs": [{"scopeLogs": [{"logRecords": [
        {"eventName": "gen_ai.evaluation.result", "attributes": attributes}]}]}]}


def langfuse_auth(key: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"pk-lf-test:{key}".encode()).decode()}


async def score_everything(http: httpx.AsyncClient, on: dict[int, str], calls: list[tuple[int, httpx.Response]],
                           traces: dict[int, tuple[str, str, str]]) -> tuple[list[int], dict[str, float]]:
    """Score each call on the gateway that did not serve it, one way per call; (statuses, the reward each
    trajectory should get)."""
    def other(served: int) -> str:
        return on[1 - served]

    (s0, _), (s1, c1), (s2, c2), (s3, c3), (s4, _), (s5, _) = calls
    tid = [c.headers["x-rlstream-trajectory-id"] for _, c in calls]
    answers = [
        await http.post(f"{other(s0)}/v1/feedback", headers=bearer(ACME), json={"trajectory_id": tid[0],
                                                                               "reward": 0.1}),
        await http.post(f"{other(s1)}/v1/feedback", headers=bearer(ACME), json={"response_id": c1.json()["id"],
                                                                               "reward": 0.2}),
        await http.post(f"{other(s3)}/v1/feedback", json={"reward": 0.4},  # the token alone, no key
                        headers={"x-rlstream-feedback-token": c3.headers["x-rlstream-feedback-token"]}),
        await http.post(f"{other(s4)}/api/public/scores", headers=langfuse_auth(ACME), json={
            "id": "lf-4", "traceId": traces[4][1], "name": "quality", "value": 0.5, "dataType": "NUMERIC"}),
        await http.post(f"{other(s5)}/feedback", headers={"x-api-key": ACME}, json={
            "id": "ls-5", "run_id": tid[5], "key": "correctness", "score": 0.0}),
        # LangSmith's update names only the feedback id: it is found on the gateway that served the call too
        await http.patch(f"{on[s5]}/feedback/ls-5", headers={"x-api-key": ACME}, json={"score": 0.6}),
    ]
    otel = await http.post(f"{other(s2)}/v1/logs", headers=bearer(ACME), json=otlp(c2.json()["id"], "relevance", 0.3))
    rejected = otel.json().get("partialSuccess", {}).get("rejectedLogRecords", 0) if otel.status_code == 200 else 1
    statuses = [a.status_code for a in answers] + [404 if rejected else 200]
    want = {tid[0]: 0.1, tid[1]: 0.2, tid[2]: 0.3, tid[3]: 0.4, tid[4]: 0.5, tid[5]: 0.6}
    return statuses, want


async def test_feedback_by_id_on_any_gateway_and_after_a_restart(rl_config: RlstreamConfig, created_topics: Any,
                                                                 tmp_path: Path) -> None:
    async with fleet(rl_config, tmp_path, shared=True) as gateways, canned_replica() as replica, \
            httpx.AsyncClient(timeout=30) as http:
        urls = [await gateways.start(replica), await gateways.start(replica)]
        on = dict(enumerate(urls))
        traces = {n: traceparent(n) for n in range(8)}
        calls: list[tuple[int, httpx.Response]] = []
        async with RoundRobinProxy([("127.0.0.1", port_of(u)) for u in urls]).running() as proxy:
            for n in range(6):
                before = list(proxy.connections)
                answer = await chat(http, proxy.url, ACME, f"call {n}", traces[n][0])
                calls.append(([a - b for a, b in zip(proxy.connections, before)].index(1), answer))
            late = await chat(http, proxy.url, ACME, "scored after the restart", traces[6][0])
            late_span = await chat(http, proxy.url, ACME, "scored by span id after the restart", traces[7][0])
        assert {served for served, _ in calls} == {0, 1}
        statuses, want = await score_everything(http, on, calls, traces)
        assert statuses == [202, 202, 202, 200, 200, 200, 200], statuses

        await gateways.stop_all()  # both gateways gone: a new one on the same Redis
        fresh = await gateways.start(replica)
        r = await http.post(f"{fresh}/v1/feedback", headers=bearer(ACME), json={"response_id": late.json()["id"],
                                                                               "reward": 0.7})
        assert r.status_code == 202, r.text
        r = await http.post(f"{fresh}/v1/feedback", headers=bearer(ACME), json={"response_id": traces[7][2],
                                                                               "reward": 0.8})
        assert r.status_code == 202 and r.json()["trajectory_id"] == late_span.headers["x-rlstream-trajectory-id"]
        # another tenant names the same ids: answered as ids that do not exist
        r = await http.post(f"{fresh}/v1/feedback", headers=bearer(GLOBEX), json={"response_id": late.json()["id"],
                                                                                 "reward": 0.9})
        assert r.status_code == 404 and late.headers["x-rlstream-trajectory-id"] not in r.text
        want[late.headers["x-rlstream-trajectory-id"]] = 0.7
        want[late_span.headers["x-rlstream-trajectory-id"]] = 0.8
        await gateways.stop_all()

    rewards = await read_topic(rl_config, created_topics.rewards, RewardEvent, expect=9, timeout_s=30)
    per_trajectory = Counter(r.trajectory_id for r in rewards)
    langsmith = calls[5][1].headers["x-rlstream-trajectory-id"]
    assert per_trajectory == Counter({**{t: 1 for t in want}, langsmith: 2}), per_trajectory  # a correction
    last = {r.trajectory_id: r.reward for r in rewards}  # in order: the LangSmith update is the later one
    assert last == want
    assert all(r.example_id and r.group_id for r in rewards)


async def test_control_ids_in_one_gateways_memory_are_404_elsewhere(rl_config: RlstreamConfig, created_topics: Any,
                                                                    tmp_path: Path) -> None:
    async with fleet(rl_config, tmp_path, shared=False) as gateways, canned_replica() as replica, \
            httpx.AsyncClient(timeout=30) as http:
        urls = [await gateways.start(replica), await gateways.start(replica)]
        on = dict(enumerate(urls))
        traces = {n: traceparent(n) for n in range(6)}
        calls = [(0, await chat(http, urls[0], ACME, f"call {n}", traces[n][0])) for n in range(6)]
        statuses, _ = await score_everything(http, on, calls, traces)
        # by id: 404 on the other gateway (the token alone still works: it carries the trajectory's ids)
        assert statuses == [404, 404, 202, 404, 404, 404, 404], statuses
        here = await http.post(f"{urls[0]}/v1/feedback", headers=bearer(ACME),
                               json={"response_id": calls[1][1].json()["id"], "reward": 0.2})
        assert here.status_code == 202  # the gateway that served it knows it


async def test_ids_bounded_per_tenant(rl_config: RlstreamConfig, created_topics: Any, tmp_path: Path) -> None:
    capacity = 6  # ids per tenant: a chat call leaves two (its trajectory id and its response id)
    async with fleet(rl_config, tmp_path, shared=True, capacity=capacity) as gateways, \
            canned_replica() as replica, httpx.AsyncClient(timeout=30) as http:
        a = await gateways.start(replica)

        async def known_on_b(key: str, answer: httpx.Response) -> int:
            r = await http.post(f"{b}/v1/feedback", headers=bearer(key), json={
                "trajectory_id": answer.headers["x-rlstream-trajectory-id"], "reward": 0.5})
            return r.status_code

        victim = await chat(http, a, GLOBEX, "globex's call")
        acme_calls = [await chat(http, a, ACME, f"flood {n}") for n in range(10)]
        await gateways.stop_all()  # the writes are finished; a new gateway reads Redis only
        b = await gateways.start(replica)
        assert await known_on_b(GLOBEX, victim) == 202  # acme's flood left globex's ids alone
        assert await known_on_b(ACME, acme_calls[-1]) == 202
        assert await known_on_b(ACME, acme_calls[0]) == 404  # acme's own oldest went
        control = ControlPlane(str(rl_config.redis.url))
        try:
            assert await control.tenant_size(rl_config.policy, "ids", "acme") == capacity
            assert await control.tenant_size(rl_config.policy, "ids", "globex") == 2
            # control: the same flood by globex pushes globex's own entry out
            a = await gateways.start(replica)
            for n in range(10):
                await chat(http, a, GLOBEX, f"globex flood {n}")
            await gateways.stop_all()
            b = await gateways.start(replica)
            assert await known_on_b(GLOBEX, victim) == 404
            assert await control.tenant_size(rl_config.policy, "ids", "globex") == capacity
        finally:
            await control.close()


async def respond(http: httpx.AsyncClient, url: str, text: str, stream: bool = False,
                  **state: Any) -> dict[str, Any]:
    r = await http.post(f"{url}/v1/responses", headers=bearer(ACME),
                        json={"model": MODEL, "input": text, "stream": stream, **state})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()  # type: ignore[no-any-return]
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert all(e["response"].get("previous_response_id") == state.get("previous_response_id")
               for e in events if "response" in e)
    (done,) = [e["response"] for e in events if e["type"] == "response.completed"]
    return done  # type: ignore[no-any-return]


def user_texts(body: dict[str, Any]) -> list[str]:
    if isinstance(body["input"], str):
        return [body["input"]]
    return [item["content"] for item in body["input"] if item.get("role") == "user"]


async def test_stateful_responses_across_gateways_replicas_and_a_restart(
        rl_config: RlstreamConfig, created_topics: Any, tmp_path: Path) -> None:
    async with fleet(rl_config, tmp_path, shared=True) as gateways, canned_replica() as one, \
            canned_replica() as two, httpx.AsyncClient(timeout=30) as http:
        a, b = await gateways.start(one), await gateways.start(two)
        first = await respond(http, a, "first")
        second = await respond(http, b, "second", previous_response_id=first["id"])
        third = await respond(http, a, "third", stream=True, previous_response_id=second["id"])
        assert second["previous_response_id"] == first["id"] and third["previous_response_id"] == second["id"]
        await gateways.stop_all()
        c = await gateways.start(two)
        fourth = await respond(http, c, "fourth", previous_response_id=third["id"])
        assert fourth["output"][0]["content"][0]["text"] == "turn 4"
        r = await http.post(f"{c}/v1/responses", headers=bearer(GLOBEX),  # another tenant's id: unknown
                            json={"model": MODEL, "input": "x", "previous_response_id": third["id"]})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"

        # a conversation, created on one gateway and continued on the other
        created = await http.post(f"{c}/v1/conversations", headers=bearer(ACME),
                                  json={"items": [{"type": "message", "role": "user", "content": "hello"}]})
        assert created.status_code == 200 and created.json()["id"].startswith("conv_")
        conv = created.json()["id"]
        d = await gateways.start(one)
        in_conv = await respond(http, d, "in conversation", conversation=conv)
        assert in_conv["conversation"] == {"id": conv}
        again = await respond(http, c, "again", conversation={"id": conv})
        assert again["output"][0]["content"][0]["text"] == "turn 3"
        r = await http.post(f"{c}/v1/responses", headers=bearer(ACME),
                            json={"model": MODEL, "input": "x", "conversation": "conv_unknown"})
        assert r.status_code == 404
        await gateways.stop_all()

    sent = one.responses + two.responses
    assert all("previous_response_id" not in body and "conversation" not in body for body in sent)
    assert [user_texts(body) for body in one.responses] == [
        ["first"], ["first", "second", "third"], ["hello", "in conversation"]]
    assert [user_texts(body) for body in two.responses] == [
        ["first", "second"], ["first", "second", "third", "fourth"], ["hello", "in conversation", "again"]]
    assert [item["content"] for item in two.responses[1]["input"] if item.get("role") == "assistant"] == [
        "turn 1", "turn 2", "turn 3"]
    trajectories = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=6, timeout_s=30)
    replies = Counter(str(t.messages[-1].content) for t in trajectories)
    assert replies == Counter({"turn 1": 1, "turn 2": 2, "turn 3": 2, "turn 4": 1}), replies  # each turn once
    longest = max(trajectories, key=lambda t: len(t.messages))
    assert [m.role for m in longest.messages] == ["user", "assistant"] * 4
    assert longest.turns[0].prompt_token_ids is not None and len(longest.turns[0].prompt_token_ids) == 7


async def test_control_stateful_responses_without_shared_state_are_404_elsewhere(
        rl_config: RlstreamConfig, created_topics: Any, tmp_path: Path) -> None:
    async with fleet(rl_config, tmp_path, shared=False) as gateways, canned_replica() as one, \
            canned_replica() as two, httpx.AsyncClient(timeout=30) as http:
        a, b = await gateways.start(one), await gateways.start(two)
        first = await respond(http, a, "first")
        assert (await respond(http, a, "second", previous_response_id=first["id"]))["previous_response_id"]
        r = await http.post(f"{b}/v1/responses", headers=bearer(ACME),
                            json={"model": MODEL, "input": "second", "previous_response_id": first["id"]})
        assert r.status_code == 404, r.text
        # and the replica itself cannot resolve it either (vLLM keeps responses in one process)
        upstream = await http.post(f"{two.url}/v1/responses", json={"model": MODEL, "input": "second",
                                                                      "previous_response_id": first["id"]})
        assert upstream.status_code == 404


async def corrected_on_another_gateway(cfg: RlstreamConfig, tmp_path: Path, shared: bool) -> list[int]:
    """A single scored with a feedback id on the gateway that served it, then the same id again on the other
    gateway after the correction window (0.5 s): both answers' statuses."""
    import asyncio

    async with fleet(cfg, tmp_path, shared=shared, correction_window_s=0.5) as gateways, \
            canned_replica() as replica, httpx.AsyncClient(timeout=30) as http:
        urls = [await gateways.start(replica), await gateways.start(replica)]
        call = await chat(http, urls[0], ACME, "a single")
        token = {"x-rlstream-feedback-token": call.headers["x-rlstream-feedback-token"]}
        first = await http.post(f"{urls[0]}/v1/feedback", headers=token, json={"reward": 0.2, "feedback_id": "fb-1"})
        await asyncio.sleep(1.0)
        again = await http.post(f"{urls[1]}/v1/feedback", headers=token, json={"reward": 0.9, "feedback_id": "fb-1"})
        return [first.status_code, again.status_code]


async def test_a_late_correction_is_409_on_any_gateway(rl_config: RlstreamConfig, created_topics: Any,
                                                       tmp_path: Path) -> None:
    assert await corrected_on_another_gateway(rl_config, tmp_path, shared=True) == [202, 409]


async def test_control_feedback_ids_in_one_gateways_memory_take_a_late_correction_elsewhere(
        rl_config: RlstreamConfig, created_topics: Any, tmp_path: Path) -> None:
    # the correction would be answered 202 and then dead-lettered by the stream app (correction_after_emit)
    assert await corrected_on_another_gateway(rl_config, tmp_path, shared=False) == [202, 202]
