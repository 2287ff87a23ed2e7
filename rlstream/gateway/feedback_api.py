"""``POST /v1/feedback``, and the rules every feedback shape (``feedback_shapes.py``) goes through to become a
RewardEvent: the holder of the trajectory's feedback token, or a key with the feedback scope of the same tenant,
names a trajectory (by its id, the response id of its body, the trace or span id of its call, its session, or the
token alone). The ids are looked up in this gateway's memory, then in the state every gateway shares
(:mod:`rlstream.gateway.shared_ids`); a trajectory token carries what its reward needs."""
from __future__ import annotations

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlstream.gateway.auth import BEARER_TOKEN_KEY, OPEN, PRINCIPAL_KEY, Principal, unauthorized
from rlstream.gateway.core import FEEDBACK_TOKEN_HEADER, Gateway, openai_error
from rlstream.gateway.feedback import RANGE_CONTEXT, Feedback, validation_problems
from rlstream.gateway.limits import parse_json
from rlstream.gateway.feedback_tokens import FeedbackGrant
from rlstream.gateway.feedback_window import CorrectionWindow
from rlstream.gateway.sessions import KnownTrajectory
from rlstream.gateway.shared_ids import TenantMap, loads_known
from rlstream.schemas.models import CallEvent, CallKind, RewardEvent


class FeedbackEndpoint:
    """``/v1/feedback`` of one gateway, and :meth:`accept` for the other shapes. Another tenant's trajectory answers
    exactly as one that does not exist."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.corrections = CorrectionWindow(gateway.config.correction_window_s, TenantMap(
            "feedback-ids", gateway.config.policy, gateway.config.reward_window_s,
            gateway.config.remembered_trajectories, gateway.shared_ids.control))

    async def serve(self, request: Request) -> Response:
        raw = parse_json(await request.body(), self.gw.config.max_json_depth)
        try:
            fb = Feedback.model_validate(raw, context={RANGE_CONTEXT: self.gw.access.reward_range})
        except ValidationError as exc:
            problems = validation_problems(exc.errors())
            text = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
            return openai_error(422, f"invalid feedback: {text}", problems=problems)
        return await self.accept(request, fb)

    async def accept(self, request: Request, fb: Feedback) -> Response:
        """Publish the RewardEvent of a validated feedback under the rules: the feedback token, or a key of the
        trajectory's tenant."""
        gw = self.gw
        token = request.headers.get(FEEDBACK_TOKEN_HEADER) or fb.feedback_token or request.scope.get(
            BEARER_TOKEN_KEY)
        caller: Principal | None = request.scope.get(PRINCIPAL_KEY, OPEN)
        granted: str | None = None  # the trajectory a token names
        grant: FeedbackGrant | None = None
        if token:
            grant = gw.grant(token, request)
            tenant = grant.tenant
            if grant.kind == "trajectory":
                granted = grant.target_id
            elif gw.stitch_in_streams:  # a session token: the stitcher knows the session's latest trajectory
                return self._session_feedback(grant.target_id, fb)
            else:  # a session token (its id already scoped): the session's latest trajectory
                latest = gw.sessions.lookup(session_id=grant.target_id)
                granted = latest.trajectory_id if latest is not None else ""
        elif caller is None:
            raise unauthorized("feedback needs the response's feedback token (x-rlstream-feedback-token) or an API "
                               "key with the feedback scope", "missing_api_key")
        else:
            tenant = caller.tenant
        if granted is None and not (fb.trajectory_id or fb.response_id or fb.session_id):
            problem = "name trajectory_id, response_id or session_id, or send the response's feedback token"
            return openai_error(422, f"invalid feedback: {problem}", problems=[{"field": "(body)",
                                                                               "problem": problem}])
        if gw.stitch_in_streams and granted is None and fb.session_id and not (fb.trajectory_id or fb.response_id):
            return self._session_feedback(gw.scoped(tenant, fb.session_id), fb)
        known = await self._target(fb, tenant, granted, grant)
        if known is None:
            what = (f"trajectory {fb.trajectory_id!r}" if fb.trajectory_id else f"response {fb.response_id!r}"
                    if fb.response_id else f"session {fb.session_id!r}" if fb.session_id else "trajectory")
            return openai_error(404, f"unknown {what}", "not_found")
        if known.group_id == known.trajectory_id and await self.corrections.too_late(
                tenant, known.trajectory_id, fb.feedback_id, self._captured_at(known, grant)):
            return openai_error(409, f"feedback {fb.feedback_id!r} was already given for this response and its "
                                f"correction window ({self.corrections.window_s:g} s after the call, "
                                "streams.reward.correction_window_s) has passed: the reward it set has been trained "
                                "on, a correction would never be", "correction_window_closed")
        still_open = gw.sessions.open_trajectory(known.trajectory_id)
        if still_open is not None:  # it will carry the reward itself too
            still_open.reward, still_open.reward_components = fb.reward, dict(fb.components)
        event = RewardEvent(trajectory_id=known.trajectory_id, group_id=known.group_id, example_id=known.example_id,
                            run_id=gw.config.run_id, reward=fb.reward, components=dict(fb.components),
                            feedback_id=fb.feedback_id)
        queued = gw.capture.put(event, tenant)  # within the caller's tenant's share of the queue and spool
        if queued:
            await self.corrections.accepted(tenant, known.trajectory_id, fb.feedback_id)
        return JSONResponse({"trajectory_id": known.trajectory_id, "queued": queued},
                            status_code=202 if queued else 503)

    def _captured_at(self, known: KnownTrajectory, grant: FeedbackGrant | None) -> float | None:
        """When the trajectory was captured: from the id map, else from its feedback token (issued at the call,
        valid for the token lifetime from then); None when neither says."""
        if known.captured_at:
            return known.captured_at
        if grant is not None and grant.kind == "trajectory" and grant.target_id == known.trajectory_id:
            return grant.expires_at - self.gw.access.feedback_token_ttl_s
        return None

    def _session_feedback(self, scoped_session: str, fb: Feedback) -> Response:
        """A reward for a session's latest trajectory, through ``calls``: the stream app's stitcher gives it to the
        open trajectory, or publishes the RewardEvent of the last one, or keeps it for the first one."""
        gw = self.gw
        queued = gw.publish_call(CallEvent(
            session_id=scoped_session, kind=CallKind.feedback, tenant=gw.tenant_of(scoped_session),
            run_id=gw.config.run_id, policy=gw.config.policy, reward=fb.reward,
            reward_components=dict(fb.components), feedback_id=fb.feedback_id, gateway_id=gw.gateway_id))
        return JSONResponse({"session_id": gw.client_session(scoped_session), "queued": queued},
                            status_code=202 if queued else 503)

    async def _target(self, fb: Feedback, tenant: str, granted: str | None,
                      grant: FeedbackGrant | None) -> KnownTrajectory | None:
        """The trajectory ``fb`` rewards, when it exists and belongs to ``tenant`` (and is the one a token
        grants); None otherwise, whichever the reason."""
        gw = self.gw
        if fb.trajectory_id:
            trajectory_id: str | None = fb.trajectory_id
        elif fb.response_id:
            trajectory_id = gw.feedback_index.response(tenant, fb.response_id)
        elif fb.session_id:
            known = gw.sessions.lookup(session_id=gw.scoped(tenant, fb.session_id))
            trajectory_id = known.trajectory_id if known is not None else None
        else:
            trajectory_id = granted
        if trajectory_id is not None and (granted is None or trajectory_id == granted):
            owner = gw.feedback_index.owner(trajectory_id)
            if owner == tenant or owner is None and not gw.keys.enabled:
                local = gw.sessions.lookup(trajectory_id)
                if local is not None:
                    return local
        if (grant is not None and grant.example_id and granted and not (fb.response_id or fb.session_id)
                and (fb.trajectory_id or granted) == granted):
            return KnownTrajectory(granted, grant.example_id, grant.group_id)  # the token says it all
        name = fb.trajectory_id or fb.response_id or (granted if not fb.session_id else None)
        if name is None or not gw.shared_ids.shared:
            return None
        shared = loads_known(await gw.shared_ids.get(tenant, name))  # the tenant's own ids only
        if shared is None or granted is not None and shared.trajectory_id != granted:
            return None
        return shared
