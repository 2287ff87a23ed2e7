"""Workflows get their sampling settings as an argument (``workflow(example, client, sampling)``), never as
attributes on the OpenAI client; a workflow of the old two-argument form is refused with a clear message."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from rlstream.rollout import SamplingSettings
from rlstream.rollout.loading import UserCodeError
from rlstream.rollout.workflows import check_workflow, single_turn
from rlstream.schemas.config import load_config


class FakeCompletions:
    """Records the keyword arguments of ``chat.completions.create``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def create(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="42"))])


def test_settings_come_from_the_rollout_section_and_are_frozen() -> None:
    cfg = load_config(None, [("rollout.model", "m"), ("rollout.temperature", "0.5"), ("rollout.max_tokens", "9")])
    sampling = SamplingSettings.from_config(cfg.rollout)
    assert sampling == SamplingSettings(model="m", temperature=0.5, max_tokens=9)
    assert sampling.with_model("m-v3") == SamplingSettings("m-v3", 0.5, 9) and sampling.model == "m"
    with pytest.raises(dataclasses.FrozenInstanceError):
        sampling.model = "other"  # type: ignore[misc]


def test_single_turn_samples_with_the_settings_it_is_given() -> None:
    completions = FakeCompletions()
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))  # no rlstream_* attributes
    out = asyncio.run(single_turn({"id": "a", "prompt": "6*7?"}, client, SamplingSettings("policy", 0.7, 5)))
    assert out == "42"
    assert completions.calls == [{"model": "policy", "messages": [{"role": "user", "content": "6*7?"}],
                                  "temperature": 0.7, "max_tokens": 5}]


def test_a_two_argument_workflow_is_refused_with_the_new_signature_named() -> None:
    async def old(example: dict[str, Any], client: Any) -> str:
        return ""

    async def new(example: dict[str, Any], client: Any, sampling: SamplingSettings) -> str:
        return ""

    async def flexible(*args: Any) -> str:
        return ""

    assert check_workflow(new) is new and check_workflow(flexible) is flexible and check_workflow(single_turn)
    with pytest.raises(UserCodeError, match=r"workflow\(example, client, sampling\)"):
        check_workflow(old)


def test_heldout_evaluation_passes_the_version_as_the_sampling_model() -> None:
    from rlstream.ops.evaluation import evaluate_heldout

    seen: list[SamplingSettings] = []

    async def workflow(example: dict[str, Any], client: Any, sampling: SamplingSettings) -> str:
        seen.append(sampling)
        return example["answer"]

    def reward(example: dict[str, Any], output: str) -> float:
        return 1.0 if output == "yes" else 0.0

    examples = [{"id": "1", "answer": "yes"}, {"id": "2", "answer": "no"}]
    mean, n = asyncio.run(evaluate_heldout("http://127.0.0.1:9/v1", examples, workflow, reward, 2,
                                           SamplingSettings("policy", 1.0, 8).with_model("policy-v3")))
    assert (mean, n) == (0.5, 4)
    assert set(seen) == {SamplingSettings("policy-v3", 1.0, 8)}
