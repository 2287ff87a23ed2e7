"""The tools' own score rules (Langfuse data types, LangSmith feedback_config), OTLP request decoding (protobuf with
the opentelemetry-proto messages, gzip bounded) and the gateway's correction window, as pure functions."""
from __future__ import annotations

import gzip

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs

from rlstream.gateway.feedback_otlp import PROTOBUF, OtlpRequestError, decompressed, evaluation_records, media_type
from rlstream.gateway.feedback_scores import FeedbackConfig, FeedbackShapeError, langfuse_reward, langsmith_reward
from rlstream.gateway.feedback_window import CorrectionWindow

pytestmark = pytest.mark.unit
TABLE = {"thumbs_up": 1.0, "thumbs_down": -1.0}


def test_langfuse_data_types_are_checked_as_langfuse_checks_them() -> None:
    assert langfuse_reward(0.5, "NUMERIC", TABLE) == 0.5 and langfuse_reward(3, None, TABLE) == 3.0
    assert langfuse_reward(1.0, "BOOLEAN", TABLE) == 1.0 and langfuse_reward(0, "BOOLEAN", TABLE) == 0.0
    assert langfuse_reward(True, None, TABLE) == 1.0
    assert langfuse_reward("Thumbs_Up", "CATEGORICAL", TABLE) == 1.0 and langfuse_reward("thumbs_down", None,
                                                                                          TABLE) == -1.0
    for value, data_type in (("good", "NUMERIC"), (True, "NUMERIC"), (0.7, "BOOLEAN"), ("yes", "BOOLEAN"),
                             (1.0, "CATEGORICAL"), ("great", "CATEGORICAL"), ("fine", "TEXT"), ("x", "CORRECTION"),
                             (1.0, "PERCENT"), (float("inf"), "NUMERIC")):
        with pytest.raises(FeedbackShapeError):
            langfuse_reward(value, data_type, TABLE)


def test_langsmith_feedback_config_ranges_and_categories() -> None:
    stars = FeedbackConfig(type="continuous", min=1, max=5)
    assert langsmith_reward(4, None, stars, TABLE) == 0.75 and langsmith_reward(1, None, stars, TABLE) == 0.0
    verdict = FeedbackConfig.model_validate({"type": "categorical", "categories": [
        {"value": -1, "label": "bad"}, {"value": 1, "label": "good"}]})
    assert langsmith_reward(None, "Good", verdict, TABLE) == 1.0 and langsmith_reward(-1, None, verdict, TABLE) == -1
    assert langsmith_reward(True, None, None, TABLE) == 1.0 and langsmith_reward(None, "thumbs_up", None, TABLE) == 1.0
    for score, value, config in ((7, None, stars), (0, None, stars), (None, "meh", verdict), (0.5, None, verdict),
                                 (None, None, None), (3, None, FeedbackConfig(type="continuous", min=5, max=1))):
        with pytest.raises(FeedbackShapeError):
            langsmith_reward(score, value, config, TABLE)


def _request(*records: LogRecord) -> bytes:
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(scope_logs=[ScopeLogs(
        log_records=list(records))])]).SerializeToString()


def test_otlp_protobuf_records_gzip_and_bounds() -> None:
    wanted = LogRecord(event_name="gen_ai.evaluation.result", attributes=[
        KeyValue(key="gen_ai.response.id", value=AnyValue(string_value="chatcmpl-1")),
        KeyValue(key="gen_ai.evaluation.score.value", value=AnyValue(double_value=0.5)),
        KeyValue(key="n", value=AnyValue(int_value=7))])
    body = _request(wanted, LogRecord(event_name="other"))
    assert evaluation_records(decompressed(gzip.compress(body), "gzip", 1 << 20), PROTOBUF, 64) == [
        {"gen_ai.response.id": "chatcmpl-1", "gen_ai.evaluation.score.value": 0.5, "n": 7}]
    assert media_type("application/x-protobuf") == PROTOBUF
    with pytest.raises(OtlpRequestError) as unsupported:
        media_type("text/plain")
    assert unsupported.value.unsupported_media
    with pytest.raises(OtlpRequestError):
        evaluation_records(b"\xff\xff\xff", PROTOBUF, 64)
    with pytest.raises(OtlpRequestError):  # inflates past the limit: refused, not inflated whole
        decompressed(gzip.compress(b"\0" * 100_000), "gzip", 1000)
    with pytest.raises(OtlpRequestError):
        decompressed(b"plain", "gzip", 1000)


def test_a_correction_after_the_window_is_too_late_a_first_score_never_is() -> None:
    import asyncio

    from rlstream.gateway.shared_ids import TenantMap

    async def scenario() -> None:
        window = CorrectionWindow(60.0, TenantMap("feedback-ids", "p", ttl_s=3600, capacity=10))
        assert not await window.too_late("acme", "t1", "fb-1", captured_at=0.0, now=100.0)  # first use of the id
        await window.accepted("acme", "t1", "fb-1", now=10.0)
        assert not await window.too_late("acme", "t1", "fb-1", captured_at=0.0, now=59.0)
        assert await window.too_late("acme", "t1", "fb-1", captured_at=0.0, now=61.0)
        assert not await window.too_late("globex", "t1", "fb-1", captured_at=0.0, now=61.0)  # per tenant
        assert not await window.too_late("acme", "t1", None, captured_at=0.0, now=61.0)

    asyncio.run(scenario())
