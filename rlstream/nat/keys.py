"""The keys of rlstream's three NAT blocks, as NAT users write them.

Each block accepts its own keys, the OpenPipe ART plugin's keys and the generic keys of NAT's "extending
finetuning" guide. A key rlstream gives a meaning is mapped to it (``backend.base_model`` is the model trained); a
key that means nothing here (ART's training server ``ip``/``port``/``api_key``) is accepted with one warning that
says what rlstream uses instead; any other key is an error naming its whole path with a "did you mean".
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from rlstream.transport.log import get_logger

log = get_logger(__name__)

_SERVER = ("rlstream trains in the nat process itself and reaches vLLM at the target LLM's base_url "
           "(or backend.inference_url); a shared broker and Redis are backend.bootstrap_servers / backend.redis_url")
#: keys accepted without a meaning in rlstream: the reason shown in their warning
UNUSED_KEYS: dict[str, str] = {
    "backend.ip": "ART's training server address; " + _SERVER,
    "backend.port": "ART's training server port; " + _SERVER,
    "backend.api_key": "the training server's key; rlstream has no training server (vLLM's key is the "
                       "rlstream setting inference.api_key, backend.settings)",
    "backend.endpoint": "a training server's URL; " + _SERVER,
    "backend.delete_old_checkpoints": "rlstream keeps every version under finetuning.output_dir/versions and "
                                      "vLLM keeps inference.max_loaded_adapters of them",
    "backend.init_args": "ART's model arguments; rlstream reads the model's own config (learner.* settings)",
    "backend.engine_args": "ART's vLLM engine arguments; rlstream uses the vLLM server the workflow calls (start "
                           "one with `rlstream inference serve MODEL_DIR`)",
}
#: keys whose ``False`` asks for something rlstream does not do: the reason shown in their warning
ALWAYS_ON_KEYS: dict[str, str] = {
    "validate_trajectories": "rlstream always checks every trajectory (a bad one is dead-lettered with its reason)",
    "include_tool_calls": "rlstream always trains tool calls as tool calls",
}
_warned: set[str] = set()


@dataclass(frozen=True)
class UnknownKey:
    path: str
    suggestions: tuple[str, ...]

    def text(self) -> str:
        hint = f" (did you mean {' or '.join(repr(s) for s in self.suggestions)}?)" if self.suggestions else ""
        return f"unknown key {self.path!r}{hint}"


def warn_once(path: str, reason: str) -> None:
    """One warning per key and process (NAT validates a config several times)."""
    if path in _warned:
        return
    _warned.add(path)
    log.warning("key has no meaning in rlstream; ignored", key=path, reason=reason)


def unknown_keys(data: Mapping[str, Any], allowed: Iterable[str], path: str = "") -> list[UnknownKey]:
    """The keys of ``data`` not in ``allowed`` (nor ``_type``), each with its full path and close matches."""
    known = sorted(set(allowed))
    found = []
    for key in data:
        if key == "_type" or key in known:
            continue
        suggestions = tuple(difflib.get_close_matches(str(key), known, n=2, cutoff=0.6))
        found.append(UnknownKey(f"{path}{key}", suggestions))
    return found


def check_block(data: Any, allowed: Iterable[str], block: str, nested: Mapping[str, Iterable[str]] = {}) -> Any:
    """Validate the keys of one block (``data`` as written): warn about the unused ones and drop them, raise
    ``ValueError`` naming every unknown one (``block`` is the path shown, e.g. ``trainer_adapters``)."""
    if not isinstance(data, Mapping):
        return data
    cleaned = dict(data)
    problems: list[UnknownKey] = []
    for key, value in data.items():
        if key in ALWAYS_ON_KEYS and value is False:
            warn_once(key, ALWAYS_ON_KEYS[key])
    problems += unknown_keys(data, allowed)
    for section, section_allowed in nested.items():
        value = data.get(section)
        if isinstance(value, Mapping):
            unused = {k for k in value if f"{section}.{k}" in UNUSED_KEYS}
            for key in sorted(unused):
                warn_once(f"{section}.{key}", UNUSED_KEYS[f"{section}.{key}"])
            problems += unknown_keys({k: v for k, v in value.items() if k not in unused}, section_allowed,
                                     f"{section}.")
            cleaned[section] = {k: v for k, v in value.items() if k not in unused}
    if problems:
        where = f" in {block}" if block else ""
        raise ValueError("; ".join(p.text() for p in problems) + where)
    return cleaned
