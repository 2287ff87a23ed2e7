"""The configuration reference (``docs/configuration.md``), generated from the pydantic model's descriptions.

``python -m rlstream.schemas.config_reference > docs/configuration.md`` rewrites it; a unit test checks that the
file in the repository is what this module renders, so a new or changed field shows up in the docs.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlstream.schemas.config import RlstreamConfig

HEADER = """# Configuration reference

One pydantic model (`rlstream/schemas/config.py`), loaded from YAML. Precedence, lowest first: defaults < YAML file <
environment (`RLSTREAM_<SECTION>__<KEY>`, e.g. `RLSTREAM_LEARNER__LEARNING_RATE=1e-5`) < `-o dotted.key value`
overrides (repeatable, values read as YAML scalars). `RLSTREAM_KAFKA_BOOTSTRAP` and `RLSTREAM_REDIS_URL` point
everything at external services. `rlstream config validate -c FILE` lists every problem with its dotted key and where
the value came from; `rlstream config show -c FILE -o k v` prints the effective config with secrets masked.

Secrets (passwords, API keys, credentials inside URLs) are masked in `config show`, `status`, every log line and every
config file a run writes; `rlstream up` and `rlstream finetune` hand the real values to their children through
`RLSTREAM_*` environment variables, never through files.

This file is generated: `python -m rlstream.schemas.config_reference > docs/configuration.md`.
"""


@dataclass(frozen=True)
class FieldDoc:
    """One configuration key as the reference shows it."""

    key: str
    default: str
    description: str


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        try:
            value: Any = info.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, PurePath):
        value = str(value)
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _is_section(info: FieldInfo) -> type[BaseModel] | None:
    annotation = info.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def field_docs(model: type[BaseModel] = RlstreamConfig, prefix: str = "") -> list[FieldDoc]:
    """Every leaf key of ``model`` with its default and description, sections flattened to dotted keys."""
    docs: list[FieldDoc] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _is_section(info)
        if section is not None:
            docs.extend(field_docs(section, prefix=f"{key}."))
            continue
        description = " ".join((info.description or "").split())
        docs.append(FieldDoc(key=key, default=_default_text(info), description=description))
    return docs


def render_markdown() -> str:
    """The whole reference, one table per top-level section."""
    lines = [HEADER]
    current_section: str | None = None
    for doc in field_docs():
        section = doc.key.split(".", 1)[0] if "." in doc.key else "top level"
        if section != current_section:
            current_section = section
            lines += ["", f"## `{section}`" if section != "top level" else "## Top level", "",
                      "| key | default | description |", "|---|---|---|"]
        default = doc.default.replace("|", "\\|")
        description = doc.description.replace("|", "\\|")
        lines.append(f"| `{doc.key}` | `{default}` | {description} |" if default else
                     f"| `{doc.key}` | | {description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - a documentation command
    sys.stdout.write(render_markdown())
