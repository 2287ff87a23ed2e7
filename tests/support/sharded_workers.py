"""Rank programs for the sharded learner tests (``torch.multiprocessing`` spawns them; gloo on CPU).

Each writes what it measured under ``out`` for the test to compare; rank 0 also runs the single-process learner step
on the same samples, so the sharded and the single-process figures come from the same inputs.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlstream.learner.checkpoint import LearnerState
from rlstream.learner.distributed import DataParallel
from rlstream.learner.policy import load_policy
from rlstream.learner.reset import fresh_trainer
from rlstream.learner.sharded import ShardedCheckpointStore, full_state
from rlstream.learner.step import GRPOTrainerStep, assign_advantages
from rlstream.schemas.config import LearnerConfig
from tests.support.learner_helpers import random_samples

WORLD = 2


def learner_config(model: Path, lora: bool) -> LearnerConfig:
    """3 micro-batches of 3 rows per step over 2 ranks (rank 1 runs one zero-weight pass); KL to the reference."""
    base = LearnerConfig(model=str(model))
    return base.model_copy(update={"lora": base.lora.model_copy(update={"enabled": lora}), "device": "cpu",
                                   "micro_batch_size": 3, "learning_rate": 5e-3, "beta": 0.04, "seed": 0,
                                   "num_iterations": 2, "warmup_steps": 0})


def samples(step: int) -> list[Any]:
    return random_samples(groups=2, per_group=4, seed=100 + step)


def _init(rank: int, port: int, world: int = WORLD) -> DataParallel:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return DataParallel(rank=rank, world_size=world, sharded=True)


def _trainable_full(model: Any) -> dict[str, torch.Tensor]:
    """The full trainable parameters (gathered; every rank calls it)."""
    state = full_state(model)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: t.clone() for n, t in state.items() if n in names}


def step_and_publish(rank: int, port: int, model: str, lora: bool, out: str) -> None:
    """One step's gradient, the weights after two steps, and the weights rank 0 would publish: sharded and, on rank
    0, single-process."""
    parallel = _init(rank, port)
    try:
        cfg = learner_config(Path(model), lora)
        policy = load_policy(cfg, parallel=parallel)
        trainer = GRPOTrainerStep(policy, cfg, parallel)
        batch = samples(0)
        assign_advantages(batch, cfg.scale_rewards, cfg.baseline_min_count, cfg.single_advantage_cap)
        trainer.accumulate(trainer.prepare(batch))
        grads = {n: p.grad.full_tensor().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        trainer.optimizer.zero_grad(set_to_none=True)
        for step in range(2):
            trainer.step(samples(step))
        weights = _trainable_full(policy.model)
        if rank != 0:
            parallel.broadcast_command()  # the driver's GATHER (what the service's follower loop receives)
        with policy.publishable() as whole:
            published = {k: v.detach().clone() for k, v in whole.model.state_dict().items()} if rank == 0 else {}
        if rank != 0:
            return
        single_policy = load_policy(cfg)
        single = GRPOTrainerStep(single_policy, cfg)
        batch = samples(0)
        assign_advantages(batch, cfg.scale_rewards, cfg.baseline_min_count, cfg.single_advantage_cap)
        single.accumulate(single.prepare(batch))
        single_grads = {n: p.grad.clone() for n, p in single_policy.model.named_parameters() if p.requires_grad}
        single.optimizer.zero_grad(set_to_none=True)
        for step in range(2):
            single.step(samples(step))
        single_weights = {n: p.detach().clone() for n, p in single_policy.model.named_parameters()
                          if p.requires_grad}
        single_published = {k: v.detach().clone() for k, v in single_policy.model.state_dict().items()}
        torch.save({"grads": grads, "single_grads": single_grads, "weights": weights,
                    "single_weights": single_weights, "published": published,
                    "single_published": single_published}, Path(out) / "result.pt")
    finally:
        dist.destroy_process_group()


def resume(rank: int, port: int, model: str, lora: bool, out: str, phase: str) -> None:
    """``run``: steps 0-1, a sharded checkpoint, steps 2-3 (the uninterrupted weights). ``resume``: new processes
    restore the checkpoint and run steps 2-3; then, the negative control, they restore it again but start a new
    optimizer (as a resume that lost the optimizer state would) and run steps 2-3 again."""
    parallel = _init(rank, port)
    try:
        cfg = learner_config(Path(model), lora)
        store = ShardedCheckpointStore(Path(out) / "checkpoints", parallel)
        runs = ["run"] if phase == "run" else ["resume", "weights_only"]
        for run in runs:
            policy = load_policy(cfg, parallel=parallel)
            trainer = GRPOTrainerStep(policy, cfg, parallel)
            if run == "run":
                for step in range(2):
                    trainer.step(samples(step))
                if rank != 0:
                    parallel.broadcast_command()  # the driver's CHECKPOINT
                store.save(LearnerState(step=2, offsets={0: 8}), policy.model, trainer.optimizer, trainer.scheduler)
            else:
                state = store.load_latest(policy.model, trainer.optimizer, trainer.scheduler)
                assert state is not None and state.step == 2 and state.offsets == {0: 8}, state
                if run == "weights_only":
                    trainer = fresh_trainer(policy, cfg, trainer, parallel)
            for step in range(2, 4):
                trainer.step(samples(step))
            weights = _trainable_full(policy.model)
            if rank == 0:
                torch.save(weights, Path(out) / f"{run}.pt")
    finally:
        dist.destroy_process_group()


def gathered_during_backward(rank: int, port: int, model: str, default_prefetch: bool, out: str) -> None:
    """Shard a model as the learner does and run one forward and backward, logging in order each decoder layer's
    all-gathers and the start and end of its backward (``("gather", i)``, ``("backward", i)``, ``("done", i)``).
    ``default_prefetch`` restores FSDP's implicit backward prefetch (the control)."""
    from torch.distributed.fsdp import FSDPModule

    from rlstream.learner.sharded import RingAllGather, decoder_layers, shard_model

    events: list[tuple[str, int]] = []

    class LoggedGather(RingAllGather):
        def __init__(self, index: int) -> None:
            self.index = index

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            events.append(("gather", self.index))
            return super().__call__(*args, **kwargs)

    parallel = _init(rank, port)
    try:
        policy = load_policy(learner_config(Path(model), lora=False))
        sharded = shard_model(policy.model, parallel, torch.device("cpu"))
        if default_prefetch:
            for module in sharded.modules():
                if isinstance(module, FSDPModule):
                    module.set_modules_to_backward_prefetch([])  # empty: FSDP's implicit prefetch of the next unit
        for index, layer in enumerate(decoder_layers(sharded)):
            layer.set_custom_all_gather(LoggedGather(index))
            layer.register_full_backward_pre_hook(lambda *_, i=index: events.append(("backward", i)))
            layer.register_full_backward_hook(lambda *_, i=index: events.append(("done", i)))
        ids = torch.randint(0, policy.model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(rank))
        sharded(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        if rank == 0:
            torch.save(events, Path(out) / f"gathered-{default_prefetch}.pt")
    finally:
        dist.destroy_process_group()


def ring_collectives(rank: int, port: int, world: int, chunk: int, out: str) -> None:
    """Run the CPU ring all-gather and reduce-scatter of the sharded learner on random per-rank inputs (odd sizes,
    messages of ``chunk`` elements) beside gloo's own ``all_gather`` and ``all_reduce`` of the same inputs; each rank
    saves both results."""
    from rlstream.learner import sharded

    _init(rank, port, world)
    try:
        sharded.RING_CHUNK = chunk
        group, shard = dist.group.WORLD, 1001
        mine = torch.randn(shard, generator=torch.Generator().manual_seed(rank))
        gathered = torch.empty(world * shard)
        sharded.RingAllGather()(gathered, mine, group)
        want_gathered = [torch.empty(shard) for _ in range(world)]
        dist.all_gather(want_gathered, mine)

        gradients = torch.randn(world * shard, generator=torch.Generator().manual_seed(100 + rank))
        want_summed = gradients.clone()
        dist.all_reduce(want_summed)
        reduced = torch.empty(shard)
        sharded.RingReduceScatter()(reduced, gradients, group, dist.ReduceOp.SUM)
        torch.save({"gathered": gathered, "want_gathered": torch.cat(want_gathered), "reduced": reduced,
                    "want_reduced": want_summed.view(world, -1)[rank].clone()}, Path(out) / f"ring-{rank}.pt")
    finally:
        dist.destroy_process_group()


def unit_names(rank: int, port: int, model: str, out: str) -> None:
    """Shard a model as the learner does on CPU; rank 0 saves the names of the FSDP units."""
    from torch.distributed.fsdp import FSDPModule

    from rlstream.learner.sharded import shard_model

    parallel = _init(rank, port)
    try:
        policy = load_policy(learner_config(Path(model), lora=False))
        sharded = shard_model(policy.model, parallel, torch.device("cpu"))
        units = sorted(name for name, module in sharded.named_modules() if isinstance(module, FSDPModule))
        if rank == 0:
            torch.save(units, Path(out) / "units.pt")
    finally:
        dist.destroy_process_group()
