"""Every ``rlstream ...`` command line of the README and docs/ parses against the CLI (command path, options, their
values), without running it: a renamed option or command fails here, not in a reader's shell."""
from __future__ import annotations

import functools
import re
import shlex
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
