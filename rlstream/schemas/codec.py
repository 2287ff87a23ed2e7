"""Avro binary codec for rlstream events (fastavro).

Two framings, both read by :meth:`AvroCodec.decode`:

* single-object encoding (no registry): ``C3 01`` + 8-byte little-endian CRC-64-AVRO
  fingerprint of the writer schema + Avro body; the reader finds the writer schema by
  fingerprint among the schemas it knows.
* Confluent wire format (registry configured): ``00`` + 4-byte big-endian schema id + body;
  the writer schema comes from the registry.

Every failure raises a :class:`CodecError` subclass with a message a person can act on.
"""
from __future__ import annotations

import io
import json
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, TypeVar

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from rlstream.schemas.models import EVENT_MODELS, WireModel

AVSC_DIR = Path(__file__).parent / "avsc"
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


class SchemaRegistry(Protocol):
    """The two calls the codec needs from a Confluent-compatible schema registry."""

    def register(self, subject: str, schema_json: str) -> int: ...

    def get_schema(self, schema_id: int) -> str: ...


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


class AvroCodec:
    """Encodes :class:`WireModel` events to Avro bytes and back.

    ``registry`` switches encoding to the Confluent wire format. ``max_bytes`` bounds both
    what is written and what is read.
    """

    def __init__(self, registry: SchemaRegistry | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.registry = registry
        self.max_bytes = max_bytes
        self._by_fingerprint: dict[bytes, Any] = {}
        self._by_registry_id: dict[int, Any] = {}
        self._registry_ids: dict[str, int] = {}
        self._schemas: dict[str, Any] = {}
        self._schema_jsons: dict[str, str] = {}
        for name in EVENT_MODELS:
            self.add_schema(schema_json(name), reader=True)

    @classmethod
    def from_config(cls, kafka: Any) -> "AvroCodec":
        """A codec for a :class:`schemas.config.KafkaConfig`: its size limit, and the Confluent
        wire format when ``schema_registry_url`` is set."""
        registry = HttpSchemaRegistry(kafka.schema_registry_url) if kafka.schema_registry_url else None
        return cls(registry=registry, max_bytes=kafka.max_message_bytes)

    # -- schemas -----------------------------------------------------------------
    def add_schema(self, schema: dict[str, Any] | str, *, reader: bool = False) -> Any:
        """Make a schema version known by fingerprint, so payloads written with it decode
        (e.g. an older or newer version of an event).

        With ``reader=True`` it also becomes the schema that ``decode_record(data, name)`` and
        ``encode_record(record, name)`` use for its full name (this codec then reads and writes
        that version). Raises :class:`IncompatibleSchemaError` when the schema is not valid Avro.
        """
        try:
            raw = json.loads(schema) if isinstance(schema, str) else schema
            parsed = fastavro.parse_schema(raw, _write_hint=False)
            fp = schema_fingerprint(raw)
        except (ValueError, TypeError, KeyError, AttributeError, fastavro.schema.SchemaParseException) as exc:
            raise IncompatibleSchemaError(f"not a valid Avro schema: {type(exc).__name__}: {exc}") from exc
        self._by_fingerprint[fp] = parsed
        if reader:
            name = _name_of(parsed)
            self._schemas[name] = parsed
            self._schema_jsons[name] = json.dumps(raw)
            self._registry_ids.pop(name, None)
        return parsed

    def parsed_schema(self, full_name: str) -> Any:
        try:
            return self._schemas[full_name]
        except KeyError:
            raise UnknownSchemaError(f"no schema named {full_name!r}; known: {sorted(self._schemas)}") from None

    # -- encoding ------------------------------------------------------------------
    def encode(self, event: WireModel) -> bytes:
        """Encode one event with its own schema."""
        return self.encode_record(event.model_dump(), event.avro_name)

    def encode_record(self, record: dict[str, Any], schema: str | dict[str, Any]) -> bytes:
        """Encode a plain dict with a schema given by full name or as a schema dict."""
        if isinstance(schema, str):
            parsed = self.parsed_schema(schema)
            raw_json = self._schema_jsons[schema]
        else:
            parsed = self.add_schema(schema)
            raw_json = json.dumps(schema)
        body = io.BytesIO()
        try:
            fastavro.schemaless_writer(body, parsed, record)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise CorruptPayloadError(f"record does not match schema {_name_of(parsed)}: {exc}") from exc
        header = self._header(parsed, raw_json)
        size = len(header) + body.tell()
        if size > self.max_bytes:
            raise PayloadTooLargeError(
                f"encoded {_name_of(parsed)} is {size} bytes, over the limit of {self.max_bytes} bytes "
                "(codec max_bytes; keep it under the broker's message.max.bytes); "
                "split the trajectory or drop token data from it"
            )
        return header + body.getvalue()

    def _header(self, parsed: Any, raw_json: str) -> bytes:
        if self.registry is None:
            return SINGLE_OBJECT_MAGIC + schema_fingerprint(raw_json)
        name = _name_of(parsed)
        schema_id = self._registry_ids.get(name)
        if schema_id is None:
            schema_id = self.registry.register(name, raw_json)
            self._registry_ids[name] = schema_id
            self._by_registry_id[schema_id] = parsed
        return CONFLUENT_MAGIC + struct.pack(">I", schema_id)

    # -- decoding ------------------------------------------------------------------
    def decode(self, data: bytes, model: type[T]) -> T:
        """Decode bytes into ``model``, resolving the writer schema to the model's schema."""
        record = self.decode_record(data, model.avro_name)
        try:
            return model.model_validate(record)
        except ValueError as exc:
            raise CorruptPayloadError(f"decoded {model.avro_name} is not valid: {exc}") from exc

    def decode_record(self, data: bytes, reader_schema: str | None = None) -> dict[str, Any]:
        """Decode bytes into a dict; with ``reader_schema`` (full name) the writer is resolved to it."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CorruptPayloadError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > self.max_bytes:
            raise PayloadTooLargeError(f"payload is {len(data)} bytes, over the limit of {self.max_bytes} bytes")
        writer, body_start = self._writer_schema(data)
        reader = self.parsed_schema(reader_schema) if reader_schema else writer
        if reader_schema and _name_of(writer) != reader_schema:
            raise IncompatibleSchemaError(
                f"payload was written as {_name_of(writer)}, cannot be read as {reader_schema}"
            )
        buf = io.BytesIO(data)
        buf.seek(body_start)
        try:
            record = fastavro.schemaless_reader(buf, writer, reader if reader is not writer else None)
        except fastavro.read.SchemaResolutionError as exc:
            raise IncompatibleSchemaError(
                f"writer schema {_name_of(writer)} cannot be resolved to the reader's: {exc}"
            ) from exc
        except (MemoryError, RecursionError) as exc:
            raise CorruptPayloadError(f"payload body is corrupt ({type(exc).__name__})") from exc
        except Exception as exc:  # fastavro raises many types on garbage: EOFError, ValueError, ...
            raise CorruptPayloadError(f"payload body is corrupt or truncated: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):
            raise CorruptPayloadError(f"payload has {len(data) - buf.tell()} trailing bytes after the Avro body")
        if not isinstance(record, dict):
            raise CorruptPayloadError("payload body is not an Avro record")
        return record

    def _writer_schema(self, data: bytes) -> tuple[Any, int]:
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

    def _schema_by_registry_id(self, schema_id: int) -> Any:
        if schema_id in self._by_registry_id:
            return self._by_registry_id[schema_id]
        if self.registry is None:
            raise UnknownSchemaError(
                f"payload uses Confluent wire format (schema id {schema_id}) but no schema registry is configured"
            )
        try:
            schema_str = self.registry.get_schema(schema_id)
        except Exception as exc:
            raise UnknownSchemaError(f"schema id {schema_id} not found in the registry: {exc}") from exc
        try:
            parsed = fastavro.parse_schema(json.loads(schema_str), _write_hint=False)
        except Exception as exc:  # a registry answer that is not an Avro schema
            raise UnknownSchemaError(
                f"schema id {schema_id} from the registry is not a usable Avro schema: {type(exc).__name__}: {exc}"
            ) from exc
        self._by_registry_id[schema_id] = parsed
        return parsed


def _name_of(parsed: Any) -> str:
    return parsed.get("name", "?") if isinstance(parsed, dict) else str(parsed)


class HttpSchemaRegistry:
    """Confluent Schema Registry REST client (register by subject, fetch by id)."""

    def __init__(self, url: str, timeout_s: float = 10.0, auth: tuple[str, str] | None = None) -> None:
        import httpx

        self._client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, auth=auth)

    def register(self, subject: str, schema_json: str) -> int:
        resp = self._client.post(
            f"/subjects/{subject}/versions",
            json={"schema": schema_json},
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
        )
        resp.raise_for_status()
        return int(resp.json()["id"])

    def get_schema(self, schema_id: int) -> str:
        resp = self._client.get(f"/schemas/ids/{schema_id}")
        resp.raise_for_status()
        return str(resp.json()["schema"])
