"""Version weights by URL: a weight store is a local directory or any fsspec URL (``s3://``, ``gs://``, ``file://``;
``http(s)://`` read-only, for replicas).

The learner writes a version locally and uploads it (:func:`upload_version`); its ``uri`` is then the version's URL.
A sync worker refuses a URL outside its configured roots (:func:`check_url_under_roots`: the same scheme and host,
and a path under the root's, with no ``..``, query or fragment) and downloads exactly the manifest's files
(:func:`download_version`), hashing the bytes as it writes them: a corrupted or truncated download is refused
(:class:`DownloadMismatch`) and nothing of it is kept. fsspec and its filesystems (s3fs for S3, aiohttp for HTTP)
are imported only when a URL is used (extra ``rlstream[s3]``).
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, Iterable
from urllib.parse import unquote, urlsplit

from rlstream.schemas.models import PolicyVersion
from rlstream.transport.manifest import ManifestError, UriOutsideRoots, check_file_types, check_size

#: Schemes that are read with fsspec (``file://`` and plain paths are local directories).
_LOCAL_SCHEMES = frozenset({"", "file"})
#: Schemes a learner cannot write to.
READ_ONLY_SCHEMES = frozenset({"http", "https"})


class DownloadMismatch(ManifestError):
    """A downloaded file does not match the manifest (wrong sha256, truncated, too long) or could not be read."""


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names a remote store read through fsspec (a URL whose scheme is not ``file``; a Windows
    drive letter is a path)."""
    scheme = urlsplit(uri).scheme
    return len(scheme) > 1 and scheme.lower() not in _LOCAL_SCHEMES


def join_url(base: str, *parts: str) -> str:
    """``base`` with ``parts`` appended as path segments."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def _url_parts(url: str) -> tuple[str, str, str]:
    """(scheme, host[:port], normalized path) of a URL; :class:`ManifestError` for ``..``, a query, a fragment or
    credentials."""
    parts = urlsplit(url)
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise ManifestError(f"url {url!r} carries a query, fragment or credentials")
    path = unquote(parts.path)
    if ".." in PurePosixPath(path).parts or "\\" in path:
        raise ManifestError(f"url {url!r} holds '..' or a backslash")
    norm = posixpath.normpath("/" + path.lstrip("/")) if path.strip("/") else "/"
    return parts.scheme.lower(), parts.netloc.lower(), norm


def check_url_under_roots(version: PolicyVersion, roots: Iterable[str]) -> str:
    """The version's ``uri`` if it lies under one of the URL ``roots`` (same scheme and host, path strictly below
    the root's), else :class:`UriOutsideRoots`."""
    url_roots = [r for r in (str(r) for r in roots) if is_remote(r)]
    try:
        scheme, host, path = _url_parts(version.uri)
    except ManifestError as exc:
        raise UriOutsideRoots(f"version {version.version} of {version.policy!r}: {exc}") from exc
    for root in url_roots:
        r_scheme, r_host, r_path = _url_parts(root)
        if (scheme, host) == (r_scheme, r_host) and path != r_path and \
                path.startswith(r_path.rstrip("/") + "/"):
            return version.uri
    raise UriOutsideRoots(f"version {version.version} of {version.policy!r}: uri {version.uri!r} is outside "
                          f"inference.weights_roots {url_roots}")


def filesystem(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it."""
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:  # pragma: no cover - the [s3] extra brings it
        raise ManifestError("a weights URL needs fsspec (pip install 'rlstream[s3]')") from exc
    try:
        return url_to_fs(url, **(options or {}))
    except (ImportError, ValueError, TypeError) as exc:  # no filesystem for the scheme, bad options
        raise ManifestError(f"no fsspec filesystem for {url!r}: {exc}") from exc


def upload_version(local: Path, url: str, manifest_name: str = "manifest.json",
                   options: dict[str, Any] | None = None) -> str:
    """Copy the files of the version directory ``local`` to ``url`` (the manifest last, so a reader that finds it
    finds every file) and check each size there; returns ``url``."""
    if urlsplit(url).scheme.lower() in READ_ONLY_SCHEMES:
        raise ValueError(f"weight store {url!r} is read-only (http(s)); publish to s3://, gs://, file:// or a path")
    fs, root = filesystem(url, options)
    files = sorted((p for p in Path(local).rglob("*") if p.is_file()), key=lambda p: p.name == manifest_name)
    for path in files:
        rel = path.relative_to(local).as_posix()
        target = join_url(root, rel)
        parent = posixpath.dirname(target)
        if parent:
            fs.makedirs(parent, exist_ok=True)
        fs.put_file(str(path), target)
        size = fs.size(target)
        if size != path.stat().st_size:
            raise OSError(f"uploaded {rel} to {url}: {size} bytes there, {path.stat().st_size} here")
    return url


def download_version(version: PolicyVersion, destination: Path, chunk: int = 1 << 20,
                     max_bytes: int | None = None, options: dict[str, Any] | None = None) -> Path:
    """Download the manifest's files of ``version.uri`` into ``destination`` (created; replaced atomically),
    hashing the bytes as they are written. Raises :class:`DownloadMismatch` (and leaves nothing) when a file's size
    or sha256 differs from the manifest or cannot be read, and the refusals of the manifest checks (file types, size
    limit) before anything is fetched."""
    check_file_types(version)
    check_size(version, sum(max(0, f.size) for f in version.files), max_bytes)
    if not version.files:
        raise ManifestError(f"version {version.version} of {version.policy!r} has an empty sha256 manifest")
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = destination.parent / f".tmp-{destination.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    total = 0
    try:
        fs, root = filesystem(version.uri, options)
        # one streaming GET per file over HTTP (no range requests, which a static server may not answer)
        stream = {"block_size": 0} if urlsplit(version.uri).scheme.lower() in READ_ONLY_SCHEMES else {}
        for entry in version.files:
            rel = PurePosixPath(entry.path)
            if rel.is_absolute() or ".." in rel.parts or "\\" in entry.path:
                raise ManifestError(f"manifest path {entry.path!r} leaves the weights directory")
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            digest, size = hashlib.sha256(), 0
            try:
                with fs.open(join_url(root, rel.as_posix()), "rb", **stream) as src, open(target, "xb") as dst:
                    while block := src.read(chunk):
                        digest.update(block)
                        dst.write(block)
                        size += len(block)
                        total += len(block)
                        check_size(version, total, max_bytes)
                        if entry.size and size > entry.size:
                            raise DownloadMismatch(f"{entry.path}: more than the manifest's {entry.size} bytes")
            except Exception as exc:  # noqa: BLE001 - any store error (HTTP, S3, network) is a failed download
                if isinstance(exc, ManifestError):
                    raise
                raise DownloadMismatch(f"{entry.path}: download from {version.uri} failed: {exc}") from exc
            if entry.size and size != entry.size:
                raise DownloadMismatch(f"{entry.path}: downloaded {size} bytes, manifest {entry.size} (truncated)")
            if digest.hexdigest() != entry.sha256.lower():
                raise DownloadMismatch(f"{entry.path}: downloaded sha256 {digest.hexdigest()} != manifest "
                                       f"{entry.sha256}")
            os.chmod(target, 0o400)
        shutil.rmtree(destination, ignore_errors=True)
        os.replace(tmp, destination)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return destination
