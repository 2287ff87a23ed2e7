"""Sampling temperature as an input: what a turn may be recorded at (pure functions, no Kafka).

vLLM samples greedily below ``_SAMPLING_EPS`` (1e-5, ``vllm/sampling_params.py``): a call asked for a temperature
below it was answered greedily, so it is recorded as greedy (0), and the learner computes a greedy turn's logprobs at
1.0 (there is no sampling distribution to match). A sampled temperature must lie in ``streams.temperature_range``: the
gradient of a turn's log-probability scales with 1/T, so one turn at T = 1e-3 sets the direction of a clipped step
(and at 1e-38 makes it non-finite), and a huge T is noise. The gateway refuses a request outside the range; the
stream app dead-letters a turn outside it (``temperature_out_of_range``).

A request that names no temperature is sampled at the server's default, which for vLLM is not always 1.0: it
applies the model's ``generation_config.json`` (``--generation-config auto``, its default), and
``--override-generation-config`` on top (``ModelConfig.get_diff_sampling_param``); :func:`server_default_temperature`
follows that rule, so a turn is recorded at the temperature it was sampled at.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

#: vLLM's greedy threshold: a temperature below it is greedy decoding.
GREEDY_BELOW = 1e-5

TEMPERATURE_OUT_OF_RANGE = "temperature_out_of_range"


@dataclass(frozen=True)
class TemperatureRange:
    """The closed interval ``[low, high]`` a sampled (non-greedy) temperature must lie in."""

    low: float
    high: float


#: what vLLM (and OpenAI) sample a request without ``temperature`` at when no generation config names one
NEUTRAL_TEMPERATURE = 1.0
#: ``--generation-config`` of vLLM that ignores the model's generation config (only the override applies)
VLLM_NEUTRAL_GENERATION_CONFIG = "vllm"

#: ``streams.temperature_range``'s default: what agents sample at in practice (OpenAI's API caps at 2).
DEFAULT_TEMPERATURE_RANGE = TemperatureRange(0.1, 2.0)


def is_greedy(temperature: float) -> bool:
    """True for a temperature vLLM decodes greedily (0 included)."""
    return 0.0 <= temperature < GREEDY_BELOW


def recorded_temperature(temperature: float) -> float:
    """The temperature to record for a call asked at ``temperature``: 0 where vLLM decodes greedily."""
    return 0.0 if is_greedy(temperature) else temperature


def temperature_problem(temperature: float | None, allowed: TemperatureRange = DEFAULT_TEMPERATURE_RANGE) -> str | None:
    """Why ``temperature`` may not be trained on (None: it may): not finite, negative, or sampled outside
    ``allowed``. ``None`` (not recorded) and greedy temperatures are fine."""
    if temperature is None:
        return None
    if not math.isfinite(temperature) or temperature < 0:
        return f"temperature {temperature} is not a finite number >= 0"
    if is_greedy(temperature):
        return None
    if not allowed.low <= temperature <= allowed.high:
        return (f"temperature {temperature:g} outside streams.temperature_range [{allowed.low:g}, {allowed.high:g}] "
                f"(below {GREEDY_BELOW:g} is greedy)")
    return None


def generation_config_values(folder: Path | str) -> dict[str, Any]:
    """The keys of ``folder``'s ``generation_config.json`` ({} when it has none or it is not a JSON object)."""
    try:
        values = json.loads((Path(folder) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def server_default_temperature(model_dir: Path | str, generation_config: str = "auto",
                               override: Mapping[str, Any] | None = None) -> float:
    """The temperature vLLM samples a request without ``temperature`` at, served from ``model_dir`` with
    ``--generation-config generation_config`` and ``--override-generation-config override``: the override's
    ``temperature``, else that of the generation config (``auto``: ``model_dir``'s; a folder: that folder's;
    ``vllm``: none), else 1.0."""
    values: dict[str, Any] = {}
    if generation_config != VLLM_NEUTRAL_GENERATION_CONFIG:
        values = generation_config_values(model_dir if generation_config == "auto" else generation_config)
    values.update(override or {})
    t = values.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0:
        return float(t)
    return NEUTRAL_TEMPERATURE
