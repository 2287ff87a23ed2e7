"""Options and helpers shared by every ``rlstream`` command."""
from __future__ import annotations

import asyncio
import errno
import os
import sys
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Coroutine, Optional, Sequence, TypeVar

import typer
from rich.console import Console, ConsoleDimensions
from typer._click.globals import get_current_context  # typer vendors its own click: contexts live there
from typer.core import TyperGroup
from typer.exceptions import TyperException

from rlstream.schemas.config import ConfigError, RlstreamConfig, load_config

T = TypeVar("T")
#: Off a terminal (a pipe, a file, a test) tables are rendered this wide instead of rich's 80 columns, so that ids
#: and offsets are never cut with an ellipsis; ``COLUMNS`` overrides it.
PIPE_WIDTH = 240


class CliConsole(Console):
    """A rich console that, when its output is not a terminal, is ``COLUMNS`` (else :data:`PIPE_WIDTH`) wide.

    Decided at each print, not at import: the same console serves a terminal, a pipe and typer's test runner."""

    @property
    def size(self) -> ConsoleDimensions:
        if self.is_terminal:
            return super().size
        columns = os.environ.get("COLUMNS", "")
        return ConsoleDimensions(int(columns) if columns.isdigit() else PIPE_WIDTH, super().size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


console = CliConsole(stderr=False)
err_console = CliConsole(stderr=True)


class LogFormat(str, Enum):
    """``--log-format``: ``auto`` is console on a terminal, JSON lines otherwise."""

    auto = "auto"
    json = "json"
    console = "console"


class LogLevel(str, Enum):
    """``--log-level`` (of rlstream, and of the Faust worker); accepted in any case."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


ConfigOption = typer.Option(None, "--config", "-c", help="YAML config file", exists=False, dir_okay=False)
#: ``-o KEY VALUE`` (repeatable). Annotate the parameter ``Optional[list[str]]`` (typer cannot express a list of
#: pairs): :class:`RlstreamGroup` hands it ``KEY=VALUE`` tokens, and :func:`pairs` / :func:`load_or_exit` split them.
OverrideOption = typer.Option(
    None, "--override", "-o", help="KEY VALUE: set a dotted config key (repeatable), e.g. -o learner.lora.r 16",
    metavar="KEY VALUE",
)


def pairs(raw: Optional[Sequence[Any]]) -> list[tuple[str, str]]:
    """Override pairs from ``[(key, value)]`` or ``["key=value"]`` items."""
    out: list[tuple[str, str]] = []
    for item in raw or []:
        if isinstance(item, str):
            key, sep, value = item.partition("=")
            if not sep:
                raise typer.BadParameter(f"override {item!r} needs a value: -o KEY VALUE", param_hint="-o")
            out.append((key, value))
        else:
            key, value = item
            out.append((str(key), str(value)))
    return out


OVERRIDE_FLAGS = ("-o", "--override")


def join_override_pairs(args: list[str]) -> list[str]:
    """``-o KEY VALUE`` -> ``-o KEY=VALUE``: typer takes one token per option use; keys hold no ``=``,
    so a token that already has one (``-o key=value``) is left alone."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in OVERRIDE_FLAGS and i + 2 < len(args) and "=" not in args[i + 1]:
            out += [args[i], f"{args[i + 1]}={args[i + 2]}"]
            i += 3
        else:
            out.append(args[i])
            i += 1
    return out


def _takes_overrides(command: Any, args: list[str]) -> bool:
    """Whether the leaf command that ``args`` lead to (through sub-groups) has an ``override`` option."""
    while isinstance(getattr(command, "commands", None), dict):
        name = next((a for a in args if a in command.commands), None)
        if name is None:
            return False
        args = args[args.index(name) + 1:]
        command = command.commands[name]
    return any(getattr(p, "name", None) == "override" for p in command.params)


class RlstreamGroup(TyperGroup):
    """The root ``rlstream`` group: lets every command declaring :data:`OverrideOption` take
    ``-o KEY VALUE`` pairs as NAT does (typer alone cannot express a repeated option with two values), and answers
    every error a command raises with one line and an exit code (:func:`explain`); ``--debug`` (or
    ``RLSTREAM_DEBUG=1``) shows the traceback instead."""

    def make_context(self, info_name: Optional[str], args: list[str], parent: Any = None, **extra: Any) -> Any:
        plain_help(self)  # here, not in __init__: typer adds the completion options after building the group
        return super().make_context(info_name, args, parent=parent, **extra)

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[Any, Any, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and _takes_overrides(command, rest):
            rest = join_override_pairs(rest)
        return name, command, rest

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (TyperException, typer.Exit, typer.Abort, KeyboardInterrupt):  # usage errors and exits as typer says
            raise
        except Exception as exc:
            if ctx.params.get("debug"):  # --debug or RLSTREAM_DEBUG
                raise
            try:
                answer = explain(exc, ctx.meta.get(CONFIG_META))
            except Exception:  # noqa: BLE001 - the answer itself must never end in a traceback
                answer = Answer(f"{type(exc).__name__}: {_one_line(str(exc))} {DEBUG_HINT}", FAILURE)
            typer.echo(f"error: {answer.message}", err=True)
            raise typer.Exit(code=answer.exit_code) from None


#: typer's help labels (``<str>``, ``<list[str]>``, ``<int range>``) as the words a user reads
PLAIN_TYPES = {"str": "TEXT", "int": "INTEGER", "int range": "INTEGER", "float": "FLOAT", "float range": "FLOAT",
               "path": "PATH", "file": "FILE", "directory": "DIRECTORY", "bool": "", "datetime": "DATETIME"}


def plain_type(label: str) -> str:
    """``<list[str]>`` -> ``TEXT``, ``<bool>`` -> nothing (a flag), ``<a|b>`` -> ``[a|b]``."""
    inner = label.strip("<>").removesuffix("...")
    while inner.startswith("list[") and inner.endswith("]"):
        inner = inner[len("list["):-1]
    if inner in PLAIN_TYPES:
        return PLAIN_TYPES[inner]
    return f"[{inner}]" if "|" in inner else inner.upper()


def plain_help(command: Any) -> None:
    """Give every option and argument under ``command`` a plain help label (typer shows Python type names), and
    docstrings' ````code```` the single backticks the help renders as code."""
    for attr in ("help", "short_help"):
        text = getattr(command, attr, None)
        if isinstance(text, str):
            setattr(command, attr, text.replace("``", "`"))
    ctx = typer.Context(command)
    help_option = command.get_help_option(ctx)  # made once and cached by the command
    for param in [*getattr(command, "params", []), *([help_option] if help_option is not None else [])]:
        display = getattr(param, "display_type", None)
        if display is None or getattr(param, "metavar", None) is not None:
            continue
        label = plain_type(str(display(ctx)))
        if param.param_type_name == "option":
            param.metavar = label
        else:  # an argument's metavar is its name in the usage line: only its type column changes
            param.display_type_rich = lambda ctx, label=label: label
    for sub in getattr(command, "commands", {}).values():
        plain_help(sub)


#: ``ctx.meta`` key of the configuration the running command loaded (its addresses name what could not be reached)
CONFIG_META = "rlstream.config"
USAGE = 2
FAILURE = 1
DEBUG_HINT = "(rerun with --debug for the traceback)"


@dataclass(frozen=True)
class Answer:
    """What the CLI says about an error: one line, and the exit code (2 usage, 1 failure)."""

    message: str
    exit_code: int


def _one_line(text: str) -> str:
    return " ".join(text.split())


def explain(exc: BaseException, cfg: Optional[RlstreamConfig] = None) -> Answer:
    """The one-line answer to an error a command raised: what is wrong and what to do."""
    from rlstream.schemas.masking import mask_url

    name = type(exc).__name__
    text = _one_line(str(exc))
    if isinstance(exc, ModuleNotFoundError):
        extra = missing_extra(exc)
        if extra is not None:
            return Answer(f"this command needs the [{extra}] extra ({exc.name} is not installed): "
                          f"pip install 'rlstream[{extra}]' (or 'rlstream[all]')", FAILURE)
        return Answer(f"{text}: install it (pip install {exc.name}) {DEBUG_HINT}", FAILURE)
    if isinstance(exc, (ConfigError, UsageProblem)) or _is_one_of(exc, USAGE_ERRORS):
        return Answer(text, USAGE)
    if _is_one_of(exc, KAFKA_UNREACHABLE):
        where = f"Kafka at {cfg.kafka.bootstrap_servers or 'the embedded broker'}" if cfg is not None \
            else f"Kafka ({text or name})"
        return Answer(f"cannot reach {where}: start the broker (`rlstream infra up`) or set "
                      "kafka.bootstrap_servers (RLSTREAM_KAFKA_BOOTSTRAP)", FAILURE)
    if _is_one_of(exc, KAFKA_ERRORS):
        return Answer(f"Kafka answered {name}: {text}", FAILURE)
    if _is_one_of(exc, REDIS_ERRORS):
        where = f" at {mask_url(str(cfg.redis.url))}" if cfg is not None and cfg.redis.url else ""
        return Answer(f"cannot reach Redis{where} ({text or name}): start it (`rlstream infra up`) or set "
                      "redis.url (RLSTREAM_REDIS_URL)", FAILURE)
    if isinstance(exc, OSError) and exc.filename is not None:
        return Answer(f"{path_problem(Path(str(exc.filename)), exc)}", FAILURE)
    if isinstance(exc, OSError) and exc.strerror:
        return Answer(f"{exc.strerror} {DEBUG_HINT}", FAILURE)
    if _is_one_of(exc, OPERATOR_ERRORS):
        return Answer(text or name, FAILURE)
    return Answer(f"{name}: {text} {DEBUG_HINT}" if text else f"{name} {DEBUG_HINT}", FAILURE)


class UsageProblem(ValueError):
    """A command line that cannot be carried out as given (exit code 2); the message says what to change."""


def path_problem(path: Path, exc: OSError) -> str:
    """``cannot write PATH: Read-only file system: choose a writable location`` (what to do for the usual causes)."""
    advice = {errno.ENOTDIR: "a parent of it is a file, not a directory", errno.ENOSPC: "free some space",
              errno.EEXIST: "a file is in the way"}.get(exc.errno or 0, "choose a writable location")
    return f"cannot write {path}: {exc.strerror or exc}: {advice}"


def require_writable_dir(path: Path, option: str) -> Path:
    """Create ``path`` (a directory) if needed and check this process can write in it, before anything starts;
    raises :class:`UsageProblem` naming ``option`` and the reason (a file in the way, read-only, no permission)."""
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        raise UsageProblem(f"{option} {path} is a file, not a directory: give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # os.access answers yes for root on a read-only mount
            pass
    except OSError as exc:
        raise UsageProblem(f"{option}: {path_problem(path, exc)}") from None
    return path


def require_writable_file(path: Path, option: str) -> Path:
    """Check that the file ``path`` can be written: not a directory, its directory writable (created if needed)."""
    path = path.expanduser()
    if path.is_dir():
        raise UsageProblem(f"{option} {path} is a directory: give a file name")
    require_writable_dir(path.parent, option)
    return path


#: Errors whose message already says what is wrong and what to do, by module (only a loaded module can have raised
#: one, so nothing is imported to recognise them).
OPERATOR_ERRORS = {
    "rlstream.ops.infra": ("InfraError",),
    "rlstream.learner.reporting": ("ReportingError",),
    "rlstream.transport.topic_reader": ("TopicMissingError",),
    "rlstream.ops.plot": ("NoMetricsError",),
    "rlstream.ops.toy": ("ModelAssetMissing",),
}
USAGE_ERRORS = {"rlstream.ops.replay": ("ReplayError",), "rlstream.rollout.loading": ("UserCodeError", "DatasetError"),
                "rlstream.ops.console.app": ("ConsoleStartError",)}
KAFKA_ERRORS = {"aiokafka.errors": ("KafkaError",)}
KAFKA_UNREACHABLE = {"aiokafka.errors": ("KafkaConnectionError", "KafkaTimeoutError", "NodeNotReadyError",
                                         "RequestTimedOutError")}
REDIS_ERRORS = {"redis.exceptions": ("ConnectionError", "TimeoutError")}


def _is_one_of(exc: BaseException, where: dict[str, tuple[str, ...]]) -> bool:
    classes = tuple(getattr(sys.modules[module], name) for module, names in where.items()
                    if module in sys.modules for name in names)
    return bool(classes) and isinstance(exc, classes)


#: The extra that installs each optional top-level module (pyproject.toml, [project.optional-dependencies]).
EXTRA_OF_MODULE = {
    "faust": "streams", "mode": "streams",
    "torch": "learner", "transformers": "learner", "peft": "learner", "safetensors": "learner",
    "tokenizers": "learner",
    "noida_db": "local", "matplotlib": "local", "platformdirs": "local",
    "starlette": "gateway", "uvicorn": "gateway",
    "pyarrow": "export",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The extra to install when ``exc`` is an optional dependency that is not installed, else None."""
    return EXTRA_OF_MODULE.get((exc.name or "").split(".")[0])


def load_or_exit(config: Optional[Path], overrides: Optional[Sequence[Any]]) -> RlstreamConfig:
    """Load the config or print every problem (stderr) and exit with code 2."""
    try:
        cfg = load_config(config, pairs(overrides))
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(code=2) from None
    ctx = get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[CONFIG_META] = cfg  # an error's answer names the address that could not be reached
    from rlstream.transport.metrics import set_default_prometheus_addr

    set_default_prometheus_addr(cfg.metrics_host)  # every Prometheus endpoint of this process binds there
    return cfg


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
