"""The sync worker's bounded local cache of versions downloaded from a weight store URL.

Each version is downloaded once into ``<inference.weights_cache_dir>/<policy>-v<N>-<digest>`` (the digest of its
manifest, so a same-numbered version of another learner run is never mistaken for it), every file hashed against
the manifest as it is written (:func:`rlstream.transport.weight_store.download_version`). Before a download the cache
makes room under ``inference.weights_cache_bytes`` by deleting the least recently used versions that are not
protected (the versions this replica has loaded and the ones the serving pointer asks for); a version that cannot
fit without deleting a protected one is refused.
"""
from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from rlstream.schemas.models import PolicyVersion
from rlstream.transport.log import get_logger
from rlstream.transport.manifest import ManifestError
from rlstream.transport.weight_store import download_version

log = get_logger(__name__)


class CacheFull(ManifestError):
    """A version does not fit in the cache without deleting a version that is loaded or asked for."""


@dataclass(frozen=True)
class CachedVersion:
    """One version in the cache: its directory, bytes on disk and last use (Unix time)."""

    version: int
    path: Path
    size: int
    used_at: float


def cache_name(version: PolicyVersion) -> str:
    """The cache directory name of a version: policy, number and a short digest of its manifest."""
    digest = hashlib.sha256("\n".join(f"{f.path}:{f.sha256}:{f.size}" for f in sorted(
        version.files, key=lambda f: f.path)).encode()).hexdigest()[:16]
    return f"{version.policy}-v{version.version}-{digest}"


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def to_evict(entries: Iterable[CachedVersion], protected: set[int], need: int, limit: int) -> list[CachedVersion]:
    """The least recently used unprotected entries to delete so that ``need`` more bytes fit under ``limit``;
    :class:`CacheFull` when deleting every unprotected entry is not enough."""
    entries = list(entries)
    used = sum(e.size for e in entries)
    chosen: list[CachedVersion] = []
    for entry in sorted((e for e in entries if e.version not in protected), key=lambda e: e.used_at):
        if used + need <= limit:
            break
        chosen.append(entry)
        used -= entry.size
    if used + need > limit:
        raise CacheFull(f"a version of {need} bytes does not fit in inference.weights_cache_bytes={limit}: "
                        f"{used} bytes are held by versions loaded or asked for")
    return chosen


class WeightsCache:
    """Downloaded versions under ``root``, at most ``max_bytes`` in all."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._entries: dict[str, CachedVersion] = {}
        for path in sorted(self.root.iterdir(), key=lambda p: p.stat().st_mtime):
            if path.name.startswith(".tmp-"):  # a download cut short by a crash
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir() and (version := _version_of(path.name)) is not None:
                self._entries[path.name] = CachedVersion(version, path, _dir_size(path), path.stat().st_mtime)

    @property
    def size(self) -> int:
        """Bytes the cached versions hold."""
        return sum(e.size for e in self._entries.values())

    def versions(self) -> list[int]:
        """The cached version numbers, least recently used first."""
        return [e.version for e in sorted(self._entries.values(), key=lambda e: e.used_at)]

    def fetch(self, version: PolicyVersion, protected: set[int], max_version_bytes: int | None = None,
              options: dict[str, Any] | None = None) -> Path:
        """The local directory of ``version`` (downloaded and verified now unless cached), after evicting the least
        recently used unprotected versions it needs room for."""
        name = cache_name(version)
        entry = self._entries.get(name)
        if entry is not None and entry.path.is_dir():
            self._entries[name] = CachedVersion(entry.version, entry.path, entry.size, time.time())
            return entry.path
        need = sum(max(0, f.size) for f in version.files)
        others = [e for n, e in self._entries.items() if n != name]
        for victim in to_evict(others, protected | {version.version}, need, self.max_bytes):
            shutil.rmtree(victim.path, ignore_errors=True)
            self._entries.pop(victim.path.name, None)
            log.info("cached version evicted", version=victim.version, bytes=victim.size, path=str(victim.path))
        path = download_version(version, self.root / name, max_bytes=max_version_bytes, options=options)
        self._entries[name] = CachedVersion(version.version, path, _dir_size(path), time.time())
        return path


def _version_of(name: str) -> int | None:
    tail = name.rsplit("-v", 1)[-1].split("-", 1)[0] if "-v" in name else ""
    return int(tail) if tail.isdigit() else None
