"""Atomic learner checkpoints: weights or adapter, optimizer, scheduler, RNG, step and consumed offsets.

Layout: ``<dir>/step-<N>/`` holding ``weights.safetensors`` (trainable parameters), ``optimizer.pt``,
``scheduler.pt`` and ``rng.pt`` (read back with ``torch.load(weights_only=True)``: never unpickled), ``state.json``
and ``manifest.json`` (sha256 of every other file, written last). A checkpoint is written in a temporary
directory, fsynced, then renamed: a crash leaves either the whole checkpoint or none. On load a checkpoint
whose manifest is missing or whose files do not hash to it is skipped and the previous one is used.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlstream.transport.log import get_logger

log = get_logger(__name__)
MANIFEST = "manifest.json"
PREFIX = "step-"


@dataclass
class LearnerState:
    """What a checkpoint records besides tensors.

    Lineage is exact: ``pending_offsets`` lists, per partition of ``groups``, the offsets of the groups trained
    into the weights since the last publication (records that were skipped, dead-lettered, or whose step was not
    applied are consumed, in ``offsets``, but never listed).
    """

    step: int = 0
    version: int = 0  # last version number assigned to a publication (0 = the base model)
    offsets: dict[int, int] = field(default_factory=dict)  # partition -> next offset of `groups` to read
    pending_offsets: dict[int, list[int]] = field(default_factory=dict)  # partition -> offsets trained, unpublished
    pending_groups: int = 0
    publishing_offsets: dict[int, list[int]] = field(default_factory=dict)  # of the version being announced
    publishing_groups: int = 0
    groups_trained: int = 0
    # the last move back to the serving version's weights: the version reset to, and this learner's version then
    reset_to: int | None = None
    reset_at: int | None = None
    resets: int = 0  # moves back to the serving version's weights, over the run

    def record_trained(self, partition: int, offset: int) -> None:
        """A group at ``partition``/``offset`` was trained into the weights (pending publication)."""
        self.pending_offsets.setdefault(partition, []).append(offset)
        self.pending_groups += 1
        self.groups_trained += 1

    def start_publication(self) -> None:
        """Move the pending lineage to the version being published."""
        self.publishing_offsets = {p: sorted(o) for p, o in self.pending_offsets.items()}
        self.publishing_groups = self.pending_groups
        self.pending_offsets, self.pending_groups = {}, 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["offsets"] = {str(k): v for k, v in self.offsets.items()}
        d["pending_offsets"] = {str(k): v for k, v in self.pending_offsets.items()}
        d["publishing_offsets"] = {str(k): v for k, v in self.publishing_offsets.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LearnerState":
        def offsets_of(key: str, ranges_key: str) -> dict[int, list[int]]:
            if key in d:
                return {int(k): [int(o) for o in v] for k, v in d[key].items()}
            # checkpoints written before exact lineage: [first, last] ranges (what those versions announced)
            return {int(k): list(range(int(v[0]), int(v[1]) + 1)) for k, v in d.get(ranges_key, {}).items()}

        return cls(step=int(d["step"]), version=int(d["version"]),
                   offsets={int(k): int(v) for k, v in d["offsets"].items()},
                   pending_offsets=offsets_of("pending_offsets", "pending_ranges"),
                   pending_groups=int(d.get("pending_groups", 0)),
                   publishing_offsets=offsets_of("publishing_offsets", "publishing_ranges"),
                   publishing_groups=int(d.get("publishing_groups", 0)),
                   groups_trained=int(d.get("groups_trained", 0)),
                   reset_to=_int_or_none(d.get("reset_to")), reset_at=_int_or_none(d.get("reset_at")),
                   resets=int(d.get("resets", 0)))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or does not match its manifest."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hash every file of ``directory`` (recursively) into ``manifest.json``; fsync files and directory."""
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        fsync_path(path)
        files.append({"path": path.relative_to(directory).as_posix(), "sha256": sha256_file(path),
                      "size": path.stat().st_size})
    manifest = {**(extra or {}), "files": files}
    target = directory / MANIFEST
    target.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    fsync_path(target)
    fsync_path(directory)
    return manifest


def verify_manifest(directory: Path) -> dict[str, Any]:
    """Check every file against ``manifest.json``; raises :class:`CheckpointError` on any mismatch."""
    target = directory / MANIFEST
    try:
        manifest = json.loads(target.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory}: unreadable manifest: {exc}") from exc
    for entry in manifest.get("files", []):
        path = directory / entry["path"]
        if not path.is_file():
            raise CheckpointError(f"{directory}: missing file {entry['path']}")
        if path.stat().st_size != entry["size"] or sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"{directory}: {entry['path']} does not match its sha256")
    return manifest


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (the adapter for LoRA, everything for full fine-tuning)."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
                             "python_version": random.getstate()[0], "python_gauss": random.getstate()[2]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointStore:
    """Checkpoints of one learner under ``root``."""

    def __init__(self, root: Path | str, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:09d}"

    def list(self) -> list[Path]:
        """Checkpoint directories, newest first (temporary ones excluded)."""
        if not self.root.exists():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
        return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)

    def save(self, state: LearnerState, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any) -> Path:
        """Write a checkpoint atomically; returns its directory."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(state.step)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(trainable_state(model), str(tmp / "weights.safetensors"), metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(state.to_json(), sort_keys=True))
        write_manifest(tmp, {"step": state.step})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.root)
        self._prune()
        log.info("checkpoint written", step=state.step, path=str(final), offsets=state.offsets)
        return final

    def _prune(self) -> None:
        for old in self.list()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def load_latest(self, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any) -> LearnerState | None:
        """Restore the newest valid checkpoint into model/optimizer/scheduler/RNG; None when there is none."""
        for path in self.list():
            try:
                verify_manifest(path)
                state = LearnerState.from_json(json.loads((path / "state.json").read_text()))
                weights = load_file(str(path / "weights.safetensors"))
                opt_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
                sched_state = torch.load(path / "scheduler.pt", weights_only=True)
                rng = torch.load(path / "rng.pt", weights_only=True)
            except (CheckpointError, OSError, ValueError, KeyError, RuntimeError) as exc:
                log.warning("checkpoint invalid, trying the previous one", path=str(path), error=str(exc))
                continue
            params = dict(model.named_parameters())
            missing = [n for n in params if params[n].requires_grad and n not in weights]
            if missing:
                log.warning("checkpoint does not fit the model, trying the previous one", path=str(path),
                            missing=missing[:3])
                continue
            with torch.no_grad():
                for name, tensor in weights.items():
                    params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            optimizer.load_state_dict(opt_state)
            scheduler.load_state_dict(sched_state)
            set_rng_state(rng)
            log.info("resumed from checkpoint", step=state.step, path=str(path), offsets=state.offsets)
            return state
        return None
