"""The chunked selective log-softmax of ``token_logprobs`` equals the plain full-vocabulary computation (values and
gradients), for any chunking, temperature and dtype, and never saves a full float32 log-softmax for backward."""
from __future__ import annotations

import pytest
import torch

from rlstream.learner.grpo import token_logprobs


def plain(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 64, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_plain_values_and_gradients(chunk: int, temperature: float) -> None:
    gen = torch.Generator().manual_seed(chunk)
    full = torch.randn(3, 6, 50, generator=gen) * 4
    tokens = torch.randint(0, 50, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)
    ours_in = full.clone().requires_grad_(True)
    ref_in = full.clone().requires_grad_(True)
    ours = token_logprobs(ours_in[:, :-1, :], tokens, temperature, chunk_size=chunk)  # a non-contiguous view
    ref = plain(ref_in[:, :-1, :], tokens, temperature)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-6)
    assert ours_in.grad[:, -1].abs().sum() == 0  # the position that was sliced off gets no gradient


def test_other_shapes_and_bfloat16() -> None:
    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(7, 11, generator=gen)
    tok = torch.randint(0, 11, (7,), generator=gen)
    torch.testing.assert_close(token_logprobs(flat, tok, chunk_size=2), plain(flat, tok))
    logits = (torch.randn(2, 4, 32, generator=gen) * 3).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 32, (2, 4), generator=gen)
    ours = token_logprobs(logits, tokens, chunk_size=3)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, plain(logits.detach(), tokens), rtol=1e-6, atol=1e-6)  # float32 math
    ours.sum().backward()
    ref_in = logits.detach().clone().requires_grad_(True)
    plain(ref_in, tokens).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad, ref_in.grad, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError):
        token_logprobs(flat, tok, chunk_size=0)


def test_no_full_float32_log_softmax_is_kept_for_backward() -> None:
    b, t, v = 2, 8, 64
    logits = torch.randn(b, t, v, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, v, (b, t))
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        token_logprobs(logits, tokens, chunk_size=4).sum().backward()
    full_fp32 = [s for s in saved if s.dtype == torch.float32 and s.numel() >= b * t * v]
    assert not full_fp32, [tuple(s.shape) for s in full_fp32]
    assert sum(s.numel() * s.element_size() for s in saved) < 2 * logits.numel() * logits.element_size()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):  # the plain computation does keep one
        plain(logits, tokens).sum().backward()
    assert any(s.dtype == torch.float32 and s.numel() == b * t * v for s in saved)


@pytest.mark.parametrize("chunk", [1, 4, 7, 10_000])
def test_one_temperature_per_row_equals_each_row_at_its_own(chunk: int) -> None:
    """Rows sampled at different temperatures: each row's values and gradients equal the plain computation at that
    row's temperature, whatever the chunking (blocks of rows and blocks within a row)."""
    gen = torch.Generator().manual_seed(chunk)
    full = torch.randn(3, 6, 50, generator=gen) * 4
    tokens = torch.randint(0, 50, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)
    temperatures = torch.tensor([0.7, 1.0, 1.6])
    ours_in = full.clone().requires_grad_(True)
    ref_in = full.clone().requires_grad_(True)
    ours = token_logprobs(ours_in[:, :-1, :], tokens, temperatures, chunk_size=chunk)
    ref = torch.stack([plain(ref_in[row:row + 1, :-1, :], tokens[row:row + 1], float(t))[0]
                       for row, t in enumerate(temperatures)])
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-6)
    # negative control: every row at 1.0 differs from the rows sampled at 0.7 and 1.6
    at_one = token_logprobs(full[:, :-1, :], tokens, 1.0, chunk_size=chunk)
    assert not torch.allclose(at_one[0], ref[0].detach()) and not torch.allclose(at_one[2], ref[2].detach())
    torch.testing.assert_close(at_one[1], ref[1].detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_temperature_that_is_not_positive_and_finite_is_refused(bad: float) -> None:
    logits, tokens = torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, bad)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="one temperature per row"):
        token_logprobs(logits, tokens, torch.tensor([1.0, 1.0, 1.0]))
