"""A turn's temperature as an input: greedy below vLLM's threshold, sampled temperatures bounded by
streams.temperature_range (dead-lettered outside it), and what the learner computes logprobs at."""
from __future__ import annotations

import math

import pytest

from rlstream.learner.batch import BatchError, sampling_temperature
from rlstream.schemas.config import StreamsConfig
from rlstream.schemas.models import Turn
from rlstream.schemas.sampling import (GREEDY_BELOW, TEMPERATURE_OUT_OF_RANGE, TemperatureRange, is_greedy,
                                       recorded_temperature, temperature_problem)
from rlstream.streams.validation import validate_trajectory
from tests.support.factories import make_trajectory


@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1e-6])
def test_below_the_greedy_threshold_a_turn_is_greedy_and_trains_at_one(temperature: float) -> None:
    assert is_greedy(temperature) and recorded_temperature(temperature) == 0.0
    assert temperature_problem(temperature) is None
    assert sampling_temperature(Turn(temperature=temperature), "t") == 1.0


@pytest.mark.parametrize("temperature", [1e-3, 0.05, 2.5, 1e6])
def test_a_sampled_temperature_outside_the_range_is_refused(temperature: float) -> None:
    assert not is_greedy(temperature)
    problem = temperature_problem(temperature, TemperatureRange(0.1, 2.0))
    assert problem and "temperature_range" in problem
    trajectory = make_trajectory().model_copy(update={"turns": [Turn(temperature=temperature)]})
    invalid = validate_trajectory(trajectory, temperature_range=TemperatureRange(0.1, 2.0))
    assert invalid is not None and invalid.reason == TEMPERATURE_OUT_OF_RANGE
    # control: a wider configured range takes it (the range is the operator's)
    assert validate_trajectory(trajectory, temperature_range=TemperatureRange(1e-4, 1e7)) is None


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1.0])
def test_a_temperature_that_is_no_number_is_refused_everywhere(temperature: float) -> None:
    assert temperature_problem(temperature) is not None
    with pytest.raises(BatchError):
        sampling_temperature(Turn(temperature=temperature), "t")


def test_in_range_and_missing_temperatures_pass_and_the_range_is_checked() -> None:
    assert temperature_problem(None) is None and temperature_problem(0.7) is None
    assert sampling_temperature(Turn(temperature=0.7), "t") == 0.7 and sampling_temperature(Turn(), "t") == 1.0
    assert GREEDY_BELOW == 1e-5  # vLLM's _SAMPLING_EPS
    with pytest.raises(ValueError):
        StreamsConfig(temperature_range=(0.0, 2.0))
    with pytest.raises(ValueError):
        StreamsConfig(temperature_range=(1.0, math.nan))
