"""The sharded learner (FSDP2, ``learner.parallelism: fsdp``): two ranks over gloo on CPU, tiny model.

* One step's gradient and the weights after two steps equal the single-process learner's (within float tolerance:
  the ranks sum partial gradients in another order), for LoRA and full fine-tuning, with a KL reference and an
  uneven split of micro-batches (one rank runs a zero-weight pass); the full weights gathered for publishing equal the
  single-process model's.
* A resume from a sharded (DCP) checkpoint in new processes continues exactly: the weights after two more steps are
  those of the run that never stopped; the negative control restores the weights but not the optimizer state and
  ends elsewhere.
* On CPU the backward gathers each layer only when it reaches it (no prefetch); the control is FSDP's default.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlstream.ops.ports import free_port
from tests.support import sharded_workers
from tests.support.learner_helpers import tiny_model


def spawn(fn, *args) -> None:  # type: ignore[no-untyped-def]
    mp.spawn(fn, args=(free_port(), *args), nprocs=sharded_workers.WORLD, join=True)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, **tol: float) -> None:
    assert set(got) == set(want) and want, f"{what}: different parameters"
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{what} {name}: {m}", **tol)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_two_sharded_ranks_give_the_single_process_gradient_and_weights(tmp_path: Path, lora: bool) -> None:
    spawn(sharded_workers.step_and_publish, str(tiny_model(tmp_path)), lora, str(tmp_path))
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    moved = max(float((result["single_weights"][n] - result["single_published"][n]).abs().max())
                for n in result["single_weights"])
    assert moved == 0.0  # the published state is the trained model's own
    assert max(float(g.abs().max()) for g in result["single_grads"].values()) > 1e-4  # a real gradient
    assert_same(result["grads"], result["single_grads"], "gradient", rtol=1e-4, atol=1e-6)
    # atol: a full fine-tuning's k_proj bias has no true gradient (softmax ignores a shift of every key), so Adam
    # scales the rounding noise of the summation order up to steps of ~1e-6; a real difference is ~lr = 5e-3
    assert_same(result["weights"], result["single_weights"], "weights", rtol=1e-4, atol=2e-5)
    assert_same(result["published"], result["single_published"], "published", rtol=1e-4, atol=2e-5)


def test_a_sharded_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    model = str(tiny_model(tmp_path))
    spawn(sharded_workers.resume, model, True, str(tmp_path), "run")
    spawn(sharded_workers.resume, model, True, str(tmp_path), "resume")
    uninterrupted = torch.load(tmp_path / "run.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resume.pt", weights_only=True)
    assert_same(resumed, uninterrupted, "resumed", rtol=0.0, atol=1e-7)
    # negative control: without the optimizer state (Adam's moments, its step count) the run goes elsewhere
    lost = torch.load(tmp_path / "weights_only.pt", weights_only=True)
    gap = max(float((lost[n] - uninterrupted[n]).abs().max()) for n in uninterrupted)
    assert gap > 1e-4, gap


def _backward_gathers(events: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The events from the first backward on (the forward gathers every layer once, in order)."""
    first = next(n for n, (kind, _) in enumerate(events) if kind == "backward")
    return events[first:]


def test_on_cpu_no_layer_is_gathered_before_its_backward_is_reached(tmp_path: Path) -> None:
    """No backward prefetch on CPU (nothing could overlap it; it would add the next unit to the backward's peak):
    a layer is gathered for its backward only once the previous layer's backward has ended. Control: FSDP's
    default prefetch gathers it while the previous layer's backward is still running."""
    model = str(tiny_model(tmp_path))
    for default_prefetch in (False, True):
        spawn(sharded_workers.gathered_during_backward, model, default_prefetch, str(tmp_path))
    ours = _backward_gathers(torch.load(tmp_path / "gathered-False.pt", weights_only=True))
    control = _backward_gathers(torch.load(tmp_path / "gathered-True.pt", weights_only=True))
    layers = sorted({index for _, index in ours})
    assert len(layers) >= 2, ours
    for index in layers[:-1]:  # the layers reached after another one's backward
        assert ours.index(("gather", index)) > ours.index(("done", index + 1)), ours
        assert control.index(("gather", index)) < control.index(("done", index + 1)), control


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_cpu_ring_collectives_equal_gloos_all_gather_and_all_reduce(tmp_path: Path, world: int) -> None:
    """The ring all-gather and reduce-scatter FSDP runs on CPU give, on every rank, what gloo's ``all_gather`` and
    ``all_reduce`` give for the same inputs (three ranks: a real ring; 300-element messages: a shard in parts)."""
    mp.spawn(sharded_workers.ring_collectives, args=(free_port(), world, 300, str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        result = torch.load(tmp_path / f"ring-{rank}.pt", weights_only=True)
        assert torch.equal(result["gathered"], result["want_gathered"]), rank
        torch.testing.assert_close(result["reduced"], result["want_reduced"], rtol=1e-6, atol=1e-6)
        assert result["reduced"].abs().sum() > 0


def test_on_cpu_each_layers_attention_and_mlp_are_units_of_their_own(tmp_path: Path) -> None:
    """On CPU a decoder layer is three FSDP units (attention, MLP, and the layer with its norms), so a gather brings
    in at most one block: the backward's peak above the sharded state is one block's copy, gradient and buffer."""
    spawn(sharded_workers.unit_names, str(tiny_model(tmp_path)), str(tmp_path))
    units = torch.load(tmp_path / "units.pt", weights_only=True)
    layers = {name for name in units if name.count(".") == 2 and name.startswith("model.layers.")}
    assert layers, units
    for layer in layers:
        assert {f"{layer}.self_attn", f"{layer}.mlp"} <= set(units), units
