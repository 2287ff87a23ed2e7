"""Checking a PolicyVersion's weight files against its sha256 manifest before anything is loaded."""
from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import unquote, urlparse

from rlstream.schemas.models import FileDigest, PolicyVersion


class ManifestError(ValueError):
    """The weight files do not match the manifest (missing, wrong size, wrong sha256, unsafe path)."""


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def digest_files(directory: Path) -> list[FileDigest]:
    """The manifest of every file under ``directory`` (relative paths, sorted)."""
    directory = Path(directory)
    return [FileDigest(path=str(p.relative_to(directory)), sha256=sha256_of(p), size=p.stat().st_size)
            for p in sorted(directory.rglob("*")) if p.is_file()]


def local_dir(uri: str, root: Path | None = None) -> Path:
    """The local directory of a version's ``uri`` (``file://`` URL or a path, relative to ``root``)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:
        raise ManifestError(f"uri scheme {parsed.scheme!r} is not supported by this worker (need a local path)")
    path = Path(uri)
    return path if path.is_absolute() or root is None else Path(root) / path


def verify(version: PolicyVersion, root: Path | None = None) -> Path:
    """Check every file of the manifest; return the weights directory or raise :class:`ManifestError`."""
    directory = local_dir(version.uri, root)
    if not version.files:
        raise ManifestError(f"version {version.version} of {version.policy!r} has an empty sha256 manifest")
    if not directory.is_dir():
        raise ManifestError(f"weights directory {directory} of version {version.version} does not exist")
    base = directory.resolve()
    for entry in version.files:
        path = (directory / entry.path).resolve()
        if base not in path.parents:
            raise ManifestError(f"manifest path {entry.path!r} leaves the weights directory")
        if not path.is_file():
            raise ManifestError(f"{entry.path} listed in the manifest is missing from {directory}")
        if entry.size and path.stat().st_size != entry.size:
            raise ManifestError(f"{entry.path}: size {path.stat().st_size} != manifest {entry.size}")
        actual = sha256_of(path)
        if actual != entry.sha256.lower():
            raise ManifestError(f"{entry.path}: sha256 {actual} != manifest {entry.sha256}")
    return directory
