"""Model FLOPs utilisation (MFU) of a training step: the share of the accelerator's peak arithmetic a step uses.

A dense decoder's forward and backward pass costs about 6 floating-point operations per parameter per token
(2 forward, 4 backward; attention's sequence-length term left out, as in the usual MFU definition), so
``MFU = 6 * params * tokens / step_seconds / peak_flops``. ``tokens`` counts every token the step runs through the
model (prompt and completion alike); ``params`` counts every parameter, frozen ones too (a LoRA step still runs the
whole model forward and backward).
"""
from __future__ import annotations

#: NVIDIA H100 SXM, bf16 dense tensor-core peak (TFLOP/s, no sparsity)
H100_BF16_DENSE_TFLOPS = 989.0
FLOPS_PER_PARAM_TOKEN = 6


def training_flops(params: int, tokens: int) -> float:
    """Floating-point operations of one forward and backward pass over ``tokens`` tokens."""
    if params < 0 or tokens < 0:
        raise ValueError("params and tokens must be >= 0")
    return float(FLOPS_PER_PARAM_TOKEN) * params * tokens


def model_flops_utilization(params: int, tokens: int, step_s: float,
                            peak_tflops: float = H100_BF16_DENSE_TFLOPS) -> float:
    """The share (0-1) of ``peak_tflops`` that a step over ``tokens`` tokens in ``step_s`` seconds achieves."""
    if step_s <= 0 or peak_tflops <= 0:
        raise ValueError("step_s and peak_tflops must be > 0")
    return training_flops(params, tokens) / step_s / (peak_tflops * 1e12)
