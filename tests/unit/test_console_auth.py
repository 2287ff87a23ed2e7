"""Who may read ``rlstream console``: loopback without keys; any other address only with keys, and then the data
paths need a key with the gateway's ``admin`` scope (the page and its static files carry no data)."""
from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from rlstream.gateway.auth import API_KEYS_ENV, KeyStore
from rlstream.ops.console.app import STATIC_DIR, ConsoleOptions, ConsoleStartError, build_app, key_store
from rlstream.schemas.config import load_config

pytestmark = pytest.mark.unit

ADMIN = "admin-key-0123456789abcdef"
READER = "inference-key-0123456789abcdef"


def client(keys: KeyStore) -> TestClient:
    return TestClient(build_app(load_config(None, []), keys, follow=False))


def test_non_loopback_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    with pytest.raises(ConsoleStartError, match="needs an admin key"):
        key_store(ConsoleOptions(host="0.0.0.0"))
    assert key_store(ConsoleOptions(host="0.0.0.0", api_keys=[ADMIN])).enabled
    assert not key_store(ConsoleOptions(host="127.0.0.1")).enabled  # loopback: open


def test_data_paths_need_the_admin_scope(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"keys:\n- key: {ADMIN}\n  tenant: ops\n  scopes: [admin]\n"
                         f"- key: {READER}\n  tenant: ops\n  scopes: [inference]\n")
    keys_file.chmod(0o600)
    web = client(KeyStore(keys_file=keys_file))
    assert web.get("/").status_code == 200 and "rlstream console" in web.get("/").text  # the page: no data
    assert web.get("/static/uPlot.iife.min.js").status_code == 200
    assert web.get("/api/state").status_code == 401
    assert web.get("/api/state", headers={"Authorization": f"Bearer {READER}"}).status_code == 403
    state = web.get("/api/state", headers={"Authorization": f"Bearer {ADMIN}"})
    assert state.status_code == 200 and state.json()["versions"] == []


def test_open_on_loopback_without_keys() -> None:
    web = client(KeyStore())
    assert web.get("/api/state").status_code == 200
    assert web.get("/api/compare", params={"example": "e", "a": "x", "b": "2"}).status_code == 400


def test_the_charts_library_ships_with_its_license() -> None:
    """Offline: the page loads uPlot from the package (no CDN), and the file carries its licence beside it."""
    page = (STATIC_DIR / "index.html").read_text()
    assert 'src="/static/uPlot.iife.min.js"' in page and "http" not in page.replace("http-equiv", "")
    assert (STATIC_DIR / "uPlot.iife.min.js").read_text().startswith("/*! https://github.com/leeoniya/uPlot")
    assert "MIT License" in (STATIC_DIR / "uPlot.LICENSE").read_text()
