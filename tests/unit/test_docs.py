"""The documents describe the product: no development narration, no dangling paths, a current config reference."""
from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from rlstream.schemas.config_reference import field_docs, render_markdown

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "bench").rglob("*.md"),
                    ROOT / "rlstream" / "ops" / "RUNBOOK.md"])
SOURCES = sorted([*(ROOT / "rlstream").rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "tests").rglob("*.py")])

ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|earlier|previous|last"
#: phrases that tell the story of the project's making instead of describing the product
NARRATION = [
    re.compile(rf"\b(?:{ORDINALS})\s+session(?:'s)?\s+(?:run|work|figures|code|main|fresh clone|measurement)", re.I),
    re.compile(rf"\bthe\s+(?:{ORDINALS})\s+session\b", re.I),
    re.compile(r"\b(?:until|since|in|during|of)\s+this\s+session\b", re.I),
    re.compile(r"\blent\s+to\s+this\s+task\b", re.I),
    re.compile(r"\bas\s+the\s+issue\s+asks\b", re.I),
    re.compile(r"\bthe\s+issue'?s\s+bar\b", re.I),
    re.compile(r"\bthis\s+task's\s+(?:run|work|session)\b", re.I),
]

#: a repository path as documents and docstrings name them
PATH_PATTERN = re.compile(r"(?<![\w./~$-])((?:rlstream|tests|bench|docs|scripts|\.ci)/[\w./*-]*[\w*])")
MODULE_PATTERN = re.compile(r"(?<![\w./-])(rlstream(?:\.[a-z_][a-z0-9_]*)+)")


def _narration_hits(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for pattern in NARRATION for m in pattern.finditer(text)]


def test_narration_phrases_are_caught() -> None:
    """The phrase list catches the narration it is meant to (negative control for the scans below)."""
    samples = ["the sixth session's run reached", "Until this session the task", "no GPU machine was lent to this task",
               "at half the maximum rate as the issue asks", "The issue's bar: a constant answer"]
    for sample in samples:
        assert any(p.search(sample) for p in NARRATION), sample
    for fine in ["a session's calls join one trajectory", "the test session's broker", "session id", "this task's "
                 "baseline key"]:
        assert not any(p.search(fine) for p in NARRATION), fine


def test_no_development_narration_in_documents_or_code() -> None:
    hits = [hit for path in [*DOCUMENTS, *SOURCES] if path != Path(__file__) for hit in _narration_hits(path)]
    assert not hits, "\n".join(hits)


def _path_exists(candidate: str) -> bool:
    candidate = candidate.split("::", 1)[0].rstrip(".")
    if any(ch in candidate for ch in "<>{}"):
        return True
    if "*" in candidate:
        return any(ROOT.glob(candidate))
    return (ROOT / candidate).exists()


#: dotted names in documents that are not modules: file names and the Avro namespace
NOT_MODULES = re.compile(r"\.(?:ya?ml|json|md|toml|py)$|^rlstream\.v\d+$")


_MISSING = object()


def _module_exists(dotted: str) -> bool:
    if NOT_MODULES.search(dotted):
        return True
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix; the rest must be attributes
        name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if cut == len(parts):
            return True
        module = importlib.import_module(name)
        obj: object = module
        for attr in parts[cut:]:
            found = inspect.getattr_static(obj, attr, _MISSING)
            if found is _MISSING:  # a lazy attribute (module __getattr__), which may need run-time settings
                try:
                    found = getattr(obj, attr)
                except AttributeError:
                    return False
                except Exception:  # noqa: BLE001 - it exists; building it needs configuration
                    return True
            obj = found
        return True
    return False


def _named_paths(path: Path) -> set[str]:
    return set(PATH_PATTERN.findall(path.read_text(encoding="utf-8")))


def test_every_repository_path_named_in_documents_and_docstrings_exists() -> None:
    missing = [f"{path.relative_to(ROOT)}: {named}" for path in [*DOCUMENTS, *(ROOT / "rlstream").rglob("*.py")]
               for named in sorted(_named_paths(path)) if not _path_exists(named)]
    assert not missing, "\n".join(missing)


def test_every_module_named_in_documents_exists() -> None:
    missing = [f"{path.relative_to(ROOT)}: {dotted}" for path in DOCUMENTS
               for dotted in sorted(set(MODULE_PATTERN.findall(path.read_text(encoding="utf-8"))))
               if not _module_exists(dotted)]
    assert not missing, "\n".join(missing)


def test_the_path_check_sees_a_dangling_path() -> None:
    assert not _path_exists("rlstream/no_such_module.py") and not _path_exists("tests/e2e/test_no_such_*.py")
    assert not _module_exists("rlstream.no_such_module")
    assert _path_exists("rlstream/streams/app.py") and _module_exists("rlstream.streams.app")


def test_configuration_reference_is_current() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render_markdown(), (
        "docs/configuration.md is out of date: python -m rlstream.schemas.config_reference > docs/configuration.md")


def test_every_configuration_key_is_described() -> None:
    undescribed = [doc.key for doc in field_docs() if not doc.description]
    assert not undescribed, f"config keys without a description: {undescribed}"
