"""The learner's AdamW: fused where the parameters' device supports it, the same update as the multi-tensor one."""
from __future__ import annotations

import torch

from rlstream.learner.step import adamw


def _params(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_cpu_parameters_get_the_fused_implementation() -> None:
    optimizer = adamw(_params(0), lr=1e-3, weight_decay=0.01)
    assert optimizer.defaults["fused"] is True


def test_fused_and_multi_tensor_updates_agree() -> None:
    fused_params, plain_params = _params(1), _params(1)
    fused = adamw(fused_params, lr=1e-2, weight_decay=0.01)
    plain = torch.optim.AdamW(plain_params, lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        fused.step()
        plain.step()
    for a, b in zip(fused_params, plain_params):
        torch.testing.assert_close(a, b)
    assert not torch.equal(fused_params[0], _params(1)[0])  # the parameters moved
