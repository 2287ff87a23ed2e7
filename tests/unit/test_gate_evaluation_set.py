"""The gate's evaluation set: a dataset and a reward function from the config, refused with a clear error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.gate.evaluation import (EvaluationSetError, load_evaluation_examples, reward_of, seed_of,
                                      tool_calls_parsed)
from rlstream.gate.service import evaluation_set
from rlstream.schemas.config import load_config

pytestmark = pytest.mark.unit


def test_the_evaluation_set_comes_from_gate_or_the_validation_and_rollout_settings(tmp_path: Path) -> None:
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"answer with the letter {c}", "target": c}) + "\n" for c in "abc"))
    cfg = load_config(None, [("finetuning.validation_dataset", str(data)),
                             ("rollout.reward_function", "rlstream.ops.toy:toy_strict_reward"), ("gate.examples", "2")])
    evaluation = evaluation_set(cfg)
    assert [e["id"] for e in evaluation.examples] == ["0", "1"] and evaluation.reward_function({"target": "a"}, "a a") == 1.0
    with pytest.raises(EvaluationSetError, match="gate.dataset"):
        evaluation_set(load_config(None, [("rollout.reward_function", "rlstream.ops.toy:toy_strict_reward")]))
    with pytest.raises(EvaluationSetError, match="gate.reward_function"):
        evaluation_set(load_config(None, [("gate.dataset", str(data))]))
    with pytest.raises(EvaluationSetError, match="cannot load reward function"):
        evaluation_set(load_config(None, [("gate.dataset", str(data)), ("gate.reward_function", "nowhere:f")]))


@pytest.mark.parametrize("text, error", [
    ("{not json\n", "not JSON"), ('[{"id": 1}]', "prompt or messages"), ("", "no example")])
def test_a_bad_evaluation_set_is_refused(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text(text)
    with pytest.raises(EvaluationSetError, match=error):
        load_evaluation_examples(path)


def test_rewards_tool_calls_and_seeds() -> None:
    assert reward_of(0.5) == reward_of((0.5, {"x": 1.0})) == reward_of({"reward": 0.5}) == 0.5
    with pytest.raises(ValueError):
        reward_of(float("nan"))

    class Function:
        def __init__(self, arguments: str) -> None:
            self.arguments = arguments

    class Call:
        def __init__(self, arguments: str) -> None:
            self.function = Function(arguments)

    assert tool_calls_parsed([Call('{"q": 1}'), Call("{broken"), Call("[1]")]) == 1
    assert seed_of("ex-1", 0) == seed_of("ex-1", 0) != seed_of("ex-1", 1)
