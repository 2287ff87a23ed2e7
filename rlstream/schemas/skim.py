"""Reading an Avro body without building its arrays of numbers (counting them instead).

Why: a trajectory carries about 10,000 token ids and log-probabilities (8 turns x (256 prompt + 512 completion
tokens + 512 logprobs) in ``bench/streams_throughput.py``); fastavro builds a Python object for each, reading its
input a byte at a time (about 200 ns per item: 2 ms of a 44 KiB record), while the streams app needs only how many
there are (``streams.validation`` compares the counts) and keeps the record's bytes as they came. This reader walks the
same binary encoding (Avro 1.11 specification, "Binary Encoding") and, for every array whose items are ``int``,
``long``, ``float`` or ``double``, returns :class:`SkippedNumbers` with the item count: ``float``/``double`` items have
a fixed size and are stepped over at once; ``int``/``long`` varints are delimited by counting the bytes without the
continuation bit with ``bytes.translate``/``bytes.count`` (C loops of the standard library: no numpy, so the core,
SDK-only install reads them the same way). Everything else is decoded as fastavro decodes it (logical types through fastavro's
public ``LOGICAL_READERS``), so the result equals ``fastavro.schemaless_reader``'s with each numeric array replaced
by its count (``tests/unit/test_skim.py`` checks that, and that whatever this reader accepts fastavro accepts too).

It is stricter than fastavro where the specification is: a boolean byte other than 0/1, an ``int`` varint over 5
bytes or a ``long`` one over 10, a negative length, an out-of-range union or enum index, invalid UTF-8, or data past
the end all raise :class:`SkimError`. Only a writer schema read as itself is skimmed (no schema resolution).
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fastavro.read import LOGICAL_READERS

#: a reader of one value: (buffer, position) -> (value, position after it)
Reader = Callable[[bytes, int], tuple[Any, int]]

_VARINT_MAX_BYTES = {"int": 5, "long": 10}
_FIXED_SIZE = {"float": 4, "double": 8}
_SCAN_FROM = 16  # fewer varints than this are delimited one at a time (the scan's per-call cost is higher)
#: ``bytes.translate`` table: 1 for a byte with the continuation bit (a varint goes on), 0 for a varint's last byte
_CONTINUES = bytes(b >> 7 for b in range(256))
_DOUBLE = struct.Struct("<d")
_FLOAT = struct.Struct("<f")


class SkimError(ValueError):
    """The bytes are not a valid encoding of the schema."""


@dataclass(frozen=True, slots=True)
class SkippedNumbers:
    """An array of ``int``/``long``/``float``/``double`` that was stepped over: its item count."""

    count: int


def read_long(buf: bytes, pos: int, max_bytes: int = 10) -> tuple[int, int]:
    """A zigzag varint (Avro ``int``/``long``) at ``pos``; raises :class:`SkimError` past ``max_bytes`` bytes."""
    end = len(buf)
    if pos >= end:
        raise SkimError("data ends inside a number")
    byte = buf[pos]
    pos += 1
    if byte < 0x80:  # one byte: most lengths, counts and union indexes
        return (byte >> 1) ^ -(byte & 1), pos
    value, shift = byte & 0x7F, 7
    while byte & 0x80:
        if pos >= end:
            raise SkimError("data ends inside a number")
        if shift >= 7 * max_bytes:
            raise SkimError(f"varint longer than {max_bytes} bytes")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
    return (value >> 1) ^ -(value & 1), pos


def _length(buf: bytes, pos: int) -> tuple[int, int]:
    size, pos = read_long(buf, pos)
    if size < 0:
        raise SkimError(f"negative length {size}")
    if pos + size > len(buf):
        raise SkimError(f"a length of {size} bytes runs past the end of the data")
    return size, pos


def _read_null(buf: bytes, pos: int) -> tuple[None, int]:
    return None, pos


def _read_boolean(buf: bytes, pos: int) -> tuple[bool, int]:
    if pos >= len(buf):
        raise SkimError("data ends inside a boolean")
    byte = buf[pos]
    if byte > 1:
        raise SkimError(f"boolean byte {byte} is neither 0 nor 1")
    return byte == 1, pos + 1


def _read_int(buf: bytes, pos: int) -> tuple[int, int]:
    return read_long(buf, pos, 5)


def _read_long(buf: bytes, pos: int) -> tuple[int, int]:
    return read_long(buf, pos, 10)


def _struct_reader(layout: struct.Struct) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[float, int]:
        end = pos + layout.size
        if end > len(buf):
            raise SkimError("data ends inside a floating-point number")
        return layout.unpack_from(buf, pos)[0], end
    return read


def _read_bytes(buf: bytes, pos: int) -> tuple[bytes, int]:
    size, pos = _length(buf, pos)
    return buf[pos:pos + size], pos + size


def _read_string(buf: bytes, pos: int) -> tuple[str, int]:
    byte = buf[pos] if pos < len(buf) else 0x80
    if byte < 0x80 and not byte & 1 and pos + 1 + (byte >> 1) <= len(buf):  # a short string (one-byte length)
        size, pos = byte >> 1, pos + 1
    else:
        size, pos = _length(buf, pos)
    try:
        return buf[pos:pos + size].decode("utf-8"), pos + size
    except UnicodeDecodeError as exc:
        raise SkimError(f"string is not UTF-8: {exc}") from None


_PRIMITIVES: dict[str, Reader] = {
    "null": _read_null, "boolean": _read_boolean, "int": _read_int, "long": _read_long,
    "float": _struct_reader(_FLOAT), "double": _struct_reader(_DOUBLE), "bytes": _read_bytes, "string": _read_string}


def _block_count(buf: bytes, pos: int) -> tuple[int, int]:
    """The item count of the next array/map block (a negative count is followed by the block's byte size)."""
    count, pos = read_long(buf, pos)
    if count < 0:
        count = -count
        _, pos = read_long(buf, pos)
    if count > len(buf) - pos:  # every item but null takes a byte: a larger count is garbage, not a long loop
        raise SkimError(f"a block of {count} items cannot fit in the {len(buf) - pos} bytes left")
    return count, pos


def _has_run(marks: bytes, end: int, length: int) -> bool:
    """Whether ``marks[:end]`` (bytes of 0 and 1) holds ``length`` 1s in a row: the marks as one integer, ANDed with
    itself shifted by whole bytes (runs of 1, 2, 4, ... combined into ``length``), is non-zero only then."""
    ones = int.from_bytes(marks[:end], "little")
    result, have, power, span = -1, 0, ones, 1  # power: where runs of `span` start; result: runs of `have`
    while True:
        if length & 1:
            result &= power >> (8 * have)
            have += span
            if not result:
                return False
        length >>= 1
        if not length:
            return True
        power &= power >> (8 * span)
        span *= 2
        if not power:  # no run of `span` (at most the length asked for): token ids of one or two bytes stop here
            return False


def _skip_varints(buf: bytes, pos: int, count: int, max_bytes: int) -> int:
    """The position after ``count`` varints starting at ``pos``."""
    if count < _SCAN_FROM:
        for _ in range(count):
            _, pos = read_long(buf, pos, max_bytes)
        return pos
    # 0 marks the last byte of a varint, so the span ends at the count-th 0. Every varint takes a byte: the span is
    # at least count bytes and, with `found` ends seen in `end` bytes, at least count - found bytes longer. Token ids
    # take one or two bytes, so twice the count is marked first, the longest possible span only when that is short.
    marks = buf[pos:pos + 2 * count + max_bytes].translate(_CONTINUES)
    end = min(count, len(marks))
    found = marks.count(0, 0, end)
    while found < count:
        step = end + count - found
        if step > len(marks):
            marks = buf[pos:pos + count * max_bytes].translate(_CONTINUES)
            if end >= len(marks):
                raise SkimError(f"data ends inside an array of {count} numbers")
            step = min(step, len(marks))
        found += marks.count(0, end, step)
        end = step
    # a varint over max_bytes is a run of max_bytes continuation bytes, possible only with that many in the span
    if end - count >= max_bytes and _has_run(marks, end, max_bytes):
        raise SkimError(f"varint longer than {max_bytes} bytes in an array of numbers")
    return pos + end


def _numbers_skipper(item_type: str) -> Reader:
    size, max_bytes = _FIXED_SIZE.get(item_type), _VARINT_MAX_BYTES.get(item_type)

    def skip(buf: bytes, pos: int) -> tuple[SkippedNumbers, int]:
        total = 0
        while True:
            count, pos = _block_count(buf, pos)
            if count == 0:
                return SkippedNumbers(total), pos
            total += count
            if size is not None:
                pos += count * size
                if pos > len(buf):
                    raise SkimError(f"data ends inside an array of {count} numbers")
            else:
                assert max_bytes is not None
                pos = _skip_varints(buf, pos, count, max_bytes)
    return skip


def _array_reader(items: Reader) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[list[Any], int]:
        out: list[Any] = []
        while True:
            count, pos = _block_count(buf, pos)
            if count == 0:
                return out, pos
            for _ in range(count):
                item, pos = items(buf, pos)
                out.append(item)
    return read


def _map_reader(values: Reader) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        while True:
            count, pos = _block_count(buf, pos)
            if count == 0:
                return out, pos
            for _ in range(count):
                key, pos = _read_string(buf, pos)
                out[key], pos = values(buf, pos)
    return read


def _read_index(buf: bytes, pos: int, size: int, what: str) -> tuple[int, int]:
    """A union branch or enum symbol index, checked against the ``size`` there are."""
    index, pos = read_long(buf, pos)
    if not 0 <= index < size:
        raise SkimError(f"{what} index {index} out of range (there are {size})")
    return index, pos


def _union_reader(branches: list[Reader]) -> Reader:
    size = len(branches)

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        byte = buf[pos] if pos < len(buf) else 0x80  # past the end: read_index says so
        if byte < 2 * size and not byte & 1:  # a one-byte index in range (zigzag: branch i is byte 2i)
            branch = branches[byte >> 1]
            return (None, pos + 1) if branch is _read_null else branch(buf, pos + 1)
        index, pos = _read_index(buf, pos, size, "union branch")
        return branches[index](buf, pos)
    return read


def _enum_reader(symbols: list[str]) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[str, int]:
        index, pos = _read_index(buf, pos, len(symbols), "enum symbol")
        return symbols[index], pos
    return read


def _fixed_reader(size: int) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[bytes, int]:
        if pos + size > len(buf):
            raise SkimError("data ends inside a fixed")
        return buf[pos:pos + size], pos + size
    return read


def _record_reader(fields: list[tuple[str, Reader]]) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        for name, field_reader in fields:
            out[name], pos = field_reader(buf, pos)
        return out, pos
    return read


def _logical(base: Reader, convert: Callable[..., Any], schema: dict[str, Any]) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        value, pos = base(buf, pos)
        return convert(value, schema, schema), pos
    return read


class _Compiler:
    """Turns a (fully expanded) Avro schema into a :data:`Reader`; named types are compiled once."""

    def __init__(self) -> None:
        self.named: dict[str, Reader] = {}

    def reader(self, node: Any, namespace: str | None) -> Reader:
        if isinstance(node, str):
            if node in _PRIMITIVES:
                return _PRIMITIVES[node]
            full = node if "." in node or not namespace else f"{namespace}.{node}"
            try:
                return self.named[full]
            except KeyError:
                raise SkimError(f"schema refers to an undefined type {node!r}") from None
        if isinstance(node, list):
            return _union_reader([self.reader(branch, namespace) for branch in node])
        kind = node["type"]
        if isinstance(kind, (dict, list)):
            return self.reader(kind, namespace)
        base = self._complex(node, kind, namespace)
        logical = node.get("logicalType")
        convert = LOGICAL_READERS.get(f"{kind}-{logical}") if logical else None
        return _logical(base, convert, node) if convert is not None else base

    def _complex(self, node: dict[str, Any], kind: str, namespace: str | None) -> Reader:
        if kind in ("record", "error", "enum", "fixed"):
            name = node["name"]
            namespace = node.get("namespace", namespace) if "." not in name else name.rsplit(".", 1)[0]
            full = name if "." in name else (f"{namespace}.{name}" if namespace else name)
            if kind == "enum":
                reader = self.named[full] = _enum_reader(list(node["symbols"]))
                return reader
            if kind == "fixed":
                reader = self.named[full] = _fixed_reader(int(node["size"]))
                return reader
            fields: list[tuple[str, Reader]] = []
            record = _record_reader(fields)
            self.named[full] = record  # before its fields: a field may refer to the record itself
            fields.extend((f["name"], self.reader(f["type"], namespace)) for f in node["fields"])
            return record
        if kind == "array":
            items = node["items"]
            if isinstance(items, str) and items in _VARINT_MAX_BYTES.keys() | _FIXED_SIZE.keys():
                return _numbers_skipper(items)
            return _array_reader(self.reader(items, namespace))
        if kind == "map":
            return _map_reader(self.reader(node["values"], namespace))
        if kind in _PRIMITIVES:
            return _PRIMITIVES[kind]
        raise SkimError(f"unknown Avro type {kind!r}")


@lru_cache(maxsize=64)
def skimmer(schema_json: str) -> Reader:
    """The reader of bodies written with this schema (JSON text; compiled once per process)."""
    return _Compiler().reader(json.loads(schema_json), None)


def skim(schema_json: str, body: bytes, pos: int = 0) -> tuple[Any, int]:
    """Read one value of ``schema_json`` from ``body`` at ``pos``, arrays of numbers counted, not built; returns the
    value and the position after it. Raises :class:`SkimError` on data that is not a valid encoding."""
    try:
        return skimmer(schema_json)(body, pos)
    except (IndexError, struct.error, RecursionError, OverflowError) as exc:
        raise SkimError(f"{type(exc).__name__}: {exc}") from None
