"""Data-parallel training over ``torch.distributed`` (gloo on CPU, NCCL on GPUs), started with ``torchrun``.

Replicated data parallelism, as DDP does it: every rank holds the whole model and optimizer; rank 0 (the
driver) reads groups from Kafka, holds the lease, checkpoints and publishes; each step it broadcasts the step's
samples, every rank runs the forward/backward of its share of the micro-batches (micro-batch ``i`` belongs to
rank ``i % world_size``), and the gradients are summed with ``all_reduce`` before the optimizer step. The loss
of every micro-batch is normalised by the whole step's totals (tokens, sequences, trajectories), so the summed
gradient is the single-process gradient and the ranks stay identical after every step; a checkpoint written by
rank 0 therefore holds every rank's state, with the consumed offsets.

DDP's module wrapper is not used because gradient accumulation over an uneven number of micro-batches per rank
would need dummy backward passes; one explicit ``all_reduce`` per step does the same exchange.

Sharded (``learner.parallelism: fsdp``, :mod:`rlstream.learner.sharded`): the same driver and followers, the same
micro-batch split and loss normalisation, but the model is wrapped with FSDP2's ``fully_shard``: each rank holds
1/N of the parameters, gradients and optimizer state, and the gradients are summed by FSDP's reduce-scatter in each
backward pass instead of one ``all_reduce``. Every forward and backward is then a collective, so the ranks run the
same number of micro-batches (a rank short of one runs a zero-weight pass), and what the driver alone did on its
replica (the finite check, checkpoints, gathering the weights to publish) is announced to the followers first
(:meth:`DataParallel.lockstep`) and run by every rank.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

#: what rank 0 broadcasts: START (followers load the replica), STEP (with the step's samples), RESET (with the
#: verified serving weights to move back to), STOP
START = "start"
STEP = "step"
RESET = "reset"
STOP = "stop"
#: sharded only: the collectives the driver runs outside a step, which every rank joins (see ``lockstep``)
NONFINITE = "nonfinite"  # the finite check of the weights
CHECKPOINT = "checkpoint"  # a sharded checkpoint (with the state the driver records)
GATHER = "gather"  # the full weights gathered to the driver, to publish them


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the data-parallel group."""

    rank: int
    world_size: int
    device: torch.device = torch.device("cpu")  # where collective tensors live (CUDA for NCCL)
    sharded: bool = False  # learner.parallelism fsdp: the model is sharded over the ranks

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def owns(self, micro_batch_index: int) -> bool:
        return micro_batch_index % self.world_size == self.rank

    def rounds(self, micro_batches: int) -> int:
        """How many micro-batches each rank runs when all run the same number (sharded: ``ceil(n / world)``)."""
        return -(-micro_batches // self.world_size)

    def lockstep(self, command: str, payload: Any = None) -> None:
        """Before a collective outside a step: the driver tells the followers which one (``command``, with
        ``payload``) so that they join it; on a follower (which runs it because it received ``command``) nothing."""
        if self.is_driver:
            self.broadcast_command(command, payload)

    # -- collectives --
    def broadcast_command(self, command: str | None = None, payload: Any = None) -> tuple[str, Any]:
        """Rank 0 sends ``(command, payload)``; every rank returns what rank 0 sent."""
        box = [(command, payload)] if self.is_driver else [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``parameters`` over the ranks (a missing gradient counts as zero)."""
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def sum(self, values: Sequence[float]) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def extreme(self, value: float, op: str) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        return float(tensor.item())

    def same_everywhere(self, value: int) -> bool:
        """True when every rank passes the same ``value`` (e.g. the step a checkpoint resumed)."""
        return self.extreme(float(value), "min") == self.extreme(float(value), "max")

    def copy_from_driver(self, parameters: Iterable[torch.Tensor]) -> None:
        """Rank 0's values into every rank (the start of training: identical replicas whatever the init)."""
        with torch.no_grad():
            for p in parameters:
                dist.broadcast(p.data, src=0)


#: glibc's ``mallopt`` parameter for the size from which an allocation gets its own ``mmap``
M_MMAP_THRESHOLD = -3
#: 128 KiB, glibc's initial threshold, kept fixed (see :func:`return_freed_host_buffers`)
HOST_MMAP_THRESHOLD = 128 * 1024


def return_freed_host_buffers(threshold: int = HOST_MMAP_THRESHOLD) -> bool:
    """Make glibc malloc serve every host allocation of ``threshold`` bytes or more with its own ``mmap``, so that
    freeing one gives its pages back to the system at once; True when set (False off glibc).

    Why: by default glibc raises that threshold to the size of each large block freed (up to 32 MiB), after which
    blocks of that size come from the heap, and a heap freed in the middle keeps its pages. A training step on CPU
    allocates and frees tensors of a layer's size all the time (activations, gradients; sharded, each layer's
    gathered parameters, unsharded gradients and reduce-scatter buffers), so with the moving threshold the resident
    set grows well past what is alive at any moment: 1.2x the replicated learner's peak for a sharded one, whose
    live state is half. Applied by every data-parallel learner process on CPU, replicated or sharded alike."""
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        libc = ctypes.CDLL(path)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def from_environment(device: torch.device | None = None, sharded: bool = False) -> DataParallel | None:
    """The data-parallel group of a ``torchrun`` launch (``WORLD_SIZE`` > 1), initialised once; None otherwise.
    ``sharded``: the ranks shard the model (``learner.parallelism: fsdp``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if device is None or device.type != "cuda":
        return_freed_host_buffers()
    if not dist.is_initialized():
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size(),
                        device=device if device is not None and device.type == "cuda" else torch.device("cpu"),
                        sharded=sharded)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
