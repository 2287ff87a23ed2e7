"""OTLP/HTTP logs requests as the gateway reads them: http/protobuf (the default of the OpenTelemetry SDKs' exporters
and of the Collector's ``otlphttp``) parsed with the ``opentelemetry-proto`` messages, or JSON; either one
gzip-compressed (``Content-Encoding: gzip``, the Collector's default) or not. Out of each request come the attributes
of its ``gen_ai.evaluation.result`` events (the event name in the record's ``event_name`` or its ``event.name``
attribute), and the answer in the request's own encoding."""
from __future__ import annotations

import zlib
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (ExportLogsServiceRequest,
                                                                    ExportLogsServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from rlstream.gateway.limits import parse_json

#: the OpenTelemetry GenAI semantic-convention event of an evaluation result
EVALUATION_EVENT = "gen_ai.evaluation.result"
#: the most OTLP log records one request may carry
MAX_LOG_RECORDS = 1000
PROTOBUF = "application/x-protobuf"
JSON_TYPE = "application/json"


class OtlpRequestError(ValueError):
    """A logs request the gateway cannot read (answered 400, or 415 when ``unsupported_media``)."""

    def __init__(self, message: str, unsupported_media: bool = False) -> None:
        super().__init__(message)
        self.unsupported_media = unsupported_media


def media_type(content_type: str) -> str:
    """``PROTOBUF`` or ``JSON_TYPE`` for a request's content type; :class:`OtlpRequestError` (415) otherwise."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind in (PROTOBUF, "application/protobuf"):
        return PROTOBUF
    if kind == JSON_TYPE:
        return JSON_TYPE
    raise OtlpRequestError("OTLP/HTTP logs are application/x-protobuf or application/json", unsupported_media=True)


def decompressed(body: bytes, content_encoding: str, limit: int) -> bytes:
    """``body`` inflated when ``content_encoding`` is gzip (or deflate), at most ``limit`` bytes inflated."""
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise OtlpRequestError(f"unsupported Content-Encoding {encoding[:32]!r} (gzip, deflate or none)",
                               unsupported_media=True)
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise OtlpRequestError(f"the body is not valid {encoding}: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise OtlpRequestError(f"the inflated body exceeds {limit} bytes")
    return out


def _proto_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(value, kind)
    return None


def _json_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return None
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return value[kind]
    if "intValue" in value:  # int64 travels as a string in OTLP JSON
        try:
            return int(value["intValue"])
        except (TypeError, ValueError):
            return None
    return None


def _json_attributes(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("key"), str):
                out[item["key"]] = _json_value(item.get("value"))
    return out


def _counted(seen: int) -> int:
    if seen > MAX_LOG_RECORDS:
        raise OtlpRequestError(f"more than {MAX_LOG_RECORDS} log records in one request")
    return seen


def evaluation_records(body: bytes, kind: str, max_json_depth: int) -> list[dict[str, Any]]:
    """The attributes of each ``gen_ai.evaluation.result`` record of an (inflated) logs request (JSON bounded as
    every JSON body: :func:`rlstream.gateway.limits.parse_json`)."""
    found: list[dict[str, Any]] = []
    seen = 0
    if kind == PROTOBUF:
        request = ExportLogsServiceRequest()
        try:
            request.ParseFromString(body)
        except DecodeError as exc:
            raise OtlpRequestError(f"not an OTLP ExportLogsServiceRequest: {exc}") from None
        for resource in request.resource_logs:
            for scope in resource.scope_logs:
                for record in scope.log_records:
                    seen = _counted(seen + 1)
                    attributes = {kv.key: _proto_value(kv.value) for kv in record.attributes}
                    if (record.event_name or attributes.get("event.name")) == EVALUATION_EVENT:
                        found.append(attributes)
        return found
    data = parse_json(body, max_json_depth)
    if not isinstance(data, dict) or not isinstance(data.get("resourceLogs"), list):
        raise OtlpRequestError("a logs request is an object with a resourceLogs list")
    for resource in data["resourceLogs"]:
        for scope in (resource.get("scopeLogs") or []) if isinstance(resource, dict) else []:
            for record in (scope.get("logRecords") or []) if isinstance(scope, dict) else []:
                seen = _counted(seen + 1)
                if not isinstance(record, dict):
                    continue
                attributes = _json_attributes(record.get("attributes"))
                if (record.get("eventName") or attributes.get("event.name")) == EVALUATION_EVENT:
                    found.append(attributes)
    return found


def success_body(kind: str) -> bytes:
    """An empty ``ExportLogsServiceResponse`` (every record taken) in the request's encoding."""
    return ExportLogsServiceResponse().SerializeToString() if kind == PROTOBUF else b"{}"
