"""Feedback in the shapes observability tools already send, each published as a RewardEvent like ``/v1/feedback``.

* Langfuse's score API, ``POST /api/public/scores``: ``traceId`` / ``observationId`` (a trajectory id or a response id)
  or ``sessionId``; ``name`` (the reward's component); ``value`` numeric, boolean or categorical (``dataType``
  NUMERIC / BOOLEAN / CATEGORICAL); ``comment``; ``id`` (the feedback id: a repeated id corrects the score).
  Langfuse's clients authenticate with Basic ``public:secret``: the secret is the gateway key (or a feedback token).
* LangSmith's feedback, ``POST /feedback`` (also ``/api/v1/feedback``): ``run_id`` (a trajectory id or a response
  id), ``key`` (the component), ``score`` (number or boolean) or a categorical ``value``, ``correction``, ``comment``,
  ``id`` / ``feedback_id`` (the feedback id); ``PATCH /feedback/{id}`` (``Client.update_feedback``) corrects it.
  LangSmith's clients send their key as ``x-api-key``.
* OpenTelemetry's ``gen_ai.evaluation.result`` events over OTLP/HTTP JSON, ``POST /v1/logs``: each log record with
  that event name and a ``gen_ai.response.id`` attribute (the response id the gateway returned, ``chatcmpl-...`` /
  ``resp_...``) is a reward: ``gen_ai.evaluation.score.value``, else ``gen_ai.evaluation.score.label`` through the
  categories table; ``gen_ai.evaluation.name`` is the component. Its feedback id is ``otel:<response id>:<name>``:
  the same evaluator scoring the same response again corrects its score. Other log records are ignored.

A categorical value becomes a reward through the gateway's table (the ``gateway.feedback_categories`` setting); an
unknown category is refused (422, or a rejected OTLP record) rather than guessed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlstream.gateway.feedback import (MAX_ID_CHARS, MAX_NAME_CHARS, RANGE_CONTEXT, Feedback,
                                               validation_problems)
from rlstream.gateway.auth import BEARER_TOKEN_KEY, OPEN, PRINCIPAL_KEY, Principal, unauthorized
from rlstream.gateway.core import FEEDBACK_TOKEN_HEADER, Gateway
from rlstream.gateway.limits import parse_json
from rlstream.gateway.shared_ids import TenantMap
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: the OpenTelemetry GenAI semantic-convention event of an evaluation result, and its attributes
EVALUATION_EVENT = "gen_ai.evaluation.result"
ATTR_RESPONSE_ID = "gen_ai.response.id"
ATTR_NAME = "gen_ai.evaluation.name"
ATTR_SCORE = "gen_ai.evaluation.score.value"
ATTR_LABEL = "gen_ai.evaluation.score.label"
#: the most OTLP log records one request may carry
MAX_LOG_RECORDS = 1000
#: component name of a feedback that names none
DEFAULT_COMPONENT = "feedback"


class FeedbackShapeError(ValueError):
    """A feedback in a known shape that carries no usable reward (answered 422)."""


def category_reward(label: str, categories: dict[str, float]) -> float:
    """The reward of a categorical value (case-insensitive), or :class:`FeedbackShapeError`."""
    table = {k.lower(): v for k, v in categories.items()}
    value = table.get(label.strip().lower())
    if value is None:
        known = ", ".join(sorted(categories)) or "none configured"
        raise FeedbackShapeError(f"unknown category {label[:64]!r} (the gateway's feedback_categories: {known})")
    return value


def reward_of(value: Any, categories: dict[str, float]) -> float:
    """A score's reward: a number as it is, a boolean as 1 / 0, a string through the categories table."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise FeedbackShapeError("a score must be a finite number")
        return number
    if isinstance(value, str):
        return category_reward(value, categories)
    raise FeedbackShapeError("a score is a number, a boolean or a category")


class LangfuseScore(BaseModel):
    """Body of Langfuse's ``POST /api/public/scores`` (the fields rlstream uses; the others are accepted)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    trace_id: str | None = Field(None, alias="traceId", max_length=MAX_ID_CHARS)
    observation_id: str | None = Field(None, alias="observationId", max_length=MAX_ID_CHARS)
    session_id: str | None = Field(None, alias="sessionId", max_length=MAX_ID_CHARS)
    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    value: float | bool | str
    data_type: Literal["NUMERIC", "BOOLEAN", "CATEGORICAL"] | None = Field(None, alias="dataType")
    comment: str | None = None


class LangSmithFeedback(BaseModel):
    """Body of LangSmith's ``POST /feedback`` (the fields rlstream uses; the others are accepted)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    feedback_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    run_id: str = Field(..., min_length=1, max_length=MAX_ID_CHARS)
    key: str = Field(DEFAULT_COMPONENT, min_length=1, max_length=MAX_NAME_CHARS)
    score: float | bool | None = None
    value: float | bool | str | None = None
    correction: Any = None
    comment: str | None = None


@dataclass(frozen=True)
class Target:
    """What a feedback rewards: an id that is a trajectory id or a response id, or a session id."""

    trajectory_or_response: str | None = None
    session_id: str | None = None


def _feedback(target: Target, reward: float, component: str, feedback_id: str | None,
              as_response: bool, reward_range: tuple[float, float]) -> Feedback:
    fields: dict[str, Any] = {"reward": reward, "components": {component[:MAX_NAME_CHARS]: reward},
                              "feedback_id": feedback_id}
    if target.session_id is not None:
        fields["session_id"] = target.session_id
    elif as_response:
        fields["response_id"] = target.trajectory_or_response
    else:
        fields["trajectory_id"] = target.trajectory_or_response
    return Feedback.model_validate(fields, context={RANGE_CONTEXT: reward_range})


def _error(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status, **extra}},
                        status_code=status)


def _invalid(what: str, exc: ValidationError | FeedbackShapeError) -> JSONResponse:
    """422 for a body that does not make a reward: pydantic's problems listed by field, or the shape's own reason."""
    if isinstance(exc, FeedbackShapeError):
        return _error(422, f"invalid {what}: {exc}")
    problems = validation_problems(exc.errors())
    return _error(422, f"invalid {what}: " + "; ".join(f"{p['field']}: {p['problem']}" for p in problems),
                  problems=problems)


class LangSmithUpdate(BaseModel):
    """Body of LangSmith's ``PATCH /feedback/{feedback_id}`` (``Client.update_feedback``)."""

    model_config = ConfigDict(extra="allow")
    score: float | bool | None = None
    value: float | bool | str | None = None
    correction: Any = None
    comment: str | None = None


class FeedbackShapes:
    """The observability tools' feedback routes of one gateway; each feedback goes through ``accept`` (the rules of
    ``/v1/feedback``, :meth:`FeedbackEndpoint.accept`). LangSmith's updates name only the feedback id: the run and
    key of each recent feedback id are kept per tenant (bounded per tenant, oldest out first; shared by every
    gateway on the same Redis, like the ids of :mod:`rlstream.gateway.shared_ids`) to address them; a tenant only
    ever reaches its own."""

    def __init__(self, gateway: Gateway, accept: Callable[[Request, Feedback], Awaitable[Response]]) -> None:
        self.gateway = gateway
        self.accept = accept
        self._langsmith = TenantMap("langsmith", gateway.config.policy, gateway.config.reward_window_s,
                                    gateway.config.remembered_trajectories, gateway.shared_ids.control)

    def _tenant(self, request: Request) -> str:
        """The tenant a feedback request speaks for, decided by its credential as ``/v1/feedback`` decides it (the
        feedback token, else the key); :class:`AuthRefusal` (401) without a valid one."""
        token = request.headers.get(FEEDBACK_TOKEN_HEADER) or request.scope.get(BEARER_TOKEN_KEY)
        if token:
            return self.gateway.grant(token, request).tenant
        caller: Principal | None = request.scope.get(PRINCIPAL_KEY, OPEN)
        if caller is None:
            raise unauthorized("feedback needs the response's feedback token (x-rlstream-feedback-token) or an API "
                               "key with the feedback scope", "missing_api_key")
        return caller.tenant

    @property
    def categories(self) -> dict[str, float]:
        return dict(self.gateway.config.feedback_categories)

    async def _submit(self, request: Request, target: Target, reward: float, component: str,
                feedback_id: str | None) -> Response:
        """Publish through the gateway's feedback rules; an id that names no trajectory is tried as a response id."""
        reward_range = self.gateway.access.reward_range
        try:
            fb = _feedback(target, reward, component, feedback_id, False, reward_range)
        except ValidationError as exc:
            return _invalid("feedback", exc)
        answer: Response = await self.accept(request, fb)
        if answer.status_code == 404 and target.session_id is None:
            answer = await self.accept(request, _feedback(target, reward, component, feedback_id, True,
                                                                     reward_range))
        return answer

    async def _body(self, request: Request) -> Any:
        return parse_json(await request.body(), self.gateway.config.max_json_depth)

    async def langfuse_score(self, request: Request) -> Response:
        """``POST /api/public/scores``: a Langfuse score as a reward."""
        try:
            score = LangfuseScore.model_validate(await self._body(request))
            target_id = score.observation_id or score.trace_id
            if not target_id and not score.session_id:
                raise FeedbackShapeError("name traceId, observationId or sessionId")
            value = score.value
            if score.data_type == "CATEGORICAL" and not isinstance(value, str):
                raise FeedbackShapeError("a CATEGORICAL score's value is a string")
            reward = reward_of(value, self.categories)
        except (ValidationError, FeedbackShapeError) as exc:
            return _invalid("score", exc)
        target = Target(session_id=score.session_id) if not target_id else Target(target_id)
        answer = await self._submit(request, target, reward, score.name, score.id)
        if answer.status_code >= 400:
            return answer
        return JSONResponse({"id": score.id, "rlstream": _accepted(answer)}, status_code=200)

    async def langsmith_feedback(self, request: Request) -> Response:
        """``POST /feedback``: a LangSmith feedback as a reward."""
        try:
            feedback = LangSmithFeedback.model_validate(await self._body(request))
            if feedback.score is not None:
                reward = reward_of(feedback.score, self.categories)
            elif feedback.value is not None:
                reward = reward_of(feedback.value, self.categories)
            else:
                raise FeedbackShapeError("a feedback without score or value carries no reward (a correction alone "
                                         "is not one)")
        except (ValidationError, FeedbackShapeError) as exc:
            return _invalid("feedback", exc)
        feedback_id = feedback.id or feedback.feedback_id
        answer = await self._submit(request, Target(feedback.run_id), reward, feedback.key, feedback_id)
        if answer.status_code >= 400:
            return answer
        if feedback_id is not None:
            await self._langsmith.put(self._tenant(request), {feedback_id: json.dumps([feedback.run_id, feedback.key])})
        return JSONResponse({"id": feedback_id, "run_id": feedback.run_id, "key": feedback.key, "score": reward,
                             "rlstream": _accepted(answer)}, status_code=200)

    async def langsmith_update(self, request: Request) -> Response:
        """``PATCH /feedback/{feedback_id}``: a LangSmith feedback's new score, a correction of its reward."""
        feedback_id = request.path_params["feedback_id"]
        known = _run_and_key(await self._langsmith.get(self._tenant(request), feedback_id))  # credential first
        if known is None:
            return _error(404, f"unknown feedback {feedback_id[:MAX_ID_CHARS]!r}", "not_found")
        try:
            update = LangSmithUpdate.model_validate(await self._body(request))
            given = update.score if update.score is not None else update.value
            if given is None:
                raise FeedbackShapeError("an update without score or value changes no reward")
            reward = reward_of(given, self.categories)
        except (ValidationError, FeedbackShapeError) as exc:
            return _invalid("feedback", exc)
        run_id, key = known
        answer = await self._submit(request, Target(run_id), reward, key, feedback_id)
        if answer.status_code >= 400:
            return answer
        return JSONResponse({"id": feedback_id, "run_id": run_id, "key": key, "score": reward,
                             "rlstream": _accepted(answer)}, status_code=200)

    async def otlp_logs(self, request: Request) -> Response:
        """``POST /v1/logs`` (OTLP/HTTP JSON): ``gen_ai.evaluation.result`` events as rewards. Answered as OTLP
        does: 200 with ``partialSuccess`` naming the records that were rejected and why."""
        content_type = request.headers.get("content-type", "")
        if "json" not in content_type:
            return _error(415, "OTLP/HTTP logs are accepted as JSON (content-type: application/json)",
                          "unsupported_media_type")
        body = await self._body(request)
        try:
            records = evaluation_records(body)
        except FeedbackShapeError as exc:
            return _error(400, f"invalid OTLP logs: {exc}")
        cap = self.gateway.config.max_rewards_per_request
        if len(records) > cap:
            return _error(413, f"{len(records)} evaluation records in one request (at most {cap}, "
                          "gateway.max_rewards_per_request)", "request_too_large")
        rejected: list[str] = []
        for record in records:
            problem = await self._otlp_record(request, record)
            if problem is not None:
                rejected.append(problem)
        answer: dict[str, Any] = {}
        if rejected:
            log.info("OTLP evaluation records rejected", count=len(rejected), first=rejected[0][:200])
            answer["partialSuccess"] = {"rejectedLogRecords": len(rejected), "errorMessage": "; ".join(rejected)[:2000]}
        return JSONResponse(answer, status_code=200)

    async def _otlp_record(self, request: Request, attributes: dict[str, Any]) -> str | None:
        response_id = attributes.get(ATTR_RESPONSE_ID)
        if not isinstance(response_id, str) or not response_id:
            return f"an {EVALUATION_EVENT} record without {ATTR_RESPONSE_ID}"
        name = attributes.get(ATTR_NAME)
        name = name if isinstance(name, str) and name else DEFAULT_COMPONENT
        try:
            score = attributes.get(ATTR_SCORE)
            reward = reward_of(score if score is not None else attributes.get(ATTR_LABEL), self.categories)
        except FeedbackShapeError as exc:
            return f"{response_id[:64]}: {exc}"
        feedback_id = f"otel:{response_id}:{name}"[:MAX_ID_CHARS]
        try:
            fb = Feedback.model_validate({"response_id": response_id, "reward": reward,
                                          "components": {name[:MAX_NAME_CHARS]: reward}, "feedback_id": feedback_id},
                                         context={RANGE_CONTEXT: self.gateway.access.reward_range})
        except ValidationError as exc:
            return f"{response_id[:64]}: " + "; ".join(p["problem"] for p in validation_problems(exc.errors()))
        answer = await self.accept(request, fb)
        if answer.status_code >= 400:
            return f"{response_id[:64]}: not accepted ({answer.status_code})"
        return None


def _run_and_key(text: str | None) -> tuple[str, str] | None:
    """The (run id, key) a LangSmith feedback id was given with."""
    try:
        run_id, key = json.loads(text) if text is not None else (None, None)
    except (ValueError, TypeError):
        return None
    return (str(run_id), str(key)) if run_id is not None else None


def _accepted(answer: Response) -> Any:
    """The gateway's own answer (trajectory id, queued) inside a shape's answer."""
    try:
        return json.loads(bytes(answer.body))
    except ValueError:
        return None


def _any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a Python value."""
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


def _attributes(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("key"), str):
                out[item["key"]] = _any_value(item.get("value"))
    return out


def evaluation_records(body: Any) -> list[dict[str, Any]]:
    """The attributes of each ``gen_ai.evaluation.result`` log record of an OTLP/HTTP JSON logs request (the event
    name in the record's ``eventName`` or its ``event.name`` attribute)."""
    if not isinstance(body, dict) or not isinstance(body.get("resourceLogs"), list):
        raise FeedbackShapeError("a logs request is an object with a resourceLogs list")
    found: list[dict[str, Any]] = []
    seen = 0
    for resource in body["resourceLogs"]:
        for scope in (resource.get("scopeLogs") or []) if isinstance(resource, dict) else []:
            for record in (scope.get("logRecords") or []) if isinstance(scope, dict) else []:
                seen += 1
                if seen > MAX_LOG_RECORDS:
                    raise FeedbackShapeError(f"more than {MAX_LOG_RECORDS} log records in one request")
                if not isinstance(record, dict):
                    continue
                attributes = _attributes(record.get("attributes"))
                if (record.get("eventName") or attributes.get("event.name")) == EVALUATION_EVENT:
                    found.append(attributes)
    return found
