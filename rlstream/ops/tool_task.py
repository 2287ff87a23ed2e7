"""The tool-agent task of ``rlstream up --task tool-agent``: a multi-turn agent that must call a tool to answer.

A table of made-up entities (generated names such as "Velmora") with three attributes (color, city, animal) that no
model has seen. The user asks "What is the <attribute> of <entity>?"; the agent (the OpenAI Agents SDK,
:func:`tool_agent`) has one function tool, ``lookup(entity, attribute)``, which reads the table. The model writes the
call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (:data:`CHAT_TEMPLATE`, vLLM's ``hermes``
parser turns it into a tool call), the SDK runs the tool and sends its result back, and the model answers.

:func:`verify` checks the episode: a parsed ``lookup`` call (0.2), with the example's entity and attribute (0.3), and a
final answer naming the value the tool returns for them and no other value of that attribute (0.5). Task success is
all three. Training and held-out prompts ask about disjoint entities, so what is learned is the tool use, not the
table. :func:`baseline_scores` measures what answering without the tool, and the best constant episode, earn.
:func:`gate_episode` is the same agent and verifier as the promotion gate's evaluation episode (``gate.episode``).
"""
from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rlstream.gate.episodes import EpisodeRequest, NoAnswer, arguments_parse, score_answer
from rlstream.gate.rules import SampleResult
from rlstream.rollout.sampling import SamplingSettings
from rlstream.streams.telemetry import TOOL_CALL_UNPARSED_COMPONENT, TOOL_CALLS_COMPONENT
from rlstream.transport.log import get_logger

log = get_logger(__name__)

TASK_NAME = "tool-agent"
TOOL_NAME = "lookup"
#: vLLM's tool-call parser for :data:`CHAT_TEMPLATE` (``<tool_call>{json}</tool_call>``, no special tokens needed)
TOOL_CALL_PARSER = "hermes"
ATTRIBUTE_VALUES: dict[str, tuple[str, ...]] = {
    "color": ("red", "blue", "green", "yellow", "purple", "orange", "black", "white"),
    "city": ("Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Sydney"),
    "animal": ("cat", "dog", "horse", "owl", "fox", "bear", "wolf", "eagle"),
}
TRAIN_ENTITIES = 48
HELDOUT_ENTITIES = 16
TABLE_SEED = 7
HELDOUT_SEED = 1_000
#: what the tool returns for an entity or attribute the table does not hold
UNKNOWN = "unknown"
#: the JSON schema of the ``entity`` and ``attribute`` arguments the model is offered: a word or two of letters, at
#: most 12 characters (names are at most 9). A server that forces a call with structured outputs
#: (``tool_choice="required"``) writes arguments within it; the tool itself takes any string
ARGUMENT_SCHEMA: dict[str, Any] = {"type": "string", "pattern": "^[A-Za-z][A-Za-z ]{0,11}$"}
#: weights of the verifier's three checks (they sum to 1)
PARSED_CREDIT, CALL_CREDIT, ANSWER_CREDIT = 0.2, 0.3, 0.5

#: training questions ``rlstream up --task tool-agent`` writes (each training (entity, attribute) about once)
TRAIN_EXAMPLES = 144
#: ``rlstream up --task tool-agent`` on top of the toy, SmolLM2 and production-traffic defaults: the agent and its
#: verifier; multi-turn episodes of 2-3 model calls of up to 48 tokens at temperature 0.7 (at 1.0 a 135M model
#: rambles: held-out parse rate 0.13 against 0.4); a LoRA adapter at a rate that moves it within a few steps; 8 single
#: episodes per step (each a trajectory of two or three turns of ~200 tokens: a step is minutes on 2 CPU cores)
TOOL_AGENT_DEFAULTS: dict[str, Any] = {
    "rollout": {"workflow": "rlstream.ops.tool_task:tool_agent", "reward_function": "rlstream.ops.tool_task:tool_reward",
                "max_tokens": 48, "temperature": 0.7, "group_size": 4, "concurrency": 4},
    "learner": {"lora": {"enabled": True}, "learning_rate": 1e-3, "groups_per_step": 8},
    "gate": {"episode": "rlstream.ops.tool_task:gate_episode"},
}

#: two worked exchanges before the question (entities outside the table): how a call, its result and the answer
#: look. They are the whole prompt besides the question (no system instructions: measured on SmolLM2-135M at
#: temperature 0.7, instructions on top lengthen the prompt from 166 to 226 tokens and do not raise the parse rate)
DEMONSTRATION: list[dict[str, Any]] = [
    item for n, (entity, attribute, value) in enumerate((("Mirabo", "color", "green"), ("Tukosa", "city", "Lima")))
    for item in (
        {"role": "user", "content": f"What is the {attribute} of {entity}?"},
        {"type": "function_call", "call_id": f"call_demo_{n}", "name": TOOL_NAME,
         "arguments": json.dumps({"entity": entity, "attribute": attribute})},
        {"type": "function_call_output", "call_id": f"call_demo_{n}", "output": value},
        {"role": "assistant", "content": f"The {attribute} of {entity} is {value}."})
]
#: ChatML that writes assistant tool calls back as ``<tool_call>{json}</tool_call>`` and tool results as the ``tool``
#: role; tools are described by the agent's instructions, not listed (a short prompt is a cheap one to train on)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part.get('text', '') }}{% endfor %}"
    "{% endif %}"
    "{%- if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}\n"
)
_SYLLABLES = ("vel", "mor", "ka", "tri", "zen", "lo", "qua", "rim", "dor", "sa", "phi", "bex", "nu", "tor", "gal",
              "wen", "ost", "ri", "yam", "cel", "dra", "fin", "ju", "pek")
_QUESTION_FORMS = ("What is the {attribute} of {entity}?", "Which {attribute} does {entity} have?",
                   "Tell me the {attribute} of {entity}.")


# --- the table --------------------------------------------------------------------------------------------
def entity_names(count: int, seed: int = TABLE_SEED) -> list[str]:
    """``count`` distinct made-up names of 2-3 syllables, capitalised."""
    rng = random.Random(seed)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def _entities() -> tuple[list[str], list[str]]:
    """(training entities, held-out entities): disjoint."""
    names = entity_names(TRAIN_ENTITIES + HELDOUT_ENTITIES)
    return names[:TRAIN_ENTITIES], names[TRAIN_ENTITIES:]


def fact_table(seed: int = TABLE_SEED) -> dict[tuple[str, str], str]:
    """(entity, attribute) -> value for every entity, training and held-out."""
    rng = random.Random(seed + 1)
    train, heldout = _entities()
    return {(entity, attribute): rng.choice(values)
            for entity in train + heldout for attribute, values in ATTRIBUTE_VALUES.items()}


_TABLE = fact_table()
_BY_LOWER = {(e.lower(), a): v for (e, a), v in _TABLE.items()}


def lookup_value(entity: str, attribute: str) -> str:
    """What the ``lookup`` tool returns: the table's value (names compared without case and outer spaces), else
    :data:`UNKNOWN`."""
    return _BY_LOWER.get((str(entity).strip().lower(), str(attribute).strip().lower()), UNKNOWN)


def tool_dataset(n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """``n`` questions about the ``split``'s entities ("train" or "heldout"), each (entity, attribute) once before
    any repeats: {"id", "prompt", "messages", "entity", "attribute", "value"}."""
    train, heldout = _entities()
    entities = train if split == "train" else heldout if split == "heldout" else None
    if entities is None:
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    rng = random.Random(seed)
    pairs = [(entity, attribute) for entity in entities for attribute in sorted(ATTRIBUTE_VALUES)]
    rng.shuffle(pairs)  # every (entity, attribute) once before any repeats
    examples = []
    for i in range(n):
        entity, attribute = pairs[i % len(pairs)]
        prompt = rng.choice(_QUESTION_FORMS).format(attribute=attribute, entity=entity)
        examples.append({"id": f"tool-{split}-{seed}-{i}", "prompt": prompt,
                         "messages": [{"role": "user", "content": prompt}],
                         "entity": entity, "attribute": attribute, "value": _TABLE[(entity, attribute)]})
    return examples


# --- an episode and its verifier ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call as the model wrote it (after vLLM's parser): the tool's name and its JSON arguments."""

    name: str
    arguments: str


@dataclass
class ToolEpisode:
    """What one run of the agent did: its tool calls, what the tools returned, its final answer."""

    calls: list[ToolCallRecord] = field(default_factory=list)
    tool_results: list[str] = field(default_factory=list)
    final_answer: str = ""
    error: str | None = None  # the agent run ended with this error (a tool that does not exist, too many turns)
    completion_tokens: int = 0  # over every model call of the episode


@dataclass(frozen=True)
class ToolVerdict:
    """The verifier's checks of one episode and the reward they make."""

    parsed: bool  # the first call is a parsed lookup call whose arguments are a JSON object with both fields
    right_call: bool  # some lookup call asked for the example's entity and attribute
    right_answer: bool  # the final answer names the value and no other value of the attribute
    answer_words: int

    @property
    def reward(self) -> float:
        return PARSED_CREDIT * self.parsed + CALL_CREDIT * self.right_call + ANSWER_CREDIT * self.right_answer

    @property
    def success(self) -> bool:
        return self.parsed and self.right_call and self.right_answer


def _call_arguments(call: ToolCallRecord) -> dict[str, Any] | None:
    try:
        args = json.loads(call.arguments)
    except (TypeError, ValueError):
        return None
    if not isinstance(args, dict) or not all(isinstance(args.get(k), str) for k in ("entity", "attribute")):
        return None
    return args


def _mentions(text: str, value: str) -> bool:
    return re.search(rf"(?<![A-Za-z]){re.escape(value)}(?![A-Za-z])", text, flags=re.IGNORECASE) is not None


def verify(example: dict[str, Any], episode: ToolEpisode) -> ToolVerdict:
    """Check ``episode`` against ``example`` (its entity, attribute and the value the tool returns for them)."""
    entity, attribute = str(example["entity"]), str(example["attribute"])
    value = lookup_value(entity, attribute)
    first = episode.calls[0] if episode.calls else None
    parsed = first is not None and first.name == TOOL_NAME and _call_arguments(first) is not None
    right_call = any(
        call.name == TOOL_NAME and (args := _call_arguments(call)) is not None
        and args["entity"].strip().lower() == entity.lower() and args["attribute"].strip().lower() == attribute.lower()
        for call in episode.calls)
    answer = episode.final_answer or ""
    others = [v for v in ATTRIBUTE_VALUES.get(attribute, ()) if v != value]
    right_answer = value != UNKNOWN and _mentions(answer, value) and not any(_mentions(answer, v) for v in others)
    return ToolVerdict(parsed=parsed, right_call=right_call, right_answer=right_answer,
                       answer_words=len(answer.split()))


#: the call markup of :data:`CHAT_TEMPLATE`: left in the model's text, it is a call the server's parser did not parse
TOOL_CALL_MARKUP = "<tool_call>"


def unparsed_call(episode: ToolEpisode) -> bool:
    """Whether the model wrote a tool call that did not parse: call markup left in its answer, or a call whose
    arguments are not a JSON object with ``entity`` and ``attribute``."""
    return TOOL_CALL_MARKUP in (episode.final_answer or "") or any(
        _call_arguments(call) is None for call in episode.calls)


def tool_reward(example: dict[str, Any], output: Any) -> dict[str, float]:
    """The reward function (``rollout.reward_function``): the verifier's reward as ``reward``, and as components the
    task success, whether the tool call parsed, and the tool calls made and whether one did not parse (what the
    stream app counts: ``TOOL_CALLS_COMPONENT``, ``TOOL_CALL_UNPARSED_COMPONENT`` of
    :mod:`rlstream.streams.telemetry`). Every component is a score within the task's reward range, so users may send
    them all as feedback components (the gateway refuses a component outside that range); the answer's length is a
    figure of the held-out evaluation (:func:`rlstream.ops.evaluation.evaluate_heldout`), not a score.

    ``output``: a :class:`ToolEpisode`, or a plain answer text (no tool called)."""
    episode = output if isinstance(output, ToolEpisode) else ToolEpisode(final_answer=str(output or ""))
    verdict = verify(example, episode)
    return {"reward": verdict.reward, "success": float(verdict.success), "tool_call_parsed": float(verdict.parsed),
            TOOL_CALLS_COMPONENT: float(len(episode.calls)), TOOL_CALL_UNPARSED_COMPONENT: float(unparsed_call(episode))}


# --- the agent ------------------------------------------------------------------------------------------------
async def tool_agent(example: dict[str, Any], client: Any, sampling: SamplingSettings,
                     headers: dict[str, str] | None = None, tool_choice: str = "auto",
                     seed: int | None = None) -> ToolEpisode:
    """Run the OpenAI Agents SDK agent with the ``lookup`` tool on ``example``'s question through ``client`` (an
    ``AsyncOpenAI`` on vLLM or the gateway; ``headers`` go with every model call, e.g. a gateway session), at most
    three model calls. A workflow (``rollout.workflow``) as well as what the simulated users run.

    ``tool_choice``: the first model call's (``auto``: the model decides; ``required``: the server forces one call,
    its arguments within :data:`ARGUMENT_SCHEMA`, for a model that cannot choose tools by itself); the SDK resets it
    to ``auto`` after a tool call, so the call after the tool's result can answer. ``seed``: every model call's
    sampling seed (the gate's evaluation pairs versions on it).

    The model's own failures (an unknown tool, no answer in three calls) are part of the episode (``error``); the
    server's are not: its errors (``openai.APIError``: connection, timeout, 5xx) propagate, and a response with
    nothing in it (no choice) or a model call that timed out raises :class:`NoAnswer`."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from agents.exceptions import AgentsException, ModelTimeoutError
    from agents.items import ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    episode = ToolEpisode()

    @function_tool(name_override=TOOL_NAME, strict_mode=False)
    def lookup(entity: str, attribute: str) -> str:
        """Look up the attribute (color, city or animal) of an entity."""
        return lookup_value(entity, attribute)

    for name in ("entity", "attribute"):
        lookup.params_json_schema["properties"][name].update(ARGUMENT_SCHEMA)

    agent = Agent(name="lookup-agent", tools=[lookup],
                  model=OpenAIChatCompletionsModel(model=sampling.model, openai_client=client),
                  model_settings=ModelSettings(temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                                               tool_choice=tool_choice, extra_headers=headers or None,
                                               extra_body={"seed": seed} if seed is not None else None,
                                               # a forced call is one call (vLLM: a one-item array)
                                               parallel_tool_calls=False if tool_choice != "auto" else None))
    question = str(example.get("prompt") or example["messages"][-1]["content"])
    items: list[Any] = []
    try:
        result = await Runner.run(agent, [*DEMONSTRATION, {"role": "user", "content": question}], max_turns=3)
        items = list(result.new_items)
        episode.final_answer = str(result.final_output or "")
        episode.completion_tokens = result.context_wrapper.usage.output_tokens
    except AgentsException as exc:  # the model's own failures (an unknown tool, no answer in 3 calls) score as such;
        # the server's (openai.APIError: connection, timeout, 5xx) propagate: they say nothing about the model
        if isinstance(exc, ModelTimeoutError) or _NO_CHOICES in str(exc):
            raise NoAnswer(f"the server gave no answer to judge: {type(exc).__name__}: {exc}") from exc
        episode.error = f"{type(exc).__name__}: {exc}"
        run_data = getattr(exc, "run_data", None)
        items = list(getattr(run_data, "new_items", None) or [])
        wrapper = getattr(run_data, "context_wrapper", None)
        episode.completion_tokens = wrapper.usage.output_tokens if wrapper is not None else 0
    for item in items:
        if isinstance(item, ToolCallItem):
            raw = item.raw_item
            episode.calls.append(ToolCallRecord(str(getattr(raw, "name", "")), str(getattr(raw, "arguments", ""))))
        elif isinstance(item, ToolCallOutputItem):
            episode.tool_results.append(str(item.output))
    return episode


#: how the Agents SDK words a chat completion without choices (a server's error payload), which it raises as a
#: ModelBehaviorError like the model's own failures
_NO_CHOICES = "response has no choices"


async def gate_episode(request: EpisodeRequest) -> SampleResult:
    """The promotion gate's episode of the tool task (``gate.episode``; rlstream/gate/episodes.py): :func:`tool_agent`
    against the evaluated version with the sample's seed, scored by the reward function (:func:`tool_reward`, the
    training reward), the tool calls' arguments checked, the answer length in completion tokens of all its calls."""
    sampling = SamplingSettings(model=request.model, temperature=request.temperature, max_tokens=request.max_tokens)
    episode = await tool_agent(request.example, request.client, sampling, seed=request.seed)
    length = episode.completion_tokens or len(episode.final_answer.split())
    return score_answer(request, episode, episode.final_answer, length, len(episode.calls),
                        sum(arguments_parse(call.arguments) for call in episode.calls), episode_messages(episode))


def episode_messages(episode: ToolEpisode) -> list[dict[str, Any]]:
    """The agent's side of an episode as chat messages: each tool call (with the tool's result, when it ran), then
    the final answer (or the error that ended the run)."""
    messages: list[dict[str, Any]] = []
    for i, call in enumerate(episode.calls):
        wire = {"id": f"call_{i}", "function": {"name": call.name, "arguments": call.arguments}}
        if messages and messages[-1]["role"] == "assistant":  # calls without results yet: one assistant turn
            messages[-1]["tool_calls"].append(wire)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [wire]})
        if i < len(episode.tool_results):
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": episode.tool_results[i]})
    final = episode.final_answer or (f"[{episode.error}]" if episode.error else "")
    if messages and messages[-1]["role"] == "assistant":  # a call without a result: the answer joins its turn
        messages[-1]["content"] = final or None
    else:
        messages.append({"role": "assistant", "content": final})
    return messages


# --- what no tool use earns -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BaselineScores:
    """What the held-out prompts give an agent that ignores the tool, and the best constant episode."""

    tool_free_reward: float  # no call; answers the most frequent value of the asked attribute
    constant_reward: float  # the same call and the same answer for every prompt, the best such pair
    constant_success: float
    constant: str

    def figures(self) -> dict[str, float]:
        """Named figures for the live view, the summary and the plot."""
        return {"best tool-free answer, reward": self.tool_free_reward,
                "best constant episode, reward": self.constant_reward,
                "best constant episode, task success": self.constant_success}


def baseline_scores(examples: list[dict[str, Any]]) -> BaselineScores:
    """Score the best tool-free answer and the best constant episode on ``examples`` with :func:`verify`."""
    by_attribute = Counter((e["attribute"], e["value"]) for e in examples)
    best_value = {a: max(ATTRIBUTE_VALUES[a], key=lambda v: by_attribute[(a, v)]) for a in ATTRIBUTE_VALUES}
    tool_free = [verify(e, ToolEpisode(final_answer=best_value[e["attribute"]])).reward for e in examples]
    best: tuple[float, float, str] = (-1.0, 0.0, "")
    pairs = sorted({(e["entity"], e["attribute"]) for e in examples})
    for entity, attribute in pairs:
        call = ToolCallRecord(TOOL_NAME, json.dumps({"entity": entity, "attribute": attribute}))
        for value in {v for values in ATTRIBUTE_VALUES.values() for v in values}:
            verdicts = [verify(e, ToolEpisode(calls=[call], final_answer=value)) for e in examples]
            reward = sum(v.reward for v in verdicts) / len(verdicts)
            if reward > best[0]:
                best = (reward, sum(v.success for v in verdicts) / len(verdicts), f"lookup({entity}, {attribute}) -> {value}")
    return BaselineScores(tool_free_reward=sum(tool_free) / max(1, len(tool_free)), constant_reward=max(0.0, best[0]),
                          constant_success=best[1], constant=best[2])
