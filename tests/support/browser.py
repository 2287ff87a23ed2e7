"""The console in a real browser: ``rlstream console``'s app served on a free loopback port, and Debian's chromium
driven by Playwright on it (tests/integration/test_console_browser.py, tests/e2e/test_up_production.py)."""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from rlstream.gateway.auth import KeyStore
from rlstream.ops.console.app import build_app, console_url
from rlstream.ops.ports import LOOPBACK, free_port
from rlstream.schemas.config import RlstreamConfig

CHROMIUM = Path("/usr/bin/chromium")


@contextlib.contextmanager
def served_console(cfg: RlstreamConfig, ready: Callable[[dict[str, Any]], bool]) -> Iterator[str]:
    """The console of ``cfg``'s stack, served by uvicorn on a free loopback port, once its state is ``ready``."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(cfg, KeyStore()), host=LOOPBACK, port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = console_url(LOOPBACK, port)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the feed has read the topics
            try:
                if ready(httpx.get(url + "api/state", timeout=2).json()):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError("the console did not read the stack's topics in 60 s")
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@contextlib.contextmanager
def chromium_page(url: str) -> Iterator[Any]:
    """``url`` open in Debian's chromium (Playwright), once the page has drawn the console's state."""
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.exists(), "Debian's chromium is installed by scripts/bootstrap.sh"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_selector("body[data-loaded=true]", timeout=30_000)
            yield page
        finally:
            browser.close()


def keep_screenshot(page: Any, path: Path) -> None:
    """A full-page screenshot at ``path``, copied to ``$RLSTREAM_ARTIFACTS_DIR`` when set."""
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    if os.environ.get("RLSTREAM_ARTIFACTS_DIR"):
        out = Path(os.environ["RLSTREAM_ARTIFACTS_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / path.name)
