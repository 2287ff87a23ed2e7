"""A record's state changes, held back until they are known to fit: applied whole, or not at all.

Each table write becomes one changelog record, and a changelog record over the broker's size limit fails the
partition's transaction (and, retried, every later one). :class:`StagedWrites` collects the writes of one
input record; :func:`oversized_writes` measures what each would put on the changelog; the app applies them
only when every one fits, else the input record goes to the dead letters and the tables stay as they were
(the same holds when processing raises half-way).
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

from faust.utils import json as faust_json  # the serializer of Faust's "json" codec (orjson when installed)

_DELETED: Any = object()


class StagedWrites(MutableMapping[str, Any]):
    """A view of ``base`` whose writes and deletes stay here until :meth:`apply`."""

    def __init__(self, base: MutableMapping[str, Any]) -> None:
        self.base = base
        self.changes: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key in self.changes:
            value = self.changes[key]
            if value is _DELETED:
                raise KeyError(key)
            return value
        return self.base[key]

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: str, value: Any) -> None:
        self.changes[key] = value

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self.changes[key] = _DELETED

    def __contains__(self, key: object) -> bool:
        if key in self.changes:
            return self.changes[key] is not _DELETED  # type: ignore[index]
        return key in self.base

    def __iter__(self) -> Iterator[str]:
        for key in list(self.base):
            if key not in self.changes:
                yield key
        for key, value in list(self.changes.items()):
            if value is not _DELETED:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def written(self) -> Iterator[tuple[str, Any]]:
        """(key, value) of every staged write (deletes excluded)."""
        return ((k, v) for k, v in self.changes.items() if v is not _DELETED)

    def apply(self) -> None:
        """Hand every staged write and delete to ``base``, in the order they were made."""
        for key, value in self.changes.items():
            if value is _DELETED:
                if key in self.base:
                    del self.base[key]
            else:
                self.base[key] = value
        self.changes.clear()


def changelog_json(value: Any) -> bytes:
    """``value`` as a JSON changelog key or value: what Faust's json serializer writes."""
    data = faust_json.dumps(value)
    return data if isinstance(data, bytes) else data.encode("utf-8")


def changelog_copy(value: Any) -> Any:
    """A private copy of a JSON table value, equal to what a table recovered from its changelog would hold."""
    return faust_json.loads(changelog_json(value))


def json_size(value: Any) -> int:
    """Bytes of ``value`` as a JSON changelog key or value."""
    return len(changelog_json(value))


def oversized_writes(staged: StagedWrites, limit: int) -> list[tuple[str, int]]:
    """(key, size) of every staged write whose changelog record (key + value, JSON) would be over ``limit`` bytes."""
    out: list[tuple[str, int]] = []
    for key, value in staged.written():
        size = json_size(key) + json_size(value)
        if size > limit:
            out.append((key, size))
    return out
