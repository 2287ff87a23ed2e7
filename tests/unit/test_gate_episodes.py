"""The gate's evaluation runs the task's own episode (the tool agent's Agents SDK episode with its tool and verifier)
against a scripted OpenAI-compatible upstream, pairs samples by key and seed, and fails instead of scoring failed
requests."""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rlstream.gate.episodes import single_completion
from rlstream.gate.rules import DecisionRule, judge
from rlstream.gate.evaluation import (EvaluationFailed, EvaluationSet, EvaluationSetError, evaluate_version,
                                      load_episode, seed_of)
from rlstream.gate.service import evaluation_set
from rlstream.ops.tool_task import (ATTRIBUTE_VALUES, TOOL_AGENT_DEFAULTS, TOOL_NAME, gate_episode, tool_dataset,
                                   tool_reward)
from rlstream.schemas.config import load_config
from tests.support.scripted_upstream import Reply, closed_url, completion, scripted_upstream

pytestmark = pytest.mark.unit

HELDOUT = tool_dataset(6, "heldout")
QUESTION = re.compile(r"(?:the|Which) (\w+) (?:of|does) (\w+)")


def question_of(body: dict[str, Any]) -> tuple[str, str]:
    """(entity, attribute) of the last user question in a request."""
    text = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
    attribute, entity = QUESTION.search(text).groups()  # type: ignore[union-attr]
    return entity, attribute


def tool_caller(body: dict[str, Any]) -> Reply:
    """Calls ``lookup`` for the question, then answers with what the tool returned."""
    entity, attribute = question_of(body)
    last = body["messages"][-1]
    if last["role"] == "tool":
        return completion(body["model"], f"The {attribute} of {entity} is {last['content']}.")
    return completion(body["model"], None, [{"name": TOOL_NAME, "arguments": {"entity": entity,
                                                                                "attribute": attribute}}])


GUESSES = {a: Counter(e["value"] for e in HELDOUT if e["attribute"] == a).most_common(1)[0][0]
           if any(e["attribute"] == a for e in HELDOUT) else values[0] for a, values in ATTRIBUTE_VALUES.items()}


def guesser(body: dict[str, Any]) -> Reply:
    """Answers the held-out set's most frequent value of the asked attribute, without the tool."""
    _, attribute = question_of(body)
    return completion(body["model"], f"It is {GUESSES[attribute]}.")


def tool_evaluation(**kwargs: Any) -> EvaluationSet:
    return EvaluationSet(examples=HELDOUT, reward_function=tool_reward, samples=2, temperature=0.7, max_tokens=48,
                         episode=gate_episode, retries=2, retry_backoff_s=0.01, request_timeout_s=5.0, **kwargs)


async def test_a_policy_that_calls_the_tool_beats_one_that_guesses_through_the_agents_episode() -> None:
    async with scripted_upstream(tool_caller) as caller_log:
        caller = await evaluate_version(tool_evaluation(), 2, caller_log.url, "policy-v2")
    async with scripted_upstream(guesser) as guesser_log:
        guess = await evaluate_version(tool_evaluation(), 1, guesser_log.url, "policy-v1")
    assert caller.reward_mean == pytest.approx(1.0) and caller.samples == len(HELDOUT) * 2
    assert 0.0 < guess.reward_mean <= 0.5  # some guesses are right (0.5 each), none calls the tool
    assert caller.tool_calls == caller.samples and caller.tool_call_parse_rate == 1.0 and guess.tool_calls == 0
    # task success comes from the reward function's success component, so the gate tests it and reports it
    assert caller.task_success == 1.0 and guess.task_success == 0.0
    assert judge(caller, guess, DecisionRule()).test("task_success", "serving") is not None
    # one result per (example, sample), paired by key; every model call of a sample carries its seed
    assert sorted(r.key for r in caller.results) == sorted(r.key for r in guess.results) == sorted(
        f"{e['id']}#{s}" for e in HELDOUT for s in range(2))
    assert {r["seed"] for r in caller_log.requests} == {seed_of(e["id"], s) for e in HELDOUT for s in range(2)}
    assert len(caller_log.requests) == 2 * caller.samples  # the call, then the answer after the tool's result
    assert all(r["model"] == "policy-v2" for r in caller_log.requests)


async def test_control_the_single_completion_episode_scores_the_tool_caller_zero() -> None:
    single = replace(tool_evaluation(), episode=single_completion)
    async with scripted_upstream(tool_caller) as caller_log:
        caller = await evaluate_version(single, 2, caller_log.url, "policy-v2")
    async with scripted_upstream(guesser) as guesser_log:
        guess = await evaluate_version(single, 1, guesser_log.url, "policy-v1")
    assert caller.reward_mean == 0.0 < guess.reward_mean  # the failure the task's own episode fixes


async def test_a_failing_upstream_fails_the_evaluation_after_its_retries_and_a_healthy_one_scores() -> None:
    reasons: list[str] = []

    async def failed(reason: str) -> None:
        reasons.append(reason)

    evaluation = replace(tool_evaluation(), examples=HELDOUT[:1], samples=1)
    async with scripted_upstream(lambda body: 500) as broken:
        with pytest.raises(EvaluationFailed, match="status_500"):
            await evaluate_version(evaluation, 3, broken.url, "policy-v3", on_request_failure=failed)
    assert reasons == ["status_500"] * 3 and len(broken.requests) == 3  # the first try and two retries
    reasons.clear()
    with pytest.raises(EvaluationFailed, match="connection"):
        await evaluate_version(evaluation, 3, closed_url(), "policy-v3", on_request_failure=failed)
    assert reasons == ["connection"] * 3
    # control: the same evaluation against a healthy upstream gives figures
    async with scripted_upstream(tool_caller) as healthy:
        figures = await evaluate_version(evaluation, 3, healthy.url, "policy-v3")
    assert figures.samples == 1 and figures.reward_mean == pytest.approx(1.0)


async def test_a_response_without_an_answer_is_a_failure_not_a_result() -> None:
    evaluation = replace(tool_evaluation(), examples=HELDOUT[:1], samples=1, retries=0)
    for episode in (gate_episode, single_completion):
        async with scripted_upstream(lambda body: {**completion(body["model"], "x"), "choices": []}) as empty:
            with pytest.raises(EvaluationFailed, match="no_answer"):
                await evaluate_version(replace(evaluation, episode=episode), 4, empty.url, "policy-v4")
    # control: the model's own failure (a tool that does not exist) is a result, scored 0
    async with scripted_upstream(lambda body: completion(body["model"], None, [{"name": "search", "arguments": {}}])
                                 ) as wrong_tool:
        figures = await evaluate_version(evaluation, 4, wrong_tool.url, "policy-v4")
    assert figures.samples == 1 and figures.reward_mean == 0.0


async def test_a_flaky_upstream_is_retried_and_scored() -> None:
    calls = Counter[str]()

    def flaky(body: dict[str, Any]) -> Reply:
        calls["all"] += 1
        return 503 if calls["all"] == 1 else tool_caller(body)

    reasons: list[str] = []

    async def failed(reason: str) -> None:
        reasons.append(reason)

    async with scripted_upstream(flaky) as upstream:
        figures = await evaluate_version(replace(tool_evaluation(), concurrency=1), 5, upstream.url, "policy-v5",
                                         on_request_failure=failed)
    assert reasons == ["status_503"] and figures.samples == len(HELDOUT) * 2
    assert figures.reward_mean == pytest.approx(1.0)


async def test_a_client_error_is_not_retried() -> None:
    evaluation = replace(tool_evaluation(), examples=HELDOUT[:1], samples=1, episode=single_completion)
    async with scripted_upstream(lambda body: 404) as missing:
        with pytest.raises(EvaluationFailed, match="status_404"):
            await evaluate_version(evaluation, 6, missing.url, "policy-v6")
    assert len(missing.requests) == 1


def test_the_episode_comes_from_gate_episode_and_the_tool_task_sets_its_own(tmp_path: Path) -> None:
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in HELDOUT))
    base = [("gate.dataset", str(data)), ("gate.reward_function", "rlstream.ops.tool_task:tool_reward")]
    assert evaluation_set(load_config(None, base)).episode is single_completion
    tool = evaluation_set(load_config(None, [*base, ("gate.episode", TOOL_AGENT_DEFAULTS["gate"]["episode"]),
                                             ("gate.evaluation_retries", "5")]))
    assert tool.episode is gate_episode and tool.retries == 5
    with pytest.raises(EvaluationSetError, match="cannot load gate episode"):
        load_episode("rlstream.ops.tool_task:no_such_episode")
    with pytest.raises(EvaluationSetError, match="not an async function"):
        load_episode("rlstream.ops.tool_task:tool_reward")
