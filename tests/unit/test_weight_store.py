"""Weights by URL: which URLs lie under the configured roots, the download checked against the manifest (fsspec's
in-memory filesystem as the store), and the bounded cache that evicts only versions no replica serves."""
from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest

from rlstream.inference.weights_cache import CacheFull, CachedVersion, WeightsCache, to_evict
from rlstream.transport.manifest import FileTypeNotAllowed, ManifestError, UriOutsideRoots, digest_files
from rlstream.transport.weight_store import (DownloadMismatch, check_url_under_roots, download_version, is_remote,
                                             upload_version)
from rlstream.schemas.models import PolicyVersion, WeightsKind

pytestmark = pytest.mark.unit


def record(uri: str, files_of: Path | None = None, version: int = 1) -> PolicyVersion:
    return PolicyVersion(policy="p", version=version, base_model="b", kind=WeightsKind.lora, uri=uri,
                         files=digest_files(files_of) if files_of else [], learner_step=1)


def adapter_dir(directory: Path, seed: int = 1, size: int = 4096) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(f'{{"r": 2, "seed": {seed}}}')
    (directory / "adapter_model.safetensors").write_bytes(bytes([seed % 256]) * size)
    return directory


@pytest.mark.parametrize("uri,remote", [("s3://b/v1", True), ("gs://b/v1", True), ("https://h/v1", True),
                                        ("memory://x/v1", True), ("file:///tmp/v1", False), ("/tmp/v1", False),
                                        ("runs/v1", False), ("C:\\runs\\v1", False)])
def test_which_uris_are_remote(uri: str, remote: bool) -> None:
    assert is_remote(uri) is remote


ROOTS = ["s3://weights/prod", "https://store.example:8443/versions/"]


@pytest.mark.parametrize("uri", ["s3://weights/prod/v000001", "s3://weights/prod/a/b/v2",
                                 "https://store.example:8443/versions/v000003", "S3://weights/prod/v4"])
def test_a_url_under_a_root_is_accepted(uri: str) -> None:
    """Negative control of the refusals below."""
    assert check_url_under_roots(record(uri), ROOTS) == uri


@pytest.mark.parametrize("uri", [
    "s3://weights/other/v1",  # another prefix
    "s3://weights/prod-evil/v1",  # a sibling sharing the root's characters
    "s3://weights/prod",  # the root itself
    "s3://evil/prod/v1",  # another bucket
    "gs://weights/prod/v1",  # another scheme
    "s3://weights/prod/../other/v1",  # '..'
    "s3://weights/prod/%2e%2e/other/v1",  # '..', percent-encoded
    "https://store.example:9999/versions/v1",  # another port
    "https://user:pw@store.example:8443/versions/v1",  # credentials
    "https://store.example:8443/versions/v1?redirect=x",  # a query
    "http://store.example:8443/versions/v1",  # plain http for an https root
])
def test_a_url_outside_the_roots_is_refused(uri: str) -> None:
    with pytest.raises(UriOutsideRoots):
        check_url_under_roots(record(uri), ROOTS)


def test_path_roots_do_not_admit_urls() -> None:
    with pytest.raises(UriOutsideRoots):
        check_url_under_roots(record("s3://weights/prod/v1"), ["/srv/weights", "weights/prod"])


def memory_store(tmp_path: Path, files: Path) -> str:
    url = f"memory://store-{uuid.uuid4().hex}/v000001"
    upload_version(files, url)
    return url


def test_upload_then_download_gives_the_manifest_files(tmp_path: Path) -> None:
    source = adapter_dir(tmp_path / "learner" / "v000001")
    (source / "manifest.json").write_text("{}")
    url = memory_store(tmp_path, source)
    version = record(url, source)
    version = version.model_copy(update={"files": [f for f in version.files if f.path != "manifest.json"]})
    got = download_version(version, tmp_path / "worker" / "p-v1")
    assert sorted(p.name for p in got.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (got / "adapter_model.safetensors").read_bytes() == (source / "adapter_model.safetensors").read_bytes()


def test_uploading_to_http_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="read-only"):
        upload_version(adapter_dir(tmp_path / "v1"), "https://store.example/versions/v1")


@pytest.mark.parametrize("fault", ["corrupted", "truncated", "longer", "missing"])
def test_a_download_that_does_not_match_the_manifest_is_refused(tmp_path: Path, fault: str) -> None:
    source = adapter_dir(tmp_path / "learner" / "v000001")
    version = record("", source)
    url = memory_store(tmp_path, source)
    version = version.model_copy(update={"uri": url})
    fs = fsspec.filesystem("memory")
    target = url.removeprefix("memory://") + "/adapter_model.safetensors"
    data = fs.cat(target)
    fs.pipe(target, {"corrupted": b"\xff" + data[1:], "truncated": data[:100], "longer": data + b"\0",
                     "missing": data}[fault])
    if fault == "missing":
        fs.rm(target)
    with pytest.raises(DownloadMismatch):
        download_version(version, tmp_path / "worker" / "p-v1")
    assert not (tmp_path / "worker" / "p-v1").exists() and not list((tmp_path / "worker").glob(".tmp-*"))
    # control: the same bytes taken without the check differ from the manifest (what would be loaded)
    if fault != "missing":
        import hashlib
        assert hashlib.sha256(fs.cat(target)).hexdigest() != version.files[1].sha256


def test_a_file_type_not_allowed_is_refused_before_any_download(tmp_path: Path) -> None:
    source = adapter_dir(tmp_path / "v000001")
    (source / "model.pt").write_bytes(b"pickle")
    with pytest.raises(FileTypeNotAllowed):
        download_version(record("memory://nowhere/v1", source), tmp_path / "worker" / "p-v1")


def entry(version: int, size: int, used_at: float) -> CachedVersion:
    return CachedVersion(version, Path(f"/c/p-v{version}"), size, used_at)


def test_eviction_takes_the_least_recently_used_unprotected_versions() -> None:
    entries = [entry(1, 40, 1.0), entry(2, 40, 2.0), entry(3, 40, 3.0)]
    assert to_evict(entries, protected=set(), need=40, limit=120) == [entries[0]]
    assert to_evict(entries, protected={1}, need=40, limit=120) == [entries[1]]  # 1 serves: 2 goes instead
    assert to_evict(entries, protected=set(), need=10, limit=130) == []
    with pytest.raises(CacheFull):
        to_evict(entries, protected={1, 2, 3}, need=40, limit=120)


def test_the_cache_stays_under_its_bound_and_keeps_protected_versions(tmp_path: Path) -> None:
    cache = WeightsCache(tmp_path / "cache", max_bytes=2 * 4200)
    versions = {}
    for n in (1, 2, 3):
        source = adapter_dir(tmp_path / "learner" / f"v{n:06d}", seed=n)
        url = memory_store(tmp_path, source)
        versions[n] = record(url, source, version=n)
    cache.fetch(versions[1], protected=set())
    cache.fetch(versions[2], protected=set())
    cache.fetch(versions[3], protected={1})  # version 1 is loaded: version 2, used later, is evicted instead
    assert sorted(cache.versions()) == [1, 3] and cache.size <= cache.max_bytes
    # control: without the protection, the least recently used (1) would go
    cache.fetch(versions[2], protected=set())
    assert sorted(cache.versions()) == [2, 3] and cache.size <= cache.max_bytes
    # a cached version is served from the cache: deleting the store does not matter
    fsspec.filesystem("memory").rm(versions[3].uri.removeprefix("memory://"), recursive=True)
    assert cache.fetch(versions[3], protected=set()).is_dir()
    # a restarted worker finds what is cached
    assert sorted(WeightsCache(tmp_path / "cache", max_bytes=2 * 4200).versions()) == [2, 3]


def test_a_scheme_without_a_filesystem_is_refused_not_raised(tmp_path: Path) -> None:
    source = adapter_dir(tmp_path / "v000001")
    with pytest.raises(ManifestError, match="no fsspec filesystem"):
        download_version(record("nosuchscheme://bucket/v1", source), tmp_path / "worker" / "p-v1")
    assert not list((tmp_path / "worker").iterdir())
