"""structlog set-up: JSON lines for services, readable output on a terminal."""
from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

_configured: str | None = None


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write, so that a logger configured
    while stderr was temporarily replaced (a CLI test runner, a captured pytest phase) never holds on
    to a stream that has been closed since."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


CURRENT_STDERR = _CurrentStderr()


def configure_logging(mode: Literal["auto", "json", "console"] = "auto", level: str = "INFO") -> None:
    """Configure structlog once per process. ``auto`` picks console on a TTY, JSON otherwise."""
    global _configured
    if mode == "auto":
        mode = "console" if sys.stderr.isatty() else "json"
    if _configured == f"{mode}:{level}":
        return
    renderer = structlog.dev.ConsoleRenderer() if mode == "console" else structlog.processors.JSONRenderer()
    logging.basicConfig(level=level, stream=CURRENT_STDERR, format="%(message)s")
    # HTTP clients (httpx, and httpx2 under the OpenAI client) log every request at INFO: noise in a service log
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=CURRENT_STDERR),
        cache_logger_on_first_use=False,
    )
    _configured = f"{mode}:{level}"


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
