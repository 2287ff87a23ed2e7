"""When a LoRA version's staged files may be deleted.

vLLM keeps the path an adapter was loaded from and reads the files again whenever the adapter has to come back into
its cache: for a request that was already queued when the adapter was unloaded too. Files deleted under such a request
make vLLM's engine fail (``LoRAAdapterNotFoundError``) and, with it, every request it holds. So a sync worker unloads
first, keeps the files, and deletes them only when both hold:

* the server no longer lists the adapter (``GET /v1/models``), and
* ``inference.trim_grace_s`` has passed since it was unloaded (longer than any request may wait:
  ``gateway.upstream_timeout_s``), so no request that named it can still be queued.

A version that loads again before then simply leaves the list of retired files.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable


@dataclass(frozen=True)
class RetiredFiles:
    """The staged copy of a version the worker no longer holds loaded, and when it stopped holding it
    (``time.monotonic``)."""

    version: int
    path: Path
    retired_at: float


def deletable(retired: Iterable[RetiredFiles], listed: set[int], now: float, grace_s: float) -> list[RetiredFiles]:
    """The retired copies that may be deleted now: not listed by the server and retired ``grace_s`` ago or more."""
    return [r for r in retired if r.version not in listed and now - r.retired_at >= grace_s]
