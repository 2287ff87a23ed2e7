"""The OpenTelemetry SDK's OTLP/HTTP log exporter sending one ``gen_ai.evaluation.result`` event to a gateway, as an
evaluator instrumented with OTel does."""
from __future__ import annotations

from typing import Any


def otel_evaluation(base: str, api_key: str, response_id: str, name: str, score: dict[str, Any],
                    compressed: bool = True) -> bool:
    """Export one evaluation of ``response_id`` named ``name`` (``score``: the event's ``gen_ai.evaluation.score.*``
    attributes) to ``base``/v1/logs, http/protobuf, gzip-compressed unless ``compressed`` is false: whether the exporter
    reports success."""
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai

    results: list[bool] = []

    class Recording(OTLPLogExporter):
        def export(self, batch: Any) -> Any:
            result = super().export(batch)
            results.append(result.name == "SUCCESS")
            return result

    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(Recording(
        endpoint=f"{base}/v1/logs", headers={"authorization": f"Bearer {api_key}"},
        compression=Compression.Gzip if compressed else Compression.NoCompression)))
    provider.get_logger("evals").emit(event_name="gen_ai.evaluation.result", attributes={
        gen_ai.GEN_AI_RESPONSE_ID: response_id, gen_ai.GEN_AI_EVALUATION_NAME: name, **score})
    provider.shutdown()
    return results == [True]
