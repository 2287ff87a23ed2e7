"""Typed Python models of the wire events (one per Avro record of ``avsc/``).

The Avro schemas are the contract; these models mirror them field for field so that
code builds events with types checked, and the codec turns them into bytes.
"""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from enum import Enum
from typing import Any, ClassVar, Iterable

from pydantic import BaseModel, ConfigDict, Field


def utc_now() -> datetime:
    """Current time, UTC, millisecond precision (what Avro timestamp-millis keeps)."""
    now = datetime.now(timezone.utc)
    return now.replace(microsecond=(now.microsecond // 1000) * 1000)


def new_id() -> str:
    return str(uuid.uuid4())


class WireModel(BaseModel):
    """Base of every wire record: ``avro_name`` names its schema in ``avsc/``."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False, validate_assignment=False)
    avro_name: ClassVar[str] = ""


class TrajectorySource(str, Enum):
    rollout = "rollout"
    production = "production"
    replay = "replay"
    validation = "validation"
    shadow = "shadow"  # a production prompt completed into a GRPO group by `rlstream rollout shadow`


class GroupCompletion(str, Enum):
    full = "full"
    timeout = "timeout"


class WeightsKind(str, Enum):
    lora = "lora"
    full = "full"


class ToolCall(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.ToolCall"
    id: str
    type: str = "function"
    name: str
    arguments: str = ""


class Message(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.Message"
    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Turn(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.Turn"
    message_index: int | None = None
    model: str | None = None
    function: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    trainable: bool = True
    finish_reason: str | None = None
    policy_version: int | None = None  # the version that produced this call (None: the trajectory's)
    temperature: float | None = None  # the sampling temperature of this call (None: 1.0)


#: ``TrajectoryEvent.metadata`` key of the tool schemas (OpenAI's ``tools``) the trajectory's calls offered: JSON text
#: of a list, each schema once, in the order first offered
TOOLS_METADATA_KEY = "tools"


def merged_tools(per_call: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The distinct tool schemas of a trajectory's calls, in the order they were first offered."""
    seen: set[str] = set()
    out = []
    for tools in per_call:
        for tool in tools:
            key = json.dumps(tool, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(tool)
    return out


class TrajectoryEvent(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.TrajectoryEvent"
    trajectory_id: str = Field(default_factory=new_id)
    run_id: str
    example_id: str
    group_id: str
    group_size: int
    generation_index: int
    policy: str
    policy_version: int
    source: TrajectorySource = TrajectorySource.rollout
    messages: list[Message]
    turns: list[Turn] = Field(default_factory=list)
    reward: float | None = None
    reward_components: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    target: str | None = None
    created_at: datetime = Field(default_factory=utc_now)
    producer_id: str = ""


class RewardEvent(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.RewardEvent"
    trajectory_id: str
    group_id: str
    example_id: str
    run_id: str = ""
    reward: float
    components: dict[str, float] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=utc_now)
    #: names a piece of feedback; a later reward with the same id corrects it (streams/assembly.py has the rule)
    feedback_id: str | None = None


class CallKind(str, Enum):
    call = "call"
    end = "end"  # the session ends: its open trajectory is published
    feedback = "feedback"  # a reward for the session's latest trajectory


class CallEvent(WireModel):
    """One LLM call of a session as a gateway captured it (topic ``calls``, keyed by session id); the stream app
    stitches a session's calls into trajectories (streams/stitching.py)."""

    avro_name: ClassVar[str] = "rlstream.v1.CallEvent"
    call_id: str = Field(default_factory=new_id)
    session_id: str
    kind: CallKind = CallKind.call
    tenant: str = ""
    task: str | None = None
    run_id: str = ""
    policy: str = ""
    policy_version: int = 0
    request_messages: list[Message] = Field(default_factory=list)
    response_message: Message | None = None
    turn: Turn | None = None
    served_model: str | None = None
    end_session: bool = False
    reward: float | None = None
    reward_components: dict[str, float] = Field(default_factory=dict)
    feedback_id: str | None = None
    created_at: datetime = Field(default_factory=utc_now)
    gateway_id: str = ""
    tools: str | None = None  # JSON text of the tool schemas (OpenAI's ``tools``) the call offered


class SourceOffset(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.SourceOffset"
    topic: str
    partition: int
    offset: int


class CurriculumInfo(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.CurriculumInfo"
    window: int
    rank: int
    percentile: float
    window_size: int = 0


class GroupBaseline(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.GroupBaseline"
    key: str  # "<policy>|<task>"
    method: str  # "window" (leave-one-out over the last K rewards) or "ema"
    mean: float
    std: float
    count: int  # rewards behind the baseline (0: nothing to compare with yet)


class TrajectoryGroup(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.TrajectoryGroup"
    group_id: str
    run_id: str
    example_id: str
    policy: str
    min_policy_version: int
    max_policy_version: int
    expected_size: int
    trajectories: list[TrajectoryEvent]
    reward_mean: float
    reward_std: float
    reward_min: float
    reward_max: float
    completion: GroupCompletion = GroupCompletion.full
    curriculum: CurriculumInfo | None = None
    assembled_at: datetime = Field(default_factory=utc_now)
    source_offsets: list[SourceOffset] = Field(default_factory=list)
    baseline: GroupBaseline | None = None


class FileDigest(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.FileDigest"
    path: str
    sha256: str
    size: int = 0


class OffsetRange(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.OffsetRange"
    topic: str
    partition: int
    first: int
    last: int


class PolicyVersion(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.PolicyVersion"
    policy: str
    version: int
    base_model: str
    kind: WeightsKind = WeightsKind.lora
    uri: str
    files: list[FileDigest] = Field(default_factory=list)
    learner_step: int
    group_count: int = 0
    trained_on: list[OffsetRange] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)
    run_id: str = ""
    fencing_token: int = 0
    created_at: datetime = Field(default_factory=utc_now)


class DecisionKind(str, Enum):
    """What a :class:`PromotionDecision` did to the serving pointer (``reject`` and ``canary`` leave it where it
    is; ``canary`` starts a canary share)."""

    promote = "promote"
    reject = "reject"
    canary = "canary"
    finish_canary = "finish_canary"
    rollback = "rollback"
    force_promote = "force_promote"


class PromotionDecision(WireModel):
    """One decision about the version production traffic gets (topic ``promotions``, keyed by policy)."""

    avro_name: ClassVar[str] = "rlstream.v1.PromotionDecision"
    policy: str
    version: int
    decision: DecisionKind
    reason: str = ""
    serving_before: int | None = None
    candidate_metrics: dict[str, float] = Field(default_factory=dict)
    serving_metrics: dict[str, float] = Field(default_factory=dict)
    decided_by: str = ""
    decided_at: datetime = Field(default_factory=utc_now)
    fencing_token: int = 0


class MetricEvent(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.MetricEvent"
    source: str
    run_id: str
    name: str
    value: float
    step: int | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    ts: datetime = Field(default_factory=utc_now)


class DeadLetter(WireModel):
    avro_name: ClassVar[str] = "rlstream.v1.DeadLetter"
    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None = None
    value: bytes | None = None
    error_type: str
    error_message: str
    service: str = ""
    ts: datetime = Field(default_factory=utc_now)


#: Top-level events, by Avro full name (the nested records are reached through them).
EVENT_MODELS: dict[str, type[WireModel]] = {
    m.avro_name: m
    for m in (TrajectoryEvent, RewardEvent, TrajectoryGroup, PolicyVersion, MetricEvent, DeadLetter, PromotionDecision,
              CallEvent)
}
