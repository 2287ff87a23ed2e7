"""Checking a PolicyVersion's weight files against its sha256 manifest before anything is loaded.

Version records are untrusted input: anyone who can write to ``policy-versions`` can announce any ``uri``.
:func:`verify` therefore also refuses a ``uri`` that does not lie under one of the allowed roots (after resolving
symlinks and ``..``), a weights directory holding files the manifest does not list, a file that is not safetensors,
JSON or a tokenizer file (:func:`allowed_file`: no pickle, ``.bin`` or ``.pt``), a hard-linked file (a second name
of a file that may lie anywhere on the file system) and a version larger than its size limit. :func:`stage` then
copies the listed files into a private staging directory, hashing the very bytes it writes and counting them
against the limit; what is handed to vLLM is that copy, so what was verified is what is loaded (a file swapped in
the source directory after the check is never read). :func:`rollback_dir` confines a version's ``base_model`` to
the roots before a full reload may fall back to it.

Shared by the inference sync worker (before a version is loaded into vLLM) and the learner (before it reloads the
serving version's weights, :mod:`rlstream.learner.reset`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterable
from urllib.parse import unquote, urlparse

from rlstream.schemas.models import FileDigest, PolicyVersion


class ManifestError(ValueError):
    """The weight files do not match the manifest (missing, wrong size, wrong sha256, unsafe path)."""


class UntrustedVersion(ManifestError):
    """A version record refused before any weight is read; ``reason`` is the metric tag."""

    reason = "untrusted"


class UriOutsideRoots(UntrustedVersion):
    reason = "uri_outside_roots"


class FileNotInManifest(UntrustedVersion):
    reason = "file_not_in_manifest"


class FileTypeNotAllowed(UntrustedVersion):
    reason = "file_type_not_allowed"


class HardLinkRefused(UntrustedVersion):
    reason = "hard_link"


class VersionTooLarge(UntrustedVersion):
    reason = "version_too_large"


#: Files a version directory may hold beyond its PolicyVersion manifest (the learner's own manifest file).
ALLOWED_UNLISTED = frozenset({"manifest.json"})
#: Suffixes a version's files may have: weights only as safetensors, configuration as JSON, tokenizers' own formats.
ALLOWED_SUFFIXES = frozenset({".safetensors", ".json", ".tiktoken"})
#: Tokenizer files without one of those suffixes (sentencepiece models, BPE merges, WordPiece vocabularies, templates).
ALLOWED_NAMES = frozenset({"tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "merges.txt", "vocab.txt",
                           "chat_template.jinja"})
#: The default of ``inference.max_version_bytes``.
DEFAULT_MAX_VERSION_BYTES = 128 * 1024 ** 3


def allowed_file(path: str) -> bool:
    """Whether a version may hold a file at ``path`` (relative): safetensors, JSON or a tokenizer file."""
    name = Path(path).name
    return name in ALLOWED_NAMES or Path(name).suffix.lower() in ALLOWED_SUFFIXES


def check_file_types(version: PolicyVersion) -> None:
    """Refuse (:class:`FileTypeNotAllowed`) a manifest listing a file that is not safetensors, JSON or tokenizer."""
    refused = sorted(f.path for f in version.files if not allowed_file(f.path))
    if refused:
        raise FileTypeNotAllowed(f"version {version.version} of {version.policy!r} lists {len(refused)} file(s) "
                                 f"that are not safetensors, JSON or tokenizer files (pickle-based weights such as "
                                 f".bin or .pt are never loaded), e.g. {refused[:5]}")


def check_not_hard_linked(version: PolicyVersion, path: Path, stat: os.stat_result) -> None:
    """Refuse (:class:`HardLinkRefused`) a file with more than one name."""
    if stat.st_nlink > 1:
        raise HardLinkRefused(f"version {version.version} of {version.policy!r}: {path.name} is a hard link "
                              f"({stat.st_nlink} names); version files must be plain files")


def check_size(version: PolicyVersion, total: int, limit: int | None) -> None:
    """Refuse (:class:`VersionTooLarge`) a version whose files add up to more than ``limit`` bytes."""
    if limit is not None and total > limit:
        raise VersionTooLarge(f"version {version.version} of {version.policy!r} holds at least {total} bytes, "
                              f"above inference.max_version_bytes={limit}")


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


def check_under_roots(version: PolicyVersion, directory: Path, roots: Iterable[Path]) -> Path:
    """The resolved ``directory`` if it lies under one of ``roots`` (both resolved: symlinks, ``..``), else
    :class:`UriOutsideRoots`."""
    resolved = Path(os.path.realpath(directory))
    allowed = [Path(os.path.realpath(r)) for r in roots]
    for root in allowed:
        if resolved != root and root in resolved.parents:
            return resolved
    raise UriOutsideRoots(f"version {version.version} of {version.policy!r}: uri {version.uri!r} resolves to "
                          f"{resolved}, outside inference.weights_roots {[str(r) for r in allowed]}")


def check_only_listed(version: PolicyVersion, directory: Path) -> None:
    """Refuse (:class:`FileNotInManifest`) a weights directory holding a file or link the manifest does not list."""
    listed = {Path(f.path).as_posix() for f in version.files}
    extra = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                   if (p.is_file() or p.is_symlink()) and p.relative_to(directory).as_posix() not in listed
                   and p.relative_to(directory).as_posix() not in ALLOWED_UNLISTED)
    if extra:
        raise FileNotInManifest(f"version {version.version} of {version.policy!r}: {directory} holds "
                                f"{len(extra)} file(s) not in the manifest, e.g. {extra[:5]}")


def verify(version: PolicyVersion, root: Path | None = None, roots: Iterable[Path] | None = None,
           hash_files: bool = True, max_bytes: int | None = DEFAULT_MAX_VERSION_BYTES) -> Path:
    """Check every file of the manifest; return the weights directory or raise :class:`ManifestError`.

    With ``roots``, the directory must lie under one of them and hold no file outside the manifest. Every file
    must be an allowed type (:func:`allowed_file`) and a plain file with one name, and the files may add up to
    ``max_bytes`` at most (None: no limit). ``hash_files=False`` checks presence and sizes only (:func:`stage`
    hashes while copying).
    """
    directory = local_dir(version.uri, root)
    if roots is not None:
        directory = check_under_roots(version, directory, roots)
    if not version.files:
        raise ManifestError(f"version {version.version} of {version.policy!r} has an empty sha256 manifest")
    check_file_types(version)
    check_size(version, sum(max(0, f.size) for f in version.files), max_bytes)
    if not directory.is_dir():
        raise ManifestError(f"weights directory {directory} of version {version.version} does not exist")
    if roots is not None:
        check_only_listed(version, directory)
    base = directory.resolve()
    total = 0
    for entry in version.files:
        path = (directory / entry.path).resolve()
        if base not in path.parents:
            raise ManifestError(f"manifest path {entry.path!r} leaves the weights directory")
        if not path.is_file():
            raise ManifestError(f"{entry.path} listed in the manifest is missing from {directory}")
        stat = path.stat()
        check_not_hard_linked(version, path, stat)
        if entry.size and stat.st_size != entry.size:
            raise ManifestError(f"{entry.path}: size {stat.st_size} != manifest {entry.size}")
        total += stat.st_size
        check_size(version, total, max_bytes)
        if hash_files:
            actual = sha256_of(path)
            if actual != entry.sha256.lower():
                raise ManifestError(f"{entry.path}: sha256 {actual} != manifest {entry.sha256}")
    return directory


def stage(version: PolicyVersion, directory: Path, staging_root: Path, name: str, chunk: int = 1 << 20,
          max_bytes: int | None = DEFAULT_MAX_VERSION_BYTES) -> Path:
    """Copy the manifest's files of ``directory`` into ``staging_root/name``, hashing the bytes as they are
    written; raise :class:`ManifestError` (and leave nothing) unless every copy matches its sha256 and size, no
    source file is hard-linked or of a type not allowed, and no more than ``max_bytes`` are copied in all.

    The staged directory holds exactly the manifest's files, read-only, in a directory only this user can
    open: it is what the server loads.
    """
    staging_root = Path(staging_root)
    staging_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    final = staging_root / name
    tmp = staging_root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    base = Path(os.path.realpath(directory))
    total = 0
    try:
        check_file_types(version)
        for entry in version.files:
            source = Path(os.path.realpath(base / entry.path))
            if base not in source.parents:
                raise ManifestError(f"manifest path {entry.path!r} leaves the weights directory")
            target = tmp / entry.path
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            digest, size = hashlib.sha256(), 0
            with open(source, "rb") as src, open(target, "xb") as dst:
                check_not_hard_linked(version, source, os.fstat(src.fileno()))  # the file opened, not its name
                while block := src.read(chunk):
                    digest.update(block)
                    dst.write(block)
                    size += len(block)
                    total += len(block)
                    check_size(version, total, max_bytes)
            if entry.size and size != entry.size:
                raise ManifestError(f"{entry.path}: size {size} != manifest {entry.size}")
            if digest.hexdigest() != entry.sha256.lower():
                raise ManifestError(f"{entry.path}: sha256 {digest.hexdigest()} != manifest {entry.sha256}")
            os.chmod(target, 0o400)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except OSError as exc:  # a listed file vanished, a duplicate path, a full disk: nothing is loaded
        shutil.rmtree(tmp, ignore_errors=True)
        raise ManifestError(f"staging version {version.version} failed: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def rollback_dir(base_model: str, roots: Iterable[Path], root: Path | None = None) -> Path | None:
    """The local directory of a version's ``base_model`` when it lies under one of ``roots`` (symlinks and ``..``
    resolved) and exists; None otherwise (a hub name, a path elsewhere): a full reload then has nothing to fall
    back to rather than loading weights from wherever a record points."""
    try:
        directory = local_dir(base_model, root)
    except ManifestError:
        return None
    resolved = Path(os.path.realpath(directory))
    for allowed in (Path(os.path.realpath(r)) for r in roots):
        if resolved != allowed and allowed in resolved.parents:
            return resolved if resolved.is_dir() else None
    return None
