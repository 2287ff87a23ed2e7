"""Feedback in the shapes observability tools already send, each published as a RewardEvent like ``/v1/feedback``.

* Langfuse's score API, ``POST /api/public/scores``: one score, or a JSON list of them (the Python SDK 3.x-5.x batches
  ``create_score`` that way); ``traceId`` / ``observationId`` (a trajectory id or a response id) or ``sessionId``;
  ``name`` (the reward's component); ``value`` with its ``dataType`` checked as Langfuse checks it
  (:mod:`rlstream.gateway.feedback_scores`); ``comment``; ``id`` (the feedback id: a repeated id corrects the score;
  created when the score has none, and returned as Langfuse returns it). One score: 200 ``{"id"}``; a list: 202 when
  every score was taken, 207 ``{accepted, rejected, errors}`` when some were not (the SDK logs them), 400 when none
  was. Langfuse's batch ingestion, ``POST /api/public/ingestion`` (SDKs 2.x-3.x): each ``score-create`` event is a
  score; the answer is Langfuse's 207 with ``successes`` and ``errors`` per event (events of other types are errors:
  the gateway keeps no traces). Langfuse's clients authenticate with Basic ``public:secret``: the secret is the
  gateway key (or a feedback token).
* LangSmith's feedback, ``POST /feedback`` (also ``/api/v1/feedback``): ``run_id`` (a trajectory id: the UUID in
  ``x-rlstream-trajectory-id``, which ``Client.create_feedback`` accepts; or a response id), ``key`` (the
  component), ``score`` (number or boolean) or a categorical ``value``, under its ``feedback_config`` (ranges put on
  [0, 1], categories mapped), ``correction``, ``comment``, ``id`` / ``feedback_id`` (the feedback id);
  ``PATCH /feedback/{id}`` (``Client.update_feedback``) corrects it under the same config. ``GET /info`` answers
  what the client asks at start (no key needed: it names no tenant's data). LangSmith's clients send their key as
  ``x-api-key``.
* OpenTelemetry's ``gen_ai.evaluation.result`` events over OTLP/HTTP, ``POST /v1/logs``, protobuf or JSON, gzip or
  not (:mod:`rlstream.gateway.feedback_otlp`): each log record with that event name and a ``gen_ai.response.id``
  attribute (the response id the gateway returned, ``chatcmpl-...`` / ``resp_...``, or a trajectory id) is a reward:
  ``gen_ai.evaluation.score.value``, else ``gen_ai.evaluation.score.label`` through the categories table;
  ``gen_ai.evaluation.name`` is the component. Its feedback id is ``otel:<response id>:<name>``: the same evaluator
  scoring the same response again corrects its score. Other log records are ignored. A request with an evaluation
  record the gateway cannot use is answered 400 naming it (the others were taken): the OTLP exporters ignore a 200's
  ``partial_success``, so a 200 would drop the score unseen.

A categorical value becomes a reward through the gateway's table (the ``gateway.feedback_categories`` setting); an
unknown category is refused rather than guessed. A refused feedback is a 4xx the client surfaces, never a 2xx.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlstream.gateway.feedback import (MAX_ID_CHARS, MAX_NAME_CHARS, RANGE_CONTEXT, Feedback,
                                               validation_problems)
from rlstream.gateway.auth import BEARER_TOKEN_KEY, OPEN, PRINCIPAL_KEY, Principal, unauthorized
from rlstream.gateway.core import FEEDBACK_TOKEN_HEADER, Gateway
from rlstream.gateway.feedback_otlp import (EVALUATION_EVENT, JSON_TYPE, PROTOBUF, OtlpRequestError, decompressed,
                                            evaluation_records, media_type, success_body)
from rlstream.gateway.feedback_scores import (FeedbackConfig, FeedbackShapeError, langfuse_reward, langsmith_reward,
                                             reward_of)
from rlstream.gateway.limits import parse_json
from rlstream.gateway.shared_ids import TenantMap
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: the OpenTelemetry GenAI semantic-convention attributes of an evaluation result event
ATTR_RESPONSE_ID = "gen_ai.response.id"
ATTR_NAME = "gen_ai.evaluation.name"
ATTR_SCORE = "gen_ai.evaluation.score.value"
ATTR_LABEL = "gen_ai.evaluation.score.label"
#: component name of a feedback that names none
DEFAULT_COMPONENT = "feedback"


class LangfuseScore(BaseModel):
    """Body of Langfuse's ``POST /api/public/scores`` (the fields rlstream uses; the others are accepted)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    trace_id: str | None = Field(None, alias="traceId", max_length=MAX_ID_CHARS)
    observation_id: str | None = Field(None, alias="observationId", max_length=MAX_ID_CHARS)
    session_id: str | None = Field(None, alias="sessionId", max_length=MAX_ID_CHARS)
    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    value: float | bool | str
    data_type: str | None = Field(None, alias="dataType", max_length=32)
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
    feedback_config: FeedbackConfig | None = None


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

    async def _langfuse_one(self, request: Request, raw: Any) -> tuple[int, str | None, str]:
        """One Langfuse score published: (status, its id, the problem when the status is not 2xx)."""
        try:
            score = LangfuseScore.model_validate(raw)
            target_id = score.observation_id or score.trace_id
            if not target_id and not score.session_id:
                raise FeedbackShapeError("name traceId, observationId or sessionId")
            reward = langfuse_reward(score.value, score.data_type, self.categories)
        except ValidationError as exc:
            return 400, None, "; ".join(f"{p['field']}: {p['problem']}" for p in validation_problems(exc.errors()))
        except FeedbackShapeError as exc:
            return 400, None, str(exc)
        score_id = score.id or str(uuid.uuid4())  # Langfuse creates the id of a score sent without one
        target = Target(session_id=score.session_id) if not target_id else Target(target_id)
        answer = await self._submit(request, target, reward, score.name, score_id)
        if answer.status_code >= 400:
            return answer.status_code, score_id, _message(answer)
        return 200, score_id, ""

    async def langfuse_score(self, request: Request) -> Response:
        """``POST /api/public/scores``: a Langfuse score, or a list of them, as rewards."""
        body = await self._body(request)
        if not isinstance(body, list):
            status, score_id, problem = await self._langfuse_one(request, body)
            if status >= 400:
                return _error(status, f"invalid score: {problem}" if status in (400, 422) else problem)
            return JSONResponse({"id": score_id}, status_code=200)
        if len(body) > self.gateway.config.max_rewards_per_request:
            return _error(413, f"{len(body)} scores in one request (at most "
                          f"{self.gateway.config.max_rewards_per_request}, gateway.max_rewards_per_request)",
                          "request_too_large")
        errors: list[dict[str, Any]] = []
        for index, raw in enumerate(body):
            status, score_id, problem = await self._langfuse_one(request, raw)
            if status >= 400:
                errors.append({"message": f"score {index} ({score_id or 'no id'}): {problem}", "status": status})
        if not errors:
            return JSONResponse({"message": "Accepted"}, status_code=202)
        log.info("Langfuse scores refused", count=len(errors), first=errors[0]["message"][:200])
        accepted = len(body) - len(errors)
        return JSONResponse({"accepted": accepted, "rejected": len(errors), "errors": errors},
                            status_code=207 if accepted else 400)

    async def langfuse_ingestion(self, request: Request) -> Response:
        """``POST /api/public/ingestion``: Langfuse's batch of events; each ``score-create`` is a score. Answered as
        Langfuse answers it: 207 with ``successes`` (``{id, status}``) and ``errors`` (``{id, status, message}``)."""
        body = await self._body(request)
        batch = body.get("batch") if isinstance(body, dict) else None
        if not isinstance(batch, list):
            return _error(400, "an ingestion request is an object with a batch list")
        if len(batch) > self.gateway.config.max_rewards_per_request:
            return _error(413, f"{len(batch)} events in one request (at most "
                          f"{self.gateway.config.max_rewards_per_request}, gateway.max_rewards_per_request)",
                          "request_too_large")
        successes: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for event in batch:
            event_id = str(event.get("id"))[:MAX_ID_CHARS] if isinstance(event, dict) else None
            kind = event.get("type") if isinstance(event, dict) else None
            if kind != "score-create" or not isinstance(event.get("body"), dict):
                errors.append({"id": event_id, "status": 400, "message": f"event type {str(kind)[:40]!r} not "
                               "taken: the rlstream gateway takes score-create events only", "error": "not a score"})
                continue
            status, _, problem = await self._langfuse_one(request, event["body"])
            if status >= 400:
                errors.append({"id": event_id, "status": status, "message": problem, "error": problem})
            else:
                successes.append({"id": event_id, "status": 201})
        return JSONResponse({"successes": successes, "errors": errors}, status_code=207)

    async def langsmith_info(self, request: Request) -> Response:
        """``GET /info``: what a LangSmith client asks at start (a server version; no ingest settings: the client
        keeps its defaults)."""
        return JSONResponse({"version": "0.10.0", "license_expiration_time": None, "instance_flags": {},
                             "batch_ingest_config": None})

    async def langsmith_feedback(self, request: Request) -> Response:
        """``POST /feedback``: a LangSmith feedback as a reward."""
        try:
            feedback = LangSmithFeedback.model_validate(await self._body(request))
            reward = langsmith_reward(feedback.score, feedback.value, feedback.feedback_config, self.categories)
        except (ValidationError, FeedbackShapeError) as exc:
            return _invalid("feedback", exc)
        feedback_id = feedback.id or feedback.feedback_id
        answer = await self._submit(request, Target(_run_id(feedback.run_id)), reward, feedback.key, feedback_id)
        if answer.status_code >= 400:
            return answer
        if feedback_id is not None:
            await self._langsmith.put(self._tenant(request), {feedback_id: json.dumps([feedback.run_id, feedback.key, feedback.feedback_config.model_dump(exclude_none=True)
                                  if feedback.feedback_config is not None else None])})
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
            if update.score is None and update.value is None:
                raise FeedbackShapeError("an update without score or value changes no reward")
            run_id, key, config = known
            reward = langsmith_reward(update.score, update.value, config, self.categories)
        except (ValidationError, FeedbackShapeError) as exc:
            return _invalid("feedback", exc)
        answer = await self._submit(request, Target(_run_id(run_id)), reward, key, feedback_id)
        if answer.status_code >= 400:
            return answer
        return JSONResponse({"id": feedback_id, "run_id": run_id, "key": key, "score": reward,
                             "rlstream": _accepted(answer)}, status_code=200)

    async def otlp_logs(self, request: Request) -> Response:
        """``POST /v1/logs`` (OTLP/HTTP, protobuf or JSON, gzip or not): ``gen_ai.evaluation.result`` events as
        rewards. 200 (an empty ExportLogsServiceResponse) when every evaluation record was taken; 400 naming the
        records that were not (415 for a body in another encoding)."""
        config = self.gateway.config
        try:
            kind = media_type(request.headers.get("content-type", ""))
            body = decompressed(await request.body(), request.headers.get("content-encoding", ""),
                                config.max_body_bytes)
            records = evaluation_records(body, kind, config.max_json_depth)
        except OtlpRequestError as exc:
            if exc.unsupported_media:
                return _error(415, str(exc), "unsupported_media_type")
            return _error(400, f"invalid OTLP logs: {exc}")
        cap = config.max_rewards_per_request
        if len(records) > cap:
            return _error(413, f"{len(records)} evaluation records in one request (at most {cap}, "
                          "gateway.max_rewards_per_request)", "request_too_large")
        rejected: list[str] = []
        for record in records:
            problem = await self._otlp_record(request, record)
            if problem is not None:
                rejected.append(problem)
        if rejected:
            log.info("OTLP evaluation records rejected", count=len(rejected), first=rejected[0][:200])
            return _error(400, f"{len(rejected)} of {len(records)} {EVALUATION_EVENT} records not taken (the others "
                          f"were): " + "; ".join(rejected)[:2000], rejectedLogRecords=len(rejected))
        return Response(success_body(kind), status_code=200, media_type=PROTOBUF if kind == PROTOBUF else JSON_TYPE)

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
        answer = await self._submit(request, Target(response_id[:MAX_ID_CHARS]), reward, name, feedback_id)
        if answer.status_code >= 400:
            return f"{response_id[:64]}: {_message(answer)}"
        return None


def _run_and_key(text: str | None) -> tuple[str, str, FeedbackConfig | None] | None:
    """The (run id, key, feedback_config) a LangSmith feedback id was given with."""
    try:
        run_id, key, *rest = json.loads(text) if text is not None else (None, None)
        config = FeedbackConfig.model_validate(rest[0]) if rest and rest[0] is not None else None
    except (ValueError, TypeError):
        return None
    return (str(run_id), str(key), config) if run_id is not None else None


def _run_id(run_id: str) -> str:
    """A LangSmith run id as the gateway's trajectory ids are written (a UUID in its canonical form)."""
    try:
        return str(uuid.UUID(run_id))
    except ValueError:
        return run_id  # a response id


def _message(answer: Response) -> str:
    """The error message of one of the gateway's own answers."""
    try:
        return str(json.loads(bytes(answer.body))["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"not accepted ({answer.status_code})"


def _accepted(answer: Response) -> Any:
    """The gateway's own answer (trajectory id, queued) inside a shape's answer."""
    try:
        return json.loads(bytes(answer.body))
    except ValueError:
        return None
