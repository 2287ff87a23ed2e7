"""Where the learner writes and announces versions for each learner.weight_store: a directory, a file:// URL, or a
remote URL (written under <output_dir>/versions, uploaded, announced by URL)."""
from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest

from rlstream.learner.checkpoint import write_manifest
from rlstream.learner.publish import store_version, versions_root

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("store,expected", [(None, "out/versions"), ("/srv/weights", "/srv/weights"),
                                            ("file:///srv/weights", "/srv/weights"),
                                            ("s3://bucket/prefix", "out/versions")])
def test_versions_are_written_locally_under_the_store_or_output_dir(store: str | None, expected: str) -> None:
    assert versions_root(Path("out"), store) == Path(expected)


def test_a_local_store_announces_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "v000001"
    directory.mkdir()
    assert store_version(directory, None, 1) == str(directory.resolve())
    assert store_version(directory, str(tmp_path), 1) == str(directory.resolve())


def test_a_remote_store_gets_every_file_and_announces_its_url(tmp_path: Path) -> None:
    directory = tmp_path / "v000007"
    (directory / "sub").mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(b"w" * 100)
    (directory / "sub" / "tokenizer.json").write_text("{}")
    write_manifest(directory, {"version": 7})
    store = f"memory://store-{uuid.uuid4().hex}/policy"
    url = store_version(directory, store + "/", 7)
    assert url == f"{store}/v000007"
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    assert sorted(p.lstrip("/").removeprefix(root + "/") for p in fs.find(root)) == \
        ["adapter_model.safetensors", "manifest.json", "sub/tokenizer.json"]
    assert fs.cat(f"{root}/manifest.json") == (directory / "manifest.json").read_bytes()
