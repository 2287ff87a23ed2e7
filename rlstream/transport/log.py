"""One log pipeline: JSON lines for services, readable output on a terminal, for rlstream's own (structlog)
events and for every library that logs through the standard ``logging`` module alike.

structlog events are handed to ``logging``; one handler on the root logger formats every record with
structlog's ``ProcessorFormatter``: level, logger name, timestamp, secret masking, then the renderer. So in
JSON mode every line a service writes to stderr (aiokafka, faust/mode, transformers, httpx, urllib3,
asyncio, warnings, an uncaught exception) is one JSON object with ``event`` and ``level``, and in console
mode foreign lines read like rlstream's own. Libraries that install their own handler (transformers,
huggingface_hub) are made to propagate to the root handler instead; the Faust worker, which replaces the
root handlers at start, is given :func:`logging_dict_config`.
"""
from __future__ import annotations

import logging
import logging.config
import sys
import threading
from typing import Any, Literal

import structlog

from rlstream.schemas.masking import mask_data

_configured: str | None = None
_settings: tuple[str, str] = ("console", "INFO")

#: Libraries that add a handler of their own to their top logger and/or stop propagation.
OWNED_LOGGERS = ("transformers", "huggingface_hub")
#: Libraries that log every HTTP request at INFO: noise in a service log.
QUIET_LOGGERS = ("httpx", "httpx2", "urllib3")


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


class RlstreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler of the pipeline (one per process; replaced when logging is configured again)."""


class _OwnedLogger(logging.Logger):
    """A library's top logger that always propagates to the root handler and takes no handler of its own
    (transformers adds a plain StreamHandler and sets ``propagate = False`` on first use)."""

    @property  # type: ignore[override]
    def propagate(self) -> bool:
        return True

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass

    def addHandler(self, hdlr: logging.Handler) -> None:  # noqa: N802 (logging's name)
        if isinstance(hdlr, (logging.NullHandler, RlstreamHandler)):
            super().addHandler(hdlr)


def _own(name: str) -> None:
    logger = logging.getLogger(name)
    if type(logger) is logging.Logger:
        logger.__class__ = _OwnedLogger
    for handler in list(logger.handlers):
        if not isinstance(handler, (logging.NullHandler, RlstreamHandler)):
            logger.removeHandler(handler)


def mask_secrets(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Mask URL passwords and every secret value of the config in every string of the event."""
    return mask_data(event_dict)


def _processors(mode: str) -> tuple[list[Any], list[Any], Any]:
    """(chain before the hand-off, chain for foreign records, renderer)."""
    renderer: Any = (structlog.dev.ConsoleRenderer() if mode == "console"
                     else structlog.processors.JSONRenderer(default=str))
    common = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    return common, common, renderer


def make_handler(mode: str | None = None) -> logging.Handler:
    """A handler that renders any record as the pipeline does (used for the root logger and by Faust)."""
    mode = mode or _settings[0]
    _, foreign, renderer = _processors(mode)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=foreign,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            mask_secrets,
            renderer,
        ],
    )
    handler = RlstreamHandler(CURRENT_STDERR)
    handler.setFormatter(formatter)
    return handler


def logging_dict_config(foreign_level: str | None = None) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` that keeps the pipeline, for tools that insist on configuring logging
    themselves (``faust.Worker(logging_config=...)``): the root handler is the pipeline's, at the configured
    level; ``foreign_level`` applies to faust, mode and aiokafka."""
    mode, level = _settings
    config: dict[str, Any] = {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"rlstream": {"()": make_handler, "mode": mode}},
        "root": {"level": level, "handlers": ["rlstream"]},
    }
    if foreign_level:
        config["loggers"] = {name: {"level": foreign_level.upper()} for name in ("faust", "mode", "aiokafka")}
    return config


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("rlstream").critical("uncaught exception", exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    logging.getLogger("rlstream").critical("uncaught exception in thread %s", getattr(args.thread, "name", "?"),
                                           exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def configure_logging(mode: Literal["auto", "json", "console"] = "auto", level: str = "INFO") -> None:
    """Configure the pipeline once per process (again when mode or level change). ``auto`` picks console on a
    TTY, JSON otherwise."""
    global _configured, _settings
    if mode == "auto":
        mode = "console" if sys.stderr.isatty() else "json"
    level = level.upper()
    if _configured == f"{mode}:{level}":
        return
    _settings = (mode, level)
    root = logging.getLogger()
    for handler in list(root.handlers):
        # ours from an earlier call, and plain console handlers (logging.basicConfig) that would print the
        # same record a second time, unformatted; test tools' handlers (pytest's capture) stay
        plain_console = type(handler) is logging.StreamHandler and getattr(handler, "stream", None) in (
            sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__, CURRENT_STDERR)
        if isinstance(handler, RlstreamHandler) or plain_console:
            root.removeHandler(handler)
    root.addHandler(make_handler(mode))
    root.setLevel(level)
    for name in OWNED_LOGGERS:
        _own(name)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    logging.captureWarnings(True)
    if mode == "json":  # a traceback would be many lines that are not JSON
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
    else:  # a terminal shows tracebacks as Python (or typer) prints them
        if sys.excepthook is _log_uncaught:
            sys.excepthook = sys.__excepthook__
        if threading.excepthook is _log_uncaught_in_thread:
            threading.excepthook = threading.__excepthook__
    chain, _, _ = _processors(mode)
    structlog.configure(
        processors=[
            *chain,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    _configured = f"{mode}:{level}"


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
