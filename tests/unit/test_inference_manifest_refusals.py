"""What a version directory may hold: safetensors, JSON and tokenizer files only (no pickle-based weights), no hard
links, no more bytes than the limit; and the rollback base model only from under the weights roots."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlstream.inference.manifest import (FileTypeNotAllowed, HardLinkRefused, ManifestError, VersionTooLarge,
                                        allowed_file, digest_files, rollback_dir, stage, verify)
from rlstream.schemas.models import FileDigest, PolicyVersion, WeightsKind

pytestmark = pytest.mark.unit


def version_of(directory: Path, files: list[FileDigest] | None = None) -> PolicyVersion:
    return PolicyVersion(policy="p", version=1, base_model="b", kind=WeightsKind.lora, uri=str(directory),
                         files=digest_files(directory) if files is None else files, learner_step=1)


def adapter_dir(directory: Path, size: int = 256) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text('{"r": 2}')
    (directory / "adapter_model.safetensors").write_bytes(bytes(range(256)) * (size // 256))
    return directory


@pytest.mark.parametrize("name", ["model.safetensors", "adapter_model.safetensors", "config.json", "tokenizer.json",
                                  "sub/model-00001-of-00002.safetensors", "tokenizer.model", "merges.txt",
                                  "vocab.txt", "chat_template.jinja", "spiece.model", "cl100k_base.tiktoken"])
def test_weights_json_and_tokenizer_files_are_allowed(name: str) -> None:
    assert allowed_file(name)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "adapter_model.bin", "model.pt", "weights.pth",
                                  "data.pkl", "evil.py", "README.md", "model.safetensors.bin", "run.sh"])
def test_pickle_code_and_other_files_are_refused(name: str, tmp_path: Path) -> None:
    assert not allowed_file(name)
    directory = adapter_dir(tmp_path / "v1")
    (directory / name).parent.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(b"\x80\x04 pickle or code")
    version = version_of(directory)  # the manifest lists it with its right digest: the type alone refuses it
    with pytest.raises(FileTypeNotAllowed, match="not safetensors, JSON or tokenizer"):
        verify(version, roots=[tmp_path])
    with pytest.raises(FileTypeNotAllowed):
        stage(version, directory, tmp_path / "staging", "p-v1")
    assert not (tmp_path / "staging" / "p-v1").exists()


def test_a_clean_directory_verifies_and_stages(tmp_path: Path) -> None:
    """Negative control of the refusals below: the same directory without the fault is accepted."""
    directory = adapter_dir(tmp_path / "v1")
    version = version_of(directory)
    assert verify(version, roots=[tmp_path], max_bytes=512) == directory.resolve()
    staged = stage(version, directory, tmp_path / "staging", "p-v1", max_bytes=512)
    assert sorted(p.name for p in staged.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_hard_link_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere" / "secret.safetensors"  # any file of the file system, named from inside
    secret.parent.mkdir()
    secret.write_bytes(b"outside the weights roots")
    directory = adapter_dir(tmp_path / "root" / "v1")
    os.link(secret, directory / "extra.safetensors")
    version = version_of(directory)
    with pytest.raises(HardLinkRefused, match="hard link"):
        verify(version, roots=[tmp_path / "root"])
    with pytest.raises(HardLinkRefused):
        stage(version, directory, tmp_path / "staging", "p-v1")
    assert not (tmp_path / "staging" / "p-v1").exists()


def test_a_version_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    directory = adapter_dir(tmp_path / "v1", size=4096)
    version = version_of(directory)
    with pytest.raises(VersionTooLarge, match="max_version_bytes=1000"):
        verify(version, roots=[tmp_path], max_bytes=1000)
    # a manifest that leaves the sizes out (0 = unknown) is caught by the files' sizes, and by the bytes copied
    unsized = version_of(directory, [f.model_copy(update={"size": 0}) for f in digest_files(directory)])
    with pytest.raises(VersionTooLarge):
        verify(unsized, roots=[tmp_path], max_bytes=1000, hash_files=False)
    with pytest.raises(VersionTooLarge):
        stage(unsized, directory, tmp_path / "staging", "p-v1", max_bytes=1000)
    assert not (tmp_path / "staging" / "p-v1").exists()
    assert stage(unsized, directory, tmp_path / "staging", "p-v1", max_bytes=10_000).is_dir()


def test_the_rollback_base_model_is_confined_to_the_weights_roots(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    base = root / "base-model"
    base.mkdir(parents=True)
    outside = tmp_path / "elsewhere" / "base-model"
    outside.mkdir(parents=True)
    (root / "link").symlink_to(outside, target_is_directory=True)
    assert rollback_dir(str(base), [root]) == base.resolve()
    assert rollback_dir(f"file://{base}", [root]) == base.resolve()
    assert rollback_dir("base-model", [root], root=root) == base.resolve()  # relative to inference.weights_root
    assert rollback_dir(str(outside), [root]) is None
    assert rollback_dir(str(root / ".." / "elsewhere" / "base-model"), [root]) is None
    assert rollback_dir(str(root / "link"), [root]) is None  # symlink escape
    assert rollback_dir(str(root), [root]) is None  # the root itself is no version
    assert rollback_dir("Qwen/Qwen2.5-0.5B", [root]) is None  # a hub name: nothing local to fall back to
    assert rollback_dir("s3://bucket/base", [root]) is None
    assert rollback_dir(str(root / "missing"), [root]) is None


def test_manifest_errors_stay_manifest_errors() -> None:
    """The sync worker catches ManifestError: every refusal here is one (dead-lettered, never a crash)."""
    for cls in (FileTypeNotAllowed, HardLinkRefused, VersionTooLarge):
        assert issubclass(cls, ManifestError)
