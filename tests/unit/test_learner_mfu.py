"""MFU arithmetic (rlstream/learner/mfu.py) and the learner's dtype choice for CUDA, on hand-computed figures."""
from __future__ import annotations

import pytest
import torch

from rlstream.learner.mfu import H100_BF16_DENSE_TFLOPS, model_flops_utilization, training_flops
from rlstream.learner.policy import pick_dtype


def test_training_flops_are_six_per_parameter_and_token() -> None:
    assert training_flops(params=1_000, tokens=10) == 60_000.0
    assert training_flops(0, 10) == 0.0
    with pytest.raises(ValueError):
        training_flops(-1, 10)


def test_mfu_of_a_half_billion_model_on_an_h100() -> None:
    # 0.5e9 params, 8 x 1024 tokens in 0.25 s: 6 * 0.5e9 * 8192 / 0.25 = 9.8304e13 FLOP/s = 98.304 TFLOP/s
    assert H100_BF16_DENSE_TFLOPS == 989.0
    assert model_flops_utilization(500_000_000, 8192, 0.25) == pytest.approx(98.304 / 989.0)
    assert model_flops_utilization(500_000_000, 8192, 0.25, peak_tflops=98.304) == pytest.approx(1.0)
    # twice the time, half the utilisation
    assert model_flops_utilization(500_000_000, 8192, 0.5) == pytest.approx(98.304 / 989.0 / 2)
    for bad in ({"step_s": 0.0}, {"step_s": 1.0, "peak_tflops": 0.0}):
        with pytest.raises(ValueError):
            model_flops_utilization(1, 1, **bad)


def test_the_learner_trains_in_bf16_on_cuda_and_fp32_on_cpu() -> None:
    assert pick_dtype(torch.device("cuda")) is torch.bfloat16
    assert pick_dtype(torch.device("cpu")) is torch.float32
