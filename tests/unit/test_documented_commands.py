"""Every ``rlstream ...`` command line of the README and docs/ parses against the CLI (command path, options, their
values), without running it: a renamed option or command fails here, not in a reader's shell."""
from __future__ import annotations

import functools
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperGroup
from typer.main import get_command

from rlstream.cli.app import app

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(?<!`)`(rlstream [^`]+)`(?!`)")
PROMPT = re.compile(r"^\s*(?:\$\s+)?(rlstream\s.*)$")
#: a synopsis placeholder (``F``, ``VERSION``, ``URL``): any value stands for it; "1" is a valid text, path or number
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
#: where a shell line stops being rlstream's arguments
SHELL_ENDS = {"|", "||", "&&", "&", ";", ">", ">>", "2>", "2>&1"}


@dataclass(frozen=True)
class DocLine:
    """One documented command line: where it is, its text, and whether it is a full command (a code block) or a
    mention in prose (inline code, where required options may be left out)."""

    where: str
    text: str
    complete: bool


def documented_lines(path: Path) -> list[DocLine]:
    """The ``rlstream ...`` lines of code blocks and inline code spans of a Markdown file."""
    out: list[DocLine] = []
    in_block = False
    pending = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        where = f"{path.relative_to(ROOT)}:{number}"
        if FENCE.match(line):
            in_block, pending = not in_block, ""
            continue
        if in_block:
            text = pending + line.strip() if pending else line
            match = PROMPT.match(text)
            if pending or match:
                command = (match.group(1) if match else text).rstrip()
                if command.endswith("\\"):
                    pending = command[:-1] + " "
                    continue
                pending = ""
                out.append(DocLine(where, command, complete=True))
            continue
        for span in INLINE.finditer(line):
            out.append(DocLine(where, span.group(1), complete=False))
    return out


def arguments(text: str) -> list[str]:
    """The arguments after ``rlstream``, with synopsis notation resolved: ``[--opt X]`` -> ``--opt X``,
    ``a|b`` -> ``a``, ``...`` dropped, placeholders -> ``1``; a comment or a shell operator ends them."""
    return resolved(text)[0]


def resolved(text: str) -> tuple[list[str], set[str]]:
    """:func:`arguments`, and the options (``""`` for a positional) given a placeholder."""
    tokens = shlex.split(text.replace("\\|", "|"), comments=True)[1:]
    out: list[str] = []
    placeheld: set[str] = set()
    for token in tokens:
        if token in SHELL_ENDS or token.startswith((">", "2>")):
            break
        token = token.strip("[]")
        if not token or token == "...":
            continue
        if token.startswith("--") and "/--" in token:  # --a/--b: either option
            token = token.split("/")[0]
        elif "|" in token:
            token = token.split("|")[0]
        if PLACEHOLDER.match(token):
            placeheld.add(out[-1] if out and out[-1].startswith("-") else "")
            token = "1"
        out.append(token)
    return out, placeheld


@functools.cache
def root_command() -> Any:
    """The click command tree of ``rlstream`` (typer builds it anew on every call)."""
    return get_command(app)


def parse(args: list[str]) -> None:
    """Resolve the command path of ``args`` and parse its options and arguments, running nothing."""
    command = root_command()
    name, parent = "rlstream", None
    while True:
        ctx = command.make_context(name, list(args), parent=parent)
        if not isinstance(command, TyperGroup):
            return
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            return
        name, command, args = command.resolve_command(ctx, rest)
        parent = ctx


def check(line: DocLine) -> str | None:
    """None when the line parses, else why not."""
    from typer._click.exceptions import BadParameter, MissingParameter, NoArgsIsHelpError

    args, placeheld = resolved(line.text)
    try:
        parse(args)
    except typer.Exit:  # --help, --version
        return None
    except Exception as exc:  # noqa: BLE001 - every parse error is the finding
        if not line.complete and isinstance(exc, (MissingParameter, NoArgsIsHelpError)):
            return None  # prose names a command without all it needs
        param = getattr(exc, "param", None)
        if isinstance(exc, BadParameter) and param is not None and not isinstance(exc, MissingParameter) \
                and (set(param.opts) & placeheld or (param.param_type_name == "argument" and "" in placeheld)):
            return None  # a placeholder (N, DIR) stands for a value the reader supplies
        if isinstance(exc, BadParameter) and param is not None and param.type_descriptor.is_path \
                and exc.message.endswith("does not exist."):
            return None  # a documented file need not exist where the suite runs
        return f"{line.where}: `{line.text}`: {type(exc).__name__}: {getattr(exc, 'message', exc)}"
    return None


ALL_LINES = [line for path in DOCUMENTS for line in documented_lines(path)]


def test_the_documents_show_rlstream_command_lines() -> None:
    assert len(ALL_LINES) > 50
    assert any(line.complete for line in ALL_LINES) and any(not line.complete for line in ALL_LINES)


def test_every_documented_command_line_parses() -> None:
    problems = [problem for line in ALL_LINES if (problem := check(line))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text", ["rlstream tail metrics --no-such-option", "rlstream nosuch command",
                                  "rlstream up --model huge", "rlstream export --from", "rlstream status --versions x"])
def test_a_line_that_does_not_parse_is_found(text: str) -> None:
    """Negative control: an unknown option, command or choice, a missing value or a bad number fails the check."""
    assert check(DocLine("doc.md:1", text, complete=True)) is not None


def test_a_complete_line_must_give_what_the_command_requires() -> None:
    assert check(DocLine("doc.md:1", "rlstream lineage", complete=True)) is not None
    assert check(DocLine("doc.md:1", "rlstream lineage", complete=False)) is None


def test_synopsis_notation_is_resolved() -> None:
    assert arguments("rlstream tail metrics\\|groups [--run R] [--format table|json] | jq .") == [
        "tail", "metrics", "--run", "1", "--format", "table"]
    assert arguments("rlstream infra up --kafka-port/--redis-port P  # ports") == ["infra", "up", "--kafka-port", "1"]


# --- every documented `rlstream up` line, run with --dry-run ---------------------------------------------------
def up_lines() -> dict[str, tuple[list[str], set[str]]]:
    """The distinct documented ``rlstream up`` lines (by their resolved arguments), each with its arguments and
    the options given a placeholder; ``--help`` lines only parse."""
    out: dict[str, tuple[list[str], set[str]]] = {}
    for line in ALL_LINES:
        args, placeheld = resolved(line.text)
        if args[:1] == ["up"] and "--help" not in args:
            out.setdefault(shlex.join(args), (args, placeheld))
    return out


UP_LINES = up_lines()


@pytest.fixture(scope="module")
def documented_up(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Run a documented ``rlstream up`` line with ``--dry-run`` in a directory holding what the reader supplies (a
    local model for ``--model DIR``, ``my.yaml`` naming it for ``--config my.yaml``); the runs share one runs
    directory. Returns the CLI's result."""
    import json

    from typer.testing import CliRunner

    home = tmp_path_factory.mktemp("reader")
    model = home / "model"  # a local Qwen2-family directory: config and tokenizer, no weights (nothing loads them)
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"<|im_start|>": 0, "a": 1}},
                                                      "added_tokens": []}))
    (home / "my.yaml").write_text(f"learner:\n  model: {model}\nrollout:\n  dataset: {home / 'train.jsonl'}\n")
    supplied = {"--model": str(model), "--tool-call-parser": "hermes"}

    def run(args: list[str], placeheld: set[str]) -> Any:
        args = [supplied[args[i - 1]] if i and args[i - 1] in placeheld else arg for i, arg in enumerate(args)]
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(home)
            return CliRunner().invoke(app, [*args, *([] if "--dry-run" in args else ["--dry-run"]),
                                            "--runs-dir", str(home / "runs")])
    return run


def test_the_documents_show_up_lines_of_every_model_and_task() -> None:
    joined = " ".join(UP_LINES)
    assert len(UP_LINES) >= 8
    assert "--model smollm2" in joined and "--task tool-agent" in joined and "--traffic production" in joined


@pytest.mark.parametrize("text", sorted(UP_LINES))
def test_every_documented_up_line_passes_its_dry_run(text: str, documented_up: Any) -> None:
    """The dry run resolves every process's config and checks the tool-call parser against the model's tokenizer
    (a toy model not built yet: the tokenizer it will have), starting nothing."""
    started = time.monotonic()
    result = documented_up(*UP_LINES[text])
    assert result.exit_code == 0, f"`rlstream {text} --dry-run`:\n{result.output}"
    assert "nothing started" in result.output and "Traceback" not in result.output
    assert re.search(r"command: vllm serve \S+ .*--tool-call-parser \w+", result.output) or \
        "--tool-call-parser none" in text
    assert time.monotonic() - started < 60  # seconds on an idle machine: no model is built, nothing starts


@pytest.mark.parametrize("args,parser", [
    (["up", "--model", "smollm2", "--tool-call-parser", "llama3_json"], "'llama3_json'"),  # SmolLM2 lacks its token
    (["up", "--tool-call-parser", "mistral"], "'mistral'"),  # the tiny model's tokenizer has no [TOOL_CALLS]
    (["up", "--tool-call-parser", "hermess"], "'hermess'"),  # vLLM has no such parser
])
def test_a_parser_vllm_would_refuse_fails_the_dry_run(args: list[str], parser: str, documented_up: Any) -> None:
    """Negative control: the same run with a parser vLLM refuses for this model ends the dry run with one line
    naming the parser and --tool-call-parser (a usage error: code 2)."""
    result = documented_up(args, set())
    assert result.exit_code == 2, result.output
    assert parser in result.output and "--tool-call-parser" in result.output and "Traceback" not in result.output
    assert "nothing started" not in result.output
