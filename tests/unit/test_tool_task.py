"""The tool-agent task's table, datasets and verifier (rlstream/ops/tool_task.py), on hand-computed cases."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.ops.tool_task import (ATTRIBUTE_VALUES, UNKNOWN, ToolCallRecord, ToolEpisode, baseline_scores,
                                   lookup_value, tool_dataset, tool_reward, verify)

EXAMPLE = tool_dataset(1, "train")[0]
VALUE = EXAMPLE["value"]
OTHER_VALUE = next(v for v in ATTRIBUTE_VALUES[EXAMPLE["attribute"]] if v != VALUE)


def call(entity: str = EXAMPLE["entity"], attribute: str = EXAMPLE["attribute"], name: str = "lookup") -> ToolCallRecord:
    return ToolCallRecord(name, json.dumps({"entity": entity, "attribute": attribute}))


def test_the_right_tool_call_and_the_tools_value_in_the_answer_earn_everything() -> None:
    episode = ToolEpisode(calls=[call()], tool_results=[VALUE], final_answer=f"The answer is {VALUE}.")
    verdict = verify(EXAMPLE, episode)
    assert (verdict.parsed, verdict.right_call, verdict.right_answer) == (True, True, True)
    assert verdict.reward == pytest.approx(1.0) and verdict.success and verdict.answer_words == 4
    assert tool_reward(EXAMPLE, episode) == {"reward": pytest.approx(1.0), "success": 1.0, "tool_call_parsed": 1.0,
                                             "tool_calls": 1.0, "tool_call_unparsed": 0.0}


def test_names_are_matched_without_case_or_outer_spaces() -> None:
    episode = ToolEpisode(calls=[call(f" {EXAMPLE['entity'].upper()} ", EXAMPLE["attribute"].title())],
                          final_answer=VALUE.upper())
    assert verify(EXAMPLE, episode).success
    assert lookup_value(f"  {EXAMPLE['entity'].lower()}", EXAMPLE["attribute"]) == VALUE


def test_a_wrong_argument_earns_the_format_only() -> None:
    # another training entity whose value of the attribute differs: the tool returns that, the agent answers it
    wrong = next(e for e in tool_dataset(200, "train")
                 if e["attribute"] == EXAMPLE["attribute"] and e["value"] != VALUE)
    episode = ToolEpisode(calls=[call(wrong["entity"])], tool_results=[wrong["value"]],
                          final_answer=wrong["value"])
    verdict = verify(EXAMPLE, episode)
    assert (verdict.parsed, verdict.right_call, verdict.right_answer) == (True, False, False)
    assert verdict.reward == pytest.approx(0.2) and not verdict.success
    wrong_attribute = verify(EXAMPLE, ToolEpisode(calls=[call(attribute="height")], tool_results=[UNKNOWN],
                                                  final_answer=UNKNOWN))
    assert wrong_attribute.reward == pytest.approx(0.2)


def test_an_answer_without_calling_the_tool_earns_the_answer_only_and_never_succeeds() -> None:
    guessed = verify(EXAMPLE, ToolEpisode(final_answer=f"It is {VALUE}."))
    assert (guessed.parsed, guessed.right_call, guessed.right_answer) == (False, False, True)
    assert guessed.reward == pytest.approx(0.5) and not guessed.success
    assert verify(EXAMPLE, ToolEpisode(final_answer="I do not know.")).reward == 0.0
    assert tool_reward(EXAMPLE, f"It is {VALUE}.")["reward"] == pytest.approx(0.5)  # a plain text output too


def test_a_malformed_call_is_not_parsed() -> None:
    # vLLM's parser could not read the JSON: no tool call, the raw text came back as the answer
    raw = '<tool_call>{"name": "lookup", "arguments": {"entity": "' + EXAMPLE["entity"] + '"</tool_call>'
    assert verify(EXAMPLE, ToolEpisode(final_answer=raw)).reward == 0.0
    # parsed by vLLM but not a usable lookup call: arguments not an object, a field missing, another tool
    for bad in (ToolCallRecord("lookup", "not json"), ToolCallRecord("lookup", json.dumps(["a", "b"])),
                ToolCallRecord("lookup", json.dumps({"entity": EXAMPLE["entity"]})),
                call(name="search")):
        verdict = verify(EXAMPLE, ToolEpisode(calls=[bad], final_answer="no"))
        assert (verdict.parsed, verdict.right_call, verdict.reward) == (False, False, 0.0), bad


def test_an_answer_naming_several_values_earns_no_answer_credit() -> None:
    hedged = ToolEpisode(calls=[call()], tool_results=[VALUE], final_answer=f"{VALUE} or {OTHER_VALUE}")
    verdict = verify(EXAMPLE, hedged)
    assert verdict.right_call and not verdict.right_answer and verdict.reward == pytest.approx(0.5)


def test_heldout_entities_never_occur_in_training() -> None:
    train = {e["entity"] for e in tool_dataset(500, "train")}
    heldout = tool_dataset(24, "heldout", seed=1000)
    assert not train & {e["entity"] for e in heldout}
    assert len({(e["entity"], e["attribute"]) for e in heldout}) == 24  # no question asked twice
    assert all(lookup_value(e["entity"], e["attribute"]) == e["value"] for e in heldout)
    with pytest.raises(ValueError):
        tool_dataset(1, "test")


def test_no_tool_use_earns_little_on_the_heldout_prompts() -> None:
    scores = baseline_scores(tool_dataset(24, "heldout", seed=1000))
    assert scores.tool_free_reward <= 0.25 and scores.constant_success <= 0.05
    assert scores.constant_reward <= 0.35  # the format credit (0.2) and a lucky value


def test_the_chat_template_writes_tool_calls_back_in_the_format_the_parser_reads() -> None:
    import jinja2

    from rlstream.ops.tool_task import CHAT_TEMPLATE

    arguments = json.dumps({"entity": "Mirabo", "attribute": "color"})
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "Color of Mirabo?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "green"}]
    rendered = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nUse the tool.<|im_end|>\n<|im_start|>user\nColor of Mirabo?<|im_end|>\n"
                        '<|im_start|>assistant\n<tool_call>{"name": "lookup", "arguments": ' + arguments
                        + "}</tool_call><|im_end|>\n<|im_start|>tool\ngreen<|im_end|>\n<|im_start|>assistant\n")
    # arguments vLLM has already parsed into an object are written as JSON too
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"entity": "Mirabo", "attribute": "color"}
    again = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    call_json = again.split("<tool_call>")[1].split("</tool_call>")[0]
    assert json.loads(call_json) == {"name": "lookup", "arguments": {"entity": "Mirabo", "attribute": "color"}}


def test_up_with_the_tool_task_runs_the_agent_and_its_verifier_on_a_lora_adapter(tmp_path: Path) -> None:
    from rlstream.ops.infra import LocalStack, ServiceProcess
    from rlstream.ops.up_config import UpOptions, compose_config, task_users_args, task_vllm_args

    stack = LocalStack(kafka=ServiceProcess("kafka", "127.0.0.1:1", external=True),
                       redis=ServiceProcess("redis", "redis://127.0.0.1:2/0", external=True), root="/tmp")
    opts = UpOptions(model="smollm2", task="tool-agent", traffic="production")
    cfg, _ = compose_config(opts, "run-t", tmp_path, stack, tmp_path / "smollm2", "http://127.0.0.1:9", None)
    assert cfg.rollout.workflow == "rlstream.ops.tool_task:tool_agent"
    assert cfg.rollout.reward_function == "rlstream.ops.tool_task:tool_reward"
    assert cfg.learner.lora.enabled and cfg.learner.groups_per_step == 8
    assert cfg.gate.episode == "rlstream.ops.tool_task:gate_episode"  # the gate evaluates the agent's own episode
    args = task_vllm_args(opts, tmp_path)
    assert args[0] == "--chat-template" and Path(args[1]).read_text().startswith("{%- for message")
    assert args[2:] == ["--tool-call-parser", "hermes"]
    assert task_users_args(opts) == ["--agent", "rlstream.ops.tool_task:tool_agent"]
    toy = UpOptions(model="smollm2")  # the toy task stays the default and needs neither
    assert task_vllm_args(toy, tmp_path) == [] and task_users_args(toy) == []
    toy_cfg, _ = compose_config(toy, "run-u", tmp_path, stack, tmp_path / "smollm2", "http://127.0.0.1:9", None)
    assert toy_cfg.rollout.reward_function == "rlstream.ops.toy:toy_strict_reward"
    assert toy_cfg.gate.episode is None  # one chat completion


async def test_an_unreachable_server_is_an_error_not_a_failed_episode() -> None:
    """A connection failure says nothing about the model: the agent raises it (the held-out evaluation retries the
    version, a simulated user counts an error) instead of scoring an empty episode 0."""
    import openai

    from rlstream.ops.tool_task import tool_agent
    from rlstream.rollout.sampling import SamplingSettings

    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="none", max_retries=0, timeout=5.0)
    with pytest.raises(openai.APIConnectionError):
        await tool_agent(EXAMPLE, client, SamplingSettings(model="toy", temperature=0.7, max_tokens=8))
    await client.close()


def test_every_name_of_the_table_fits_the_arguments_schema_a_forced_call_is_written_in() -> None:
    import re

    from rlstream.ops.tool_task import ARGUMENT_SCHEMA, fact_table

    pattern = re.compile(ARGUMENT_SCHEMA["pattern"])
    names = {name for pair in fact_table() for name in pair}
    assert names and all(pattern.fullmatch(name) for name in names)
    assert not pattern.fullmatch("Velmora, the city") and not pattern.fullmatch("x" * 13)


def test_a_long_answers_scores_are_feedback_the_gateway_accepts() -> None:
    # simulated users send the reward function's components as feedback components, which the gateway refuses
    # outside the task's reward range; the answer's length in words is no score (control: sent as one, refused)
    from pydantic import ValidationError

    from rlstream.gateway.feedback import RANGE_CONTEXT, Feedback
    from rlstream.schemas.config import StreamsConfig

    long_answer = ToolEpisode(calls=[call()], tool_results=[VALUE], final_answer=" ".join(["word"] * 40) + f" {VALUE}")
    scores = tool_reward(EXAMPLE, long_answer)
    context = {RANGE_CONTEXT: tuple(StreamsConfig().reward_range)}
    body = {"reward": scores["reward"], "components": {k: v for k, v in scores.items() if k != "reward"}}
    assert Feedback.model_validate(body, context=context).components == body["components"]
    with pytest.raises(ValidationError, match="outside the task's reward range"):
        Feedback.model_validate({**body, "components": {**body["components"], "answer_words": 41.0}}, context=context)


def test_the_heldout_evaluation_reports_the_answer_length_of_an_episode() -> None:
    import asyncio

    from rlstream.ops.evaluation import ANSWER_WORDS, evaluate_heldout
    from rlstream.rollout.sampling import SamplingSettings

    async def workflow(example, client, sampling) -> ToolEpisode:
        return ToolEpisode(calls=[call()], tool_results=[VALUE], final_answer=f"It is {VALUE} today")

    figures: dict[str, float] = {}
    asyncio.run(evaluate_heldout("http://127.0.0.1:9/v1", [EXAMPLE], workflow, tool_reward, 2,
                                 SamplingSettings("policy", 1.0, 8), components=figures))
    assert figures[ANSWER_WORDS] == 3 + len(VALUE.split())
    assert figures["success"] == 1.0
