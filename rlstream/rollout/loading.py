"""Loading user code (``module:function``) and datasets (JSON list or JSONL) for the rollout runner."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable


class UserCodeError(ValueError):
    """A ``module:function`` reference that cannot be imported or is not callable."""


class DatasetError(ValueError):
    """A dataset file that cannot be read; the message names the file and line."""


def load_callable(ref: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (the current directory is importable)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UserCodeError(f"{ref!r} is not of the form module:function")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserCodeError(f"cannot import module {module_name!r} of {ref!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UserCodeError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise UserCodeError(f"{ref!r} is not callable")
    return target


def load_examples(path: Path, id_field: str = "id") -> list[dict[str, Any]]:
    """Examples from a JSON file (a list of objects) or JSONL (one object per line).

    Each example gets a string ``id`` (from ``id_field``, else its position). A bad line is an error
    naming the file and line: a dataset is input the user controls, so it is fixed, not skipped.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read dataset: {exc.strerror or exc}") from exc
    rows: list[Any]
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from exc
        numbered = list(enumerate(rows, start=1))
    else:
        numbered = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                numbered.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from exc
    examples = []
    seen: set[str] = set()
    for position, (where, row) in enumerate(numbered):
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{where}: an example must be a JSON object, got {type(row).__name__}")
        example = dict(row)
        example_id = str(example.get(id_field, position))
        if example_id in seen:
            raise DatasetError(f"{path}:{where}: duplicate example id {example_id!r}")
        seen.add(example_id)
        example["id"] = example_id
        examples.append(example)
    if not examples:
        raise DatasetError(f"{path}: the dataset has no examples")
    return examples
