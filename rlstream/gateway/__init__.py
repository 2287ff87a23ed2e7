"""``rlstream gateway``: an OpenAI-compatible capture gateway in front of vLLM (or any OpenAI-compatible
upstream). Every call becomes (part of) a production TrajectoryEvent; ``POST /v1/feedback`` gives rewards.

Routes: ``POST /v1/chat/completions`` (streamed or not; ``chat.py``), ``POST /v1/responses`` (``responses.py``),
``GET /v1/models``, the same under ``/s/{session_id}/v1/...``, ``POST /v1/sessions/{id}/end``, ``POST /v1/feedback``
(``feedback_api.py``) and the observability tools' feedback shapes (``feedback_shapes.py``), ``GET /rlstream/stats``,
``GET /health`` (``app.py``). Every endpoint builds on one core (``core.py``: routing, admission, capture, signing)
and streams through one relay (``relay.py``). Its settings are the ``gateway`` section of the main configuration
(``config.py`` resolves it). Needs the ``[gateway]`` extra (starlette, uvicorn).

Capture never blocks or fails a response: events go through a bounded queue to Kafka and, while Kafka is slow or
down, to an on-disk spool (``spool.py``: append-only, fsync'd, checksummed segments) that is sent in order once
Kafka answers, also after a restart (``queue.py`` says what is re-sent after a crash).
"""
from rlstream.gateway.config import GatewaySettings

__all__ = ["GatewaySettings"]
