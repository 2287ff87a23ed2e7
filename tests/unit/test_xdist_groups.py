"""Every module that uses the session's shared vLLM server runs on the one pytest-xdist worker that starts it."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import XDIST_GROUP_OF_MODULE

E2E = Path(__file__).resolve().parents[1] / "e2e"


def test_every_module_of_the_shared_vllm_server_is_in_its_group() -> None:
    users = sorted(p.stem for p in E2E.glob("test_*.py") if "vllm_fixture()" in p.read_text())
    assert len(users) >= 10  # the search still finds them
    assert {m: XDIST_GROUP_OF_MODULE.get(m) for m in users} == {m: "vllm" for m in users}
