"""A tiny NAT workflow and evaluator on rlstream's toy task ("repeat the letter"), registered with NAT.

* ``rlstream_toy_letters`` (workflow/function): asks ``llm`` (any NAT LLM, through NAT's LangChain wrapper) the
  question; with ``use_tool: true`` it first makes the model call the ``pick_letter`` tool (a forced tool call),
  runs the tool and asks again with the tool's result, so each run is a two-turn tool-calling exchange.
* ``rlstream_toy_reward`` (evaluator): the toy reward of the workflow's answer for the item's ``answer`` letter;
  an item whose answer is :data:`NAN_ANSWER` scores NaN (an evaluator failure, as NAT reports one).

Dataset rows (NAT's JSON dataset): ``{"id": ..., "question": "Repeat the letter c.", "answer": "c"}``.
"""
from __future__ import annotations

import json
import math
from typing import Any, AsyncIterator

from nat.builder.builder import Builder, EvalBuilder
from nat.builder.evaluator import EvaluatorInfo
from nat.builder.framework_enum import LLMFrameworkEnum
from nat.builder.function_info import FunctionInfo
from nat.cli.register_workflow import register_evaluator, register_function
from nat.data_models.component_ref import LLMRef
from nat.data_models.evaluator import EvalInput, EvaluatorBaseConfig
from nat.data_models.function import FunctionBaseConfig
from pydantic import Field

from rlstream.ops.toy import toy_dataset, toy_reward

NAN_ANSWER = "nan-reward"
PICK_LETTER_TOOL = {"type": "function", "function": {
    "name": "pick_letter", "description": "choose the letter to write",
    "parameters": {"type": "object", "properties": {"letter": {"type": "string", "enum": list("abcdefgh")}},
                   "required": ["letter"]}}}


class ToyLettersConfig(FunctionBaseConfig, name="rlstream_toy_letters"):  # type: ignore[call-arg]
    llm: LLMRef = Field(description="the NAT LLM that answers (the one being trained)")
    use_tool: bool = Field(False, description="make a forced pick_letter tool call before answering")
    max_tokens: int = Field(8, ge=1, description="tokens per answer")


class ToyRewardConfig(EvaluatorBaseConfig, name="rlstream_toy_reward"):  # type: ignore[call-arg]
    pass


def toy_nat_dataset(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` toy examples as NAT JSON dataset rows (id, question, answer)."""
    return [{"id": e["id"], "question": e["prompt"], "answer": e["target"]} for e in toy_dataset(n, seed)]


@register_function(config_type=ToyLettersConfig, framework_wrappers=[LLMFrameworkEnum.LANGCHAIN])
async def toy_letters(config: ToyLettersConfig, builder: Builder) -> AsyncIterator[FunctionInfo]:
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = await builder.get_llm(config.llm, wrapper_type=LLMFrameworkEnum.LANGCHAIN)
    answer_llm = llm.bind(max_tokens=config.max_tokens)

    async def _answer(question: str) -> str:
        messages: list[Any] = [HumanMessage(content=question)]
        if config.use_tool:
            picker = llm.bind_tools([PICK_LETTER_TOOL], tool_choice={"type": "function",
                                                                    "function": {"name": "pick_letter"}})
            call = await picker.ainvoke(messages, max_tokens=64)
            messages.append(call)
            for tool_call in call.tool_calls:
                letter = str((tool_call.get("args") or {}).get("letter", "?"))
                messages.append(ToolMessage(content=json.dumps({"picked": letter}), tool_call_id=tool_call["id"]))
            for bad in call.invalid_tool_calls:  # arguments that did not parse: the tool answers with the error
                messages.append(ToolMessage(content=json.dumps({"error": bad.get("error") or "invalid arguments"}),
                                            tool_call_id=bad.get("id") or "invalid", status="error"))
        reply = await answer_llm.ainvoke(messages)
        return str(reply.content)

    yield FunctionInfo.from_fn(_answer, description="answers a toy-task question (optionally after a tool call)")


@register_evaluator(config_type=ToyRewardConfig)
async def toy_reward_evaluator(config: ToyRewardConfig, builder: EvalBuilder) -> AsyncIterator[EvaluatorInfo]:
    from nat.plugins.eval.data_models.evaluator_io import EvalOutput, EvalOutputItem

    async def _evaluate(eval_input: EvalInput) -> EvalOutput:
        items = []
        for item in eval_input.eval_input_items:
            answer = str(item.expected_output_obj or "")
            text = item.output_obj if isinstance(item.output_obj, str) else ""
            score = math.nan if answer == NAN_ANSWER else toy_reward({"target": answer}, text)
            items.append(EvalOutputItem(id=item.id, score=score, reasoning={"answer": text[:200]}))
        finite = [i.score for i in items if math.isfinite(i.score)]
        return EvalOutput(average_score=sum(finite) / len(finite) if finite else 0.0, eval_output_items=items)

    yield EvaluatorInfo(config=config, evaluate_fn=_evaluate, description="rlstream toy-task reward")
