"""Avro binary codec for rlstream events (fastavro).

Two framings, both read by :meth:`AvroCodec.decode`:

* single-object encoding (no registry): ``C3 01`` + 8-byte little-endian CRC-64-AVRO
  fingerprint of the writer schema + Avro body; the reader finds the writer schema by
  fingerprint among the schemas it knows (by the specification's fingerprint, and by the one the
  Apache ``avro`` Python package computes, which differs for schemas with logical types).
* Confluent wire format (registry configured): ``00`` + 4-byte big-endian schema id + body;
  the writer schema comes from the registry. Writers register each schema once per process under the subject
  that the configured strategy names (:class:`SubjectNames`: Confluent's TopicNameStrategy by default), through
  confluent-kafka's registry client (basic auth, TLS, retries, caching); ids the registry could not resolve are
  remembered for ``failure_ttl_s``, so a stream of records with an unknown id costs one request, not one each.

Every failure raises a :class:`CodecError` subclass with a message a person can act on.

Speed: each schema version is parsed and fingerprinted once per process; a payload written with the
reader's own schema version (same fingerprint) is read with the reader schema alone, without
writer-to-reader resolution, so decoding costs what bare fastavro costs.
"""
from __future__ import annotations

import io
import json
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from rlstream.schemas.models import EVENT_MODELS, WireModel
from rlstream.schemas.skim import SkimError, skim

if TYPE_CHECKING:
    from rlstream.schemas.config import KafkaConfig, RlstreamConfig

AVSC_DIR = Path(__file__).parent / "avsc"
#: earlier versions of event schemas (fully expanded JSON), known to every codec as writer schemas
HISTORY_DIR = AVSC_DIR / "history"
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
DEFAULT_MAX_BYTES = 1_000_000  # Kafka's default message.max.bytes is ~1 MB

T = TypeVar("T", bound=WireModel)


class CodecError(Exception):
    """Base of every error the codec raises."""


class UnknownSchemaError(CodecError):
    """The writer schema (fingerprint or registry id) is not known to this reader."""


class CorruptPayloadError(CodecError):
    """The bytes are not a valid rlstream Avro payload."""


class IncompatibleSchemaError(CodecError):
    """Writer and reader schemas cannot be resolved against each other."""


class PayloadTooLargeError(CodecError):
    """An encoded event is over the configured size limit."""


class SchemaRegistryUnavailable(RuntimeError):
    """The schema registry did not register a writer's schema (down, refused, or the schema is incompatible).

    Not a :class:`CodecError`: the event is fine, the infrastructure is not, so it must not be dead-lettered."""


class SchemaRegistry(Protocol):
    """The two calls the codec needs from a Confluent-compatible schema registry."""

    def register(self, subject: str, schema_json: str) -> int: ...

    def get_schema(self, schema_id: int) -> str: ...


SubjectStrategy = Literal["topic_name", "record_name", "topic_record_name"]


@dataclass(frozen=True)
class SubjectNames:
    """The registry subject of each schema, as Confluent's serializers name value subjects.

    ``topic_name`` (TopicNameStrategy, their default): ``<topic>-value``; ``record_name``: the record's full name;
    ``topic_record_name``: ``<topic>-<full name>``. ``topic_of`` maps a record's full name to the topic it is
    written to (one schema per topic in rlstream, DESIGN.md)."""

    strategy: SubjectStrategy = "topic_name"
    topic_of: Mapping[str, str] = field(default_factory=dict)

    def subject(self, full_name: str) -> str:
        if self.strategy == "record_name":
            return full_name
        topic = self.topic_of.get(full_name)
        if topic is None:
            raise SchemaRegistryUnavailable(
                f"no topic is known for {full_name}, so the {self.strategy} subject strategy cannot name its subject; "
                "use kafka.schema_registry_subject_strategy=record_name for records outside rlstream's topics")
        return f"{topic}-value" if self.strategy == "topic_name" else f"{topic}-{full_name}"


def _named_schema_files() -> dict[str, dict[str, Any]]:
    return {p.name[: -len(".avsc")]: json.loads(p.read_text()) for p in sorted(AVSC_DIR.glob("*.avsc"))}


@lru_cache(maxsize=None)
def schema_json(full_name: str) -> str:
    """The self-contained JSON of a schema of ``avsc/``: each named type it uses is defined
    inline at its first use and referenced by name after that, as Avro requires."""
    files = _named_schema_files()
    if full_name not in files:
        raise UnknownSchemaError(f"no schema named {full_name!r} in {AVSC_DIR}")
    return json.dumps(_expand(files[full_name], files, set()))


def _expand(node: Any, files: dict[str, dict[str, Any]], defined: set[str]) -> Any:
    if isinstance(node, str):
        if node in files and node not in defined:
            return _expand(files[node], files, defined)
        return node
    if isinstance(node, list):
        return [_expand(n, files, defined) for n in node]
    if isinstance(node, dict):
        if node.get("type") in ("record", "enum", "fixed"):
            defined.add(f"{node.get('namespace', 'rlstream.v1')}.{node['name']}")
        out = dict(node)
        for key in ("type", "items", "values"):
            if key in out:
                out[key] = _expand(out[key], files, defined)
        if "fields" in out:
            out["fields"] = [_expand(f, files, defined) for f in out["fields"]]
        return out
    return node


def schema_fingerprint(schema: dict[str, Any] | str) -> bytes:
    """CRC-64-AVRO fingerprint of a schema's parsing canonical form, as the 8 little-endian bytes
    that follow ``C3 01`` in a single-object payload (the Avro specification's byte order)."""
    parsed = fastavro.parse_schema(json.loads(schema) if isinstance(schema, str) else schema, _write_hint=False)
    canonical = to_parsing_canonical_form(parsed)
    # fastavro returns the hex of the little-endian bytes already (e.g. '"int"' -> 8f5c393f1ad57572)
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


def apache_avro_fingerprint(schema: dict[str, Any] | list[Any] | str) -> bytes:
    """The CRC-64-AVRO fingerprint that the Apache ``avro`` Python package (1.12) computes for a schema,
    in the same byte order as :func:`schema_fingerprint`.

    Its parsing canonical form departs from the specification in two places: a primitive written as an
    object with an attribute other than ``type``/``doc`` (a logical type such as
    ``{"type": "long", "logicalType": "timestamp-millis"}``) stays ``{"type":"long"}`` instead of ``"long"``,
    and a ``fixed`` type is written out in full at every use. For schemas with neither it equals
    :func:`schema_fingerprint`.
    """
    raw = json.loads(schema) if isinstance(schema, str) else schema
    canonical = json.dumps(_apache_canonical(raw, None, set(), {}), separators=(",", ":"))
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


# the avro package's SCHEMA_RESERVED_PROPS: any other attribute makes a primitive keep its object form
_APACHE_RESERVED = frozenset({"type", "name", "namespace", "fields", "items", "size", "symbols", "values", "doc"})
_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})


def _fullname(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _apache_canonical(node: Any, namespace: str | None, defined: set[str], fixed: dict[str, dict[str, Any]]) -> Any:
    """The avro package's ``Schema.to_canonical_json`` of a schema's JSON (see :func:`apache_avro_fingerprint`)."""
    if isinstance(node, str):
        if node in _PRIMITIVES:
            return node
        full = _fullname(node, namespace)
        return dict(fixed[full]) if full in fixed else full
    if isinstance(node, list):
        return [_apache_canonical(n, namespace, defined, fixed) for n in node]
    if not isinstance(node, dict):
        raise TypeError(f"not an Avro schema: {node!r}")
    type_ = node["type"]
    if type_ in _PRIMITIVES:
        return {"type": type_} if any(k not in _APACHE_RESERVED for k in node) else type_
    if type_ == "array":
        return {"type": "array", "items": _apache_canonical(node["items"], namespace, defined, fixed)}
    if type_ == "map":
        return {"type": "map", "values": _apache_canonical(node["values"], namespace, defined, fixed)}
    if type_ not in ("record", "error", "enum", "fixed"):
        raise ValueError(f"unknown Avro type {type_!r}")
    full = _fullname(node["name"], node.get("namespace") or namespace)  # the avro package reads "" as unset
    if type_ == "fixed":
        fixed[full] = {"name": full, "type": "fixed", "size": node["size"]}
        return dict(fixed[full])
    if full in defined:
        return full
    defined.add(full)
    if type_ == "enum":
        return {"name": full, "type": "enum", "symbols": list(node["symbols"])}
    inner = full.rpartition(".")[0] or None
    fields = [{"name": f["name"], "type": _apache_canonical(f["type"], inner, defined, fixed)} for f in node["fields"]]
    return {"name": full, "type": type_, "fields": fields}


@dataclass(frozen=True, slots=True)
class _Known:
    """One schema version, compiled once: everything encoding and decoding need of it."""

    name: str  # full name (of the top-level record)
    parsed: Any  # fastavro's parsed schema, with its parse marker so fastavro does not parse it again per call
    json: str  # what a schema registry is given
    fingerprint: bytes  # CRC-64-AVRO of the specification's parsing canonical form
    apache_fingerprint: bytes | None  # the avro package's fingerprint, where it differs (logical types)
    header: bytes  # single-object header: C3 01 + fingerprint


@lru_cache(maxsize=512)
def _compile(schema_str: str) -> _Known:
    """Parse and fingerprint a schema's JSON once per process (codecs share the result; nothing mutates it).
    Raises what ``json``/fastavro raise on an invalid schema."""
    raw = json.loads(schema_str)
    parsed = fastavro.parse_schema(raw)
    fp = schema_fingerprint(raw)
    try:
        apache: bytes | None = apache_avro_fingerprint(raw)
    except (ValueError, TypeError, KeyError, AttributeError):  # fastavro accepted it; the avro package may not
        apache = None
    return _Known(name=_name_of(parsed), parsed=parsed, json=json.dumps(raw), fingerprint=fp,
                  apache_fingerprint=None if apache == fp else apache, header=SINGLE_OBJECT_MAGIC + fp)


class AvroCodec:
    """Encodes :class:`WireModel` events to Avro bytes and back.

    ``registry`` switches encoding to the Confluent wire format. ``max_bytes`` bounds both
    what is written and what is read. Schemas are parsed and fingerprinted once; a payload whose
    writer schema has the reader's fingerprint is read with the reader schema alone (no resolution).
    """

    def __init__(self, registry: SchemaRegistry | None = None, max_bytes: int = DEFAULT_MAX_BYTES, *,
                 subjects: SubjectNames | None = None, failure_ttl_s: float = 30.0) -> None:
        self.registry = registry
        self.max_bytes = max_bytes
        self.subjects = subjects or SubjectNames("record_name")
        self.failure_ttl_s = failure_ttl_s
        self._failed_ids: dict[int, tuple[float, str]] = {}  # schema id -> (retry after, monotonic; the error)
        self._by_fingerprint: dict[bytes, _Known] = {}  # both fingerprints of every known version
        self._spec_fingerprints: set[bytes] = set()  # those that are a schema's specification fingerprint
        self._by_registry_id: dict[int, _Known] = {}
        self._confluent_headers: dict[str, bytes] = {}  # schema JSON -> 00 + its registry id
        self._schemas: dict[str, _Known] = {}  # full name -> the version this codec reads and writes
        for name in EVENT_MODELS:
            self.add_schema(schema_json(name), reader=True)
        for path in sorted(HISTORY_DIR.glob("*.json")):  # earlier versions: records written with them still decode
            self.add_schema(path.read_text())

    @classmethod
    def from_config(cls, kafka: "KafkaConfig", topic_of: Mapping[str, str], *,
                    max_bytes: int | None = None) -> "AvroCodec":
        """A codec for a :class:`schemas.config.KafkaConfig`: its size limit (or ``max_bytes``), and the Confluent
        wire format through the configured registry when ``schema_registry_url`` is set. ``topic_of`` maps each
        record's full name to its topic, for the subject strategy."""
        limit = max_bytes if max_bytes is not None else kafka.max_message_bytes
        if not kafka.schema_registry_url:
            return cls(max_bytes=limit)
        return cls(registry=ConfluentRegistry(registry_client_conf(kafka)), max_bytes=limit,
                   subjects=SubjectNames(kafka.schema_registry_subject_strategy, dict(topic_of)),
                   failure_ttl_s=kafka.schema_registry_failure_ttl_s)

    # -- schemas -----------------------------------------------------------------
    def add_schema(self, schema: dict[str, Any] | str, *, reader: bool = False) -> Any:
        """Make a schema version known by fingerprint, so payloads written with it decode
        (e.g. an older or newer version of an event). Both its specification fingerprint and the one
        the Apache ``avro`` package computes (they differ for schemas with logical types) map to it.

        With ``reader=True`` it also becomes the schema that ``decode_record(data, name)`` and
        ``encode_record(record, name)`` use for its full name (this codec then reads and writes
        that version). Raises :class:`IncompatibleSchemaError` when the schema is not valid Avro.
        """
        return self._add(schema, reader).parsed

    def _add(self, schema: dict[str, Any] | str, reader: bool) -> _Known:
        known = self._compiled(schema)
        self._by_fingerprint[known.fingerprint] = known
        self._spec_fingerprints.add(known.fingerprint)
        alias = known.apache_fingerprint
        if alias is not None and alias not in self._spec_fingerprints:
            self._by_fingerprint[alias] = known
        if reader:
            self._schemas[known.name] = known
        return known

    def parsed_schema(self, full_name: str) -> Any:
        """fastavro's parsed schema of the version this codec reads and writes for ``full_name``."""
        return self._reader(full_name).parsed

    def _reader(self, full_name: str) -> _Known:
        try:
            return self._schemas[full_name]
        except KeyError:
            raise UnknownSchemaError(f"no schema named {full_name!r}; known: {sorted(self._schemas)}") from None

    @staticmethod
    def _compiled(schema: dict[str, Any] | str) -> _Known:
        try:
            return _compile(schema if isinstance(schema, str) else json.dumps(schema))
        except (ValueError, TypeError, KeyError, AttributeError, fastavro.schema.SchemaParseException) as exc:
            raise IncompatibleSchemaError(f"not a valid Avro schema: {type(exc).__name__}: {exc}") from exc

    # -- encoding ------------------------------------------------------------------
    def encode(self, event: WireModel) -> bytes:
        """Encode one event with its own schema."""
        return self.encode_record(event.model_dump(), event.avro_name)

    def encode_record(self, record: dict[str, Any], schema: str | dict[str, Any]) -> bytes:
        """Encode a plain dict with a schema given by full name or as a schema dict."""
        known = self._reader(schema) if isinstance(schema, str) else self._add(schema, reader=False)
        body = io.BytesIO()
        try:
            fastavro.schemaless_writer(body, known.parsed, record)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise CorruptPayloadError(f"record does not match schema {known.name}: {exc}") from exc
        header = self._header(known)
        size = len(header) + body.tell()
        if size > self.max_bytes:
            raise PayloadTooLargeError(
                f"encoded {known.name} is {size} bytes, over the limit of {self.max_bytes} bytes "
                "(codec max_bytes; keep it under the broker's message.max.bytes); "
                "split the trajectory or drop token data from it"
            )
        return header + body.getvalue()

    def encode_body(self, record: dict[str, Any], full_name: str) -> bytes:
        """The unframed Avro body of ``record`` in schema ``full_name`` (to be placed inside another record)."""
        body = io.BytesIO()
        try:
            fastavro.schemaless_writer(body, self._reader(full_name).parsed, record)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise CorruptPayloadError(f"record does not match schema {full_name}: {exc}") from exc
        return body.getvalue()

    def body_as_written(self, data: bytes, full_name: str) -> bytes | None:
        """The Avro body of framed ``data`` when its writer schema is this codec's own ``full_name`` (the body can then
        be placed inside another record as it is); None when the writer schema differs (decode and encode instead)."""
        writer, start = self._writer_schema(bytes(data[:10]))
        return bytes(data[start:]) if writer.fingerprint == self._reader(full_name).fingerprint else None

    def encode_with_bodies(self, event: WireModel, array_field: str, bodies: list[bytes]) -> bytes:
        """Encode ``event`` with its array of records ``array_field`` (empty in ``event``) holding ``bodies``, Avro
        bodies of the array's item schema placed as they are (no decode, no encode). Avro writes a record's fields
        one after another, an empty array as one zero byte and a non-empty one as its item count (a zigzag varint),
        the items and a zero: the event is encoded with the empty array and the items go where that zero byte is."""
        known = self._reader(event.avro_name)
        record = event.model_dump()
        if record.get(array_field):
            raise ValueError(f"{event.avro_name}.{array_field} must be empty: its items are given as bodies")
        whole = io.BytesIO()
        head = io.BytesIO()
        try:
            fastavro.schemaless_writer(whole, known.parsed, record)
            fastavro.schemaless_writer(head, _fields_before(known, array_field), record)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise CorruptPayloadError(f"record does not match schema {known.name}: {exc}") from exc
        encoded, cut = whole.getvalue(), head.tell()
        if encoded[cut:cut + 1] != b"\x00":  # not where an empty array must be: never place bytes blindly
            raise RuntimeError(f"{known.name}.{array_field} is not at byte {cut} of the encoded record")
        items = _avro_long(len(bodies)) + b"".join(bodies) + b"\x00" if bodies else b"\x00"
        header = self._header(known)
        size = len(header) + len(encoded) - 1 + len(items)
        if size > self.max_bytes:
            raise PayloadTooLargeError(
                f"encoded {known.name} is {size} bytes, over the limit of {self.max_bytes} bytes "
                "(codec max_bytes; keep it under the broker's message.max.bytes)")
        return header + encoded[:cut] + items + encoded[cut + 1:]

    def ensure_registered(self, full_names: list[str]) -> None:
        """Register the schemas a writer will use now (with a registry; otherwise nothing to do), so that a registry
        that is down or refuses a schema stops the writer at start, before it takes any work.
        Raises :class:`SchemaRegistryUnavailable`."""
        if self.registry is not None:
            for name in full_names:
                self._header(self._reader(name))

    def _header(self, known: _Known) -> bytes:
        if self.registry is None:
            return known.header
        header = self._confluent_headers.get(known.json)
        if header is None:  # registered once per schema version, under the strategy's subject
            subject = self.subjects.subject(known.name)
            try:
                schema_id = self.registry.register(subject, known.json)
            except Exception as exc:
                raise SchemaRegistryUnavailable(
                    f"schema {known.name} not registered under subject {subject!r}: {type(exc).__name__}: {exc}"
                ) from exc
            self._by_registry_id[schema_id] = known
            header = self._confluent_headers[known.json] = CONFLUENT_MAGIC + struct.pack(">I", schema_id)
        return header

    # -- decoding ------------------------------------------------------------------
    def decode(self, data: bytes, model: type[T]) -> T:
        """Decode bytes into ``model``, resolving the writer schema to the model's schema."""
        record = self.decode_record(data, model.avro_name)
        try:
            return model.model_validate(record)
        except ValueError as exc:
            raise CorruptPayloadError(f"decoded {model.avro_name} is not valid: {exc}") from exc

    def decode_record(self, data: bytes, reader_schema: str | None = None) -> dict[str, Any]:
        """Decode bytes into a dict; with ``reader_schema`` (full name) the writer is resolved to it,
        or, when the writer has the reader's fingerprint, the body is read with the reader schema alone."""
        data, writer, body_start = self._framed(data)
        schema, resolve_to = writer.parsed, None
        if reader_schema:
            reader = self._reader(reader_schema)
            self._check_name(writer, reader_schema)
            if writer.fingerprint == reader.fingerprint:
                schema = reader.parsed  # same layout: no resolution, and the reader's logical types
            else:
                resolve_to = reader.parsed
        buf = io.BytesIO(data)
        buf.seek(body_start)
        try:
            record = fastavro.schemaless_reader(buf, schema, resolve_to)
        except fastavro.read.SchemaResolutionError as exc:
            raise IncompatibleSchemaError(
                f"writer schema {writer.name} cannot be resolved to the reader's: {exc}"
            ) from exc
        except (MemoryError, RecursionError) as exc:
            raise CorruptPayloadError(f"payload body is corrupt ({type(exc).__name__})") from exc
        except Exception as exc:  # fastavro raises many types on garbage: EOFError, ValueError, ...
            raise CorruptPayloadError(f"payload body is corrupt or truncated: {type(exc).__name__}: {exc}") from exc
        return self._whole_record(record, buf.tell(), len(data))

    def skim_record(self, data: bytes, full_name: str) -> dict[str, Any] | None:
        """Like ``decode_record(data, full_name)``, but every array of numbers is a :class:`schemas.skim.SkippedNumbers`
        (its count), read without building its items (several times faster for token data: see schemas/skim.py).
        ``None`` when the payload was written with another version of the schema (decode it with ``decode_record``)."""
        data, writer, body_start = self._framed(data)
        reader = self._reader(full_name)
        self._check_name(writer, full_name)
        if writer.fingerprint != reader.fingerprint:
            return None
        try:
            record, end = skim(reader.json, data, body_start)
        except SkimError as exc:
            raise CorruptPayloadError(f"payload body is corrupt or truncated: {exc}") from exc
        return self._whole_record(record, end, len(data))

    def _framed(self, data: bytes) -> tuple[bytes, _Known, int]:
        """The payload as bytes, its writer schema and where its body starts (checks type, size and framing)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CorruptPayloadError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > self.max_bytes:
            raise PayloadTooLargeError(f"payload is {len(data)} bytes, over the limit of {self.max_bytes} bytes")
        writer, body_start = self._writer_schema(data)
        return data, writer, body_start

    @staticmethod
    def _check_name(writer: _Known, reader_schema: str) -> None:
        if writer.name != reader_schema:
            raise IncompatibleSchemaError(f"payload was written as {writer.name}, cannot be read as {reader_schema}")

    @staticmethod
    def _whole_record(record: Any, end: int, size: int) -> dict[str, Any]:
        if end != size:
            raise CorruptPayloadError(f"payload has {size - end} trailing bytes after the Avro body")
        if not isinstance(record, dict):
            raise CorruptPayloadError("payload body is not an Avro record")
        return record

    def _writer_schema(self, data: bytes) -> tuple[_Known, int]:
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < 10:
                raise CorruptPayloadError(f"single-object payload truncated in its header ({len(data)} bytes)")
            fp = data[2:10]
            try:
                return self._by_fingerprint[fp], 10
            except KeyError:
                raise UnknownSchemaError(
                    f"writer schema with CRC-64-AVRO fingerprint {fp.hex()} (0x{fp[::-1].hex()}) is unknown "
                    "to this reader; "
                    "add it with AvroCodec.add_schema or upgrade rlstream"
                ) from None
        if data[:1] == CONFLUENT_MAGIC:
            if len(data) < 5:
                raise CorruptPayloadError(f"Confluent payload truncated in its header ({len(data)} bytes)")
            (schema_id,) = struct.unpack(">I", data[1:5])
            return self._schema_by_registry_id(schema_id), 5
        raise CorruptPayloadError(
            f"unknown framing: first bytes {data[:2].hex() or '(empty)'}; expected c301 (Avro single-object) "
            "or 00 (Confluent wire format)"
        )

    def _schema_by_registry_id(self, schema_id: int) -> _Known:
        known = self._by_registry_id.get(schema_id)
        if known is not None:
            return known
        if self.registry is None:
            raise UnknownSchemaError(
                f"payload uses Confluent wire format (schema id {schema_id}) but no schema registry is configured"
            )
        failed = self._failed_ids.get(schema_id)
        if failed is not None and time.monotonic() < failed[0]:
            raise UnknownSchemaError(f"{failed[1]} (remembered; asked again after kafka.schema_registry_failure_ttl_s)")
        try:
            schema_str = self.registry.get_schema(schema_id)
        except Exception as exc:
            raise self._failed(schema_id, f"schema id {schema_id} could not be resolved by the registry: "
                                          f"{type(exc).__name__}: {exc}") from exc
        try:
            known = self._compiled(schema_str)
        except IncompatibleSchemaError as exc:
            raise self._failed(schema_id, f"schema id {schema_id} from the registry is not a usable Avro schema: "
                                          f"{exc}") from exc
        self._failed_ids.pop(schema_id, None)
        self._by_registry_id[schema_id] = known
        return known

    def _failed(self, schema_id: int, problem: str) -> UnknownSchemaError:
        """Remember that ``schema_id`` could not be resolved (for ``failure_ttl_s``); the error to raise."""
        self._failed_ids[schema_id] = (time.monotonic() + self.failure_ttl_s, problem)
        return UnknownSchemaError(problem)


def _avro_long(value: int) -> bytes:
    """``value`` as Avro writes a long: zigzag, then a little-endian base-128 varint."""
    zigzag = (value << 1) ^ (value >> 63)
    out = bytearray()
    while zigzag > 0x7F:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


@lru_cache(maxsize=64)
def _fields_before_cached(schema_json: str, array_field: str) -> Any:
    schema = json.loads(schema_json)
    names = [f["name"] for f in schema["fields"]]
    if array_field not in names:
        raise KeyError(f"{schema['name']} has no field {array_field!r}")
    head = schema["fields"][:names.index(array_field)]
    return fastavro.parse_schema({"type": "record", "name": f"{schema['name']}_head", "fields": head})


def _fields_before(known: _Known, array_field: str) -> Any:
    """A record schema of ``known``'s fields before ``array_field`` (their encoding is the start of the record's)."""
    return _fields_before_cached(known.json, array_field)


def _name_of(parsed: Any) -> str:
    return parsed.get("name", "?") if isinstance(parsed, dict) else str(parsed)


def registry_client_conf(kafka: "KafkaConfig") -> dict[str, Any]:
    """confluent-kafka ``SchemaRegistryClient`` settings from a :class:`schemas.config.KafkaConfig`."""
    conf: dict[str, Any] = {"url": str(kafka.schema_registry_url), "timeout": kafka.schema_registry_timeout_s,
                            "max.retries": kafka.schema_registry_retries, "retries.wait.ms": 200,
                            "retries.max.wait.ms": 5000}
    if kafka.schema_registry_basic_auth is not None:
        conf["basic.auth.user.info"] = kafka.schema_registry_basic_auth.get_secret_value()
    for key, path in (("ssl.ca.location", kafka.schema_registry_ca_file),
                      ("ssl.certificate.location", kafka.schema_registry_cert_file),
                      ("ssl.key.location", kafka.schema_registry_key_file)):
        if path is not None:
            conf[key] = str(path)
    return conf


class ConfluentRegistry:
    """:class:`SchemaRegistry` over confluent-kafka's ``SchemaRegistryClient`` (its REST client, auth, TLS, retries
    and caches); ``conf`` as :func:`registry_client_conf` builds it (``mock://`` URLs give its in-process registry)."""

    def __init__(self, conf: dict[str, Any]) -> None:
        try:
            from confluent_kafka.schema_registry import SchemaRegistryClient
        except ImportError as exc:
            raise SchemaRegistryUnavailable(f"kafka.schema_registry_url is set but the registry client is not "
                                            f"installed ({exc}): pip install 'rlstream[registry]'") from exc

        self.client = SchemaRegistryClient.new_client(conf)

    def register(self, subject: str, schema_json: str) -> int:
        from confluent_kafka.schema_registry import Schema

        return int(self.client.register_schema(subject, Schema(schema_json, "AVRO")))

    def get_schema(self, schema_id: int) -> str:
        return str(self.client.get_schema(schema_id).schema_str)


def codec_for(cfg: "RlstreamConfig", *, max_bytes: int | None = None) -> AvroCodec:
    """The codec of this deployment: Confluent framing through the configured registry when there is one, the
    subjects named after the configured topics."""
    from rlstream.schemas.topics import TopicNames

    return AvroCodec.from_config(cfg.kafka, TopicNames.from_config(cfg.topics).schema_topics(), max_bytes=max_bytes)
