"""``rlstream export`` and ``rlstream import``: slices of ``trajectories`` as files other tools read, and back.

A slice is chosen as ``rlstream replay`` chooses one (:mod:`rlstream.ops.replay`: ``[from, to)`` as offsets,
``partition:offset`` pairs or ISO times; without ``to``, the end offsets of the moment the export starts), narrowed
by run, policy version, source, example and task (``metadata["task"]``). Formats:

* **Parquet** (``pyarrow``), one row per trajectory, in the conversational layout TRL and Hugging Face ``datasets``
  load directly: ``messages`` (role, content, name, tool_calls in OpenAI's ``{id, type, function: {name,
  arguments}}`` shape, tool_call_id), or with ``layout=prompt-completion`` ``prompt`` (the messages before the first
  assistant message) and ``completion`` (the rest) for GRPO / prompt-completion SFT; per-turn
  ``prompt_token_ids``, ``completion_token_ids``, ``completion_logprobs`` (list columns, one entry per turn) and
  ``turns`` (each turn's message index, model, trainable flag, finish reason, version, temperature); ``reward``,
  ``reward_components`` and ``metadata`` (JSON text), ids, run, policy version, source, task, and the record's
  ``kafka_partition`` / ``kafka_offset``; ``tools``, the captured tool schemas (``metadata["tools"]``). Tool-call
  arguments and tool schemas are Arrow JSON (``datasets`` gives objects; arguments that are not JSON stay a
  string). ``layout=dpo`` / ``layout=kto`` make TRL's conversational preference rows from each group
  (:func:`preference_rows`). A trajectory id read twice is exported once.
* **ATIF** (:mod:`rlstream.ops.atif`), JSON Lines, one ATIF trajectory per line, token ids per step.

``rlstream import --format atif|parquet FILE`` publishes the trajectories of an ATIF file (JSON Lines, a JSON array
or one JSON object) or of a Parquet file (an export's rows, or rows with only ``messages``) to ``trajectories`` as
a new run with ``source = replay``: ids are re-derived as replay derives them
(uuid5 of new run + original id; ``group_id = "<new run>:<original group>"``), so importing a file twice gives the
same ids, and ``metadata`` keeps ``replay_of_trajectory_id`` / ``replay_of_run_id`` / ``replay_of_group_id`` /
``replay_of_source`` and ``imported_from`` (``file:record``). A record that is not JSON, not valid ATIF, has no
faithful trajectory, or breaks the ingest rules (:func:`rlstream.streams.validation.validate_trajectory`, with the
config's group-size and reward bounds) goes to ``dlq`` with the reason (source ``file:<path>``, offset = its record
number: the line number from 0 in JSON Lines, the element index in an array; value = its JSON text).
"""
from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from rlstream.ops.replay import (Position, ReplayError, ReplayFilter, replay_group_id, replay_trajectory_id,
                                 resolve_slice)
from rlstream.schemas.codec import CodecError, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import (TOOLS_METADATA_KEY, Message, MetricEvent, ToolCall, TrajectoryEvent,
                                     TrajectorySource, Turn)
from rlstream.schemas.sampling import TemperatureRange
from rlstream.schemas.topics import TopicNames
from rlstream.streams.validation import RewardRange, validate_trajectory
from rlstream.transport import metric_names
from rlstream.transport.deadletter import dead_letter, send_dead_letter
from rlstream.transport.kafka import make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.topic_reader import SourceRecord, TopicReader, open_reader, read_slice

if TYPE_CHECKING:
    import pyarrow as pa

log = get_logger(__name__)
SERVICE = "import"
#: rows per Parquet row group (and per write), which bounds the memory an export of any size takes
PARQUET_BATCH_ROWS = 1000


class ExportFormat(str, Enum):
    parquet = "parquet"
    atif = "atif"


class ImportFormat(str, Enum):
    atif = "atif"
    parquet = "parquet"


class ParquetLayout(str, Enum):
    """``messages``: TRL's conversational language-modeling layout; ``prompt-completion``: TRL's conversational
    prompt-completion layout (GRPO's prompts, SFT on completions only); ``dpo``: TRL's conversational preference
    layout (``prompt``/``chosen``/``rejected``, the best and the worst member of each group); ``kto``: TRL's
    conversational unpaired preference layout (``prompt``/``completion``/``label``, label = reward above the
    group's mean)."""

    messages = "messages"
    prompt_completion = "prompt-completion"
    dpo = "dpo"
    kto = "kto"

    @property
    def preference(self) -> bool:
        return self in (ParquetLayout.dpo, ParquetLayout.kto)


@dataclass(frozen=True)
class ExportFilter(ReplayFilter):
    """Which trajectories of the slice are exported: :class:`ReplayFilter`'s rules plus the task."""

    tasks: frozenset[str] = frozenset()

    def accepts(self, event: TrajectoryEvent) -> bool:
        if self.tasks and event.metadata.get("task") not in self.tasks:
            return False
        return super().accepts(event)


@dataclass
class ExportReport:
    """What an export did; ``ranges`` maps partition -> [first, stop)."""

    path: str
    format: str
    topic: str
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)
    read: int = 0
    written: int = 0
    filtered: int = 0
    undecodable: int = 0
    #: records of a trajectory already exported (the same trajectory id): exported once
    duplicates: int = 0
    turns: int = 0
    token_ids: int = 0
    #: preference layouts: the groups seen, and those that gave no row (fewer than two rewarded members, or
    #: every reward equal)
    groups: int = 0
    groups_without_preference: int = 0

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["ranges"] = {str(p): list(r) for p, r in self.ranges.items()}
        return out


# --- reading the slice ------------------------------------------------------------------------------------
async def selected_trajectories(
    cfg: RlstreamConfig, report: ExportReport, start: Position | None, stop: Position | None,
    selection: ExportFilter,
) -> AsyncIterator[tuple[TrajectoryEvent, SourceRecord]]:
    """The trajectories of ``[start, stop)`` that ``selection`` accepts, with their records; counts into
    ``report``. A record that does not decode is counted and logged (the stream app dead-letters it; a read-only
    export does not write to ``dlq``)."""
    codec = codec_for(cfg)
    topic = TopicNames.from_config(cfg.topics).trajectories

    def undecodable(source: SourceRecord, reason: BaseException | str) -> None:
        log.warning("record not exported: it does not decode", topic=source.topic, partition=source.partition,
                    offset=source.offset, error=str(reason))

    consumer = await open_reader(cfg.kafka)
    try:
        ranges = await resolve_slice(consumer, topic, start, stop)
        report.ranges = {tp.partition: r for tp, r in ranges.items()}
        reader = TopicReader(consumer, codec, TrajectoryEvent, errors=(CodecError, ValidationError),
                             on_reject=undecodable)
        exported: set[str] = set()
        async for item in reader.stream(read_slice(consumer, {tp: r[0] for tp, r in ranges.items()},
                                                   {tp: r[1] for tp, r in ranges.items()})):
            if not selection.accepts(item.event):
                report.filtered += 1
                continue
            # a trajectory published twice (an import of the same file repeated, a producer's retry) is one row
            if item.event.trajectory_id in exported:
                report.duplicates += 1
                continue
            exported.add(item.event.trajectory_id)
            report.turns += len(item.event.turns)
            report.token_ids += sum(len(t.prompt_token_ids or ()) + len(t.completion_token_ids or ())
                                    for t in item.event.turns)
            yield item.event, item.source
        report.read, report.undecodable = reader.seen, reader.rejected
    finally:
        await consumer.stop()


async def export_trajectories(
    cfg: RlstreamConfig, path: Path, fmt: ExportFormat, start: Position | None = None, stop: Position | None = None,
    selection: ExportFilter | None = None, *, layout: ParquetLayout = ParquetLayout.messages,
) -> ExportReport:
    """Write the selected trajectories of ``[start, stop)`` to ``path`` as Parquet or ATIF JSON Lines."""
    selection = selection or ExportFilter()
    topic = TopicNames.from_config(cfg.topics).trajectories
    report = ExportReport(path=str(path), format=fmt.value, topic=topic)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written beside the target and renamed when complete: a failed export never leaves a file that looks whole
    partial = path.with_name(f".{path.name}.partial")
    try:
        async with aclosing(selected_trajectories(cfg, report, start, stop, selection)) as events:
            if fmt == ExportFormat.parquet:
                rows = (_preference_rows(events, layout, report) if layout.preference
                        else _trajectory_rows(events, layout))
                report.written = await _write_parquet(rows, partial, layout)
            else:
                report.written = await _write_atif(events, partial)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    log.info("export done", **{k: v for k, v in report.to_dict().items() if k != "ranges"})
    return report


# --- Parquet ----------------------------------------------------------------------------------------------
def parquet_schema(layout: ParquetLayout = ParquetLayout.messages) -> "pa.Schema":
    """The Arrow schema of an export (see the module docstring); tool-call arguments and tool schemas are Arrow's
    JSON extension type, which ``datasets`` decodes to objects."""
    import pyarrow as pa

    return _schema(layout, pa.json_())


def _schema(layout: ParquetLayout, json_type: "pa.DataType") -> "pa.Schema":
    """The schema with ``json_type`` for the JSON columns (the rows are built as text, then cast)."""
    import pyarrow as pa

    tool_call = pa.struct([("id", pa.string()), ("type", pa.string()),
                           ("function", pa.struct([("name", pa.string()), ("arguments", json_type)]))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string()),
                         ("tool_calls", pa.list_(tool_call)), ("tool_call_id", pa.string())])
    conversation = pa.list_(message)
    tools = ("tools", pa.list_(json_type))
    if layout == ParquetLayout.dpo:
        return pa.schema([
            ("prompt", conversation), ("chosen", conversation), ("rejected", conversation), tools,
            ("chosen_reward", pa.float64()), ("rejected_reward", pa.float64()),
            ("chosen_trajectory_id", pa.string()), ("rejected_trajectory_id", pa.string()),
            ("group_id", pa.string()), ("example_id", pa.string()), ("run_id", pa.string()), ("task", pa.string()),
        ])
    if layout == ParquetLayout.kto:
        return pa.schema([
            ("prompt", conversation), ("completion", conversation), ("label", pa.bool_()), tools,
            ("reward", pa.float64()), ("group_mean_reward", pa.float64()), ("trajectory_id", pa.string()),
            ("group_id", pa.string()), ("example_id", pa.string()), ("run_id", pa.string()), ("task", pa.string()),
            ("policy_version", pa.int64()),
        ])
    turn = pa.struct([("message_index", pa.int32()), ("model", pa.string()), ("function", pa.string()),
                      ("trainable", pa.bool_()), ("finish_reason", pa.string()), ("policy_version", pa.int64()),
                      ("temperature", pa.float64())])
    columns = ([("messages", conversation)] if layout == ParquetLayout.messages
               else [("prompt", conversation), ("completion", conversation)])
    return pa.schema([
        *columns,
        tools,
        ("prompt_token_ids", pa.list_(pa.list_(pa.int64()))),
        ("completion_token_ids", pa.list_(pa.list_(pa.int64()))),
        ("completion_logprobs", pa.list_(pa.list_(pa.float64()))),
        ("turns", pa.list_(turn)),
        ("reward", pa.float64()),
        ("reward_components", pa.string()),
        ("trajectory_id", pa.string()), ("run_id", pa.string()), ("example_id", pa.string()),
        ("group_id", pa.string()), ("group_size", pa.int32()), ("generation_index", pa.int32()),
        ("policy", pa.string()), ("policy_version", pa.int64()), ("source", pa.string()), ("task", pa.string()),
        ("target", pa.string()), ("metadata", pa.string()), ("created_at", pa.timestamp("ms", tz="UTC")),
        ("producer_id", pa.string()), ("kafka_partition", pa.int32()), ("kafka_offset", pa.int64()),
    ])


def split_conversation(event: TrajectoryEvent) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages before the first assistant message (the prompt) and the rest (the completion), as rows."""
    messages = [_openai_message(m) for m in event.messages]
    first = next((i for i, m in enumerate(event.messages) if m.role == "assistant"), len(messages))
    return messages[:first], messages[first:]


def parquet_row(event: TrajectoryEvent, record: SourceRecord | None = None,
                layout: ParquetLayout = ParquetLayout.messages) -> dict[str, Any]:
    """One trajectory as a row of :func:`parquet_schema` (``messages`` or ``prompt-completion``; JSON columns as
    JSON text)."""
    if layout == ParquetLayout.messages:
        conversation: dict[str, Any] = {"messages": [_openai_message(m) for m in event.messages]}
    elif layout == ParquetLayout.prompt_completion:
        prompt, completion = split_conversation(event)
        conversation = {"prompt": prompt, "completion": completion}
    else:
        raise ValueError(f"layout {layout.value} has one row per group, not per trajectory: use preference_rows")
    return {
        **conversation,
        "tools": tools_column(event),
        "prompt_token_ids": [t.prompt_token_ids for t in event.turns],
        "completion_token_ids": [t.completion_token_ids for t in event.turns],
        "completion_logprobs": [t.completion_logprobs for t in event.turns],
        "turns": [t.model_dump(exclude={"prompt_token_ids", "completion_token_ids", "completion_logprobs"})
                  for t in event.turns],
        "reward": event.reward,
        "reward_components": json.dumps(event.reward_components),
        "trajectory_id": event.trajectory_id, "run_id": event.run_id, "example_id": event.example_id,
        "group_id": event.group_id, "group_size": event.group_size, "generation_index": event.generation_index,
        "policy": event.policy, "policy_version": event.policy_version,
        "source": event.source.value if isinstance(event.source, TrajectorySource) else str(event.source),
        "task": event.metadata.get("task"), "target": event.target, "metadata": json.dumps(event.metadata),
        "created_at": event.created_at, "producer_id": event.producer_id,
        "kafka_partition": record.partition if record is not None else None,
        "kafka_offset": record.offset if record is not None else None,
    }


def preference_rows(group: Sequence[TrajectoryEvent], layout: ParquetLayout) -> list[dict[str, Any]]:
    """The ``dpo`` or ``kto`` rows of one group: DPO, one row from the best (chosen) and the worst (rejected)
    rewarded member; KTO, one row per rewarded member, ``label`` = its reward above the group's mean. Members
    without a finite reward are left out; a group with fewer than two left, or whose rewards are all equal, gives
    no row. Ties: the lowest generation index is the best / the worst. The prompt is the best member's."""
    rated = sorted((e for e in group if e.reward is not None and math.isfinite(e.reward)),
                   key=lambda e: e.generation_index)
    if len(rated) < 2:
        return []
    best = max(rated, key=lambda e: e.reward or 0.0)
    worst = min(rated, key=lambda e: e.reward or 0.0)
    if best.reward == worst.reward:
        return []
    ids = {"group_id": best.group_id, "example_id": best.example_id, "run_id": best.run_id,
           "task": best.metadata.get("task")}
    if layout == ParquetLayout.dpo:
        prompt, chosen = split_conversation(best)
        rejected = split_conversation(worst)[1]
        return [{"prompt": prompt, "chosen": chosen, "rejected": rejected,
                 "tools": _merged_tools_column([best, worst]), "chosen_reward": best.reward,
                 "rejected_reward": worst.reward, "chosen_trajectory_id": best.trajectory_id,
                 "rejected_trajectory_id": worst.trajectory_id, **ids}]
    if layout != ParquetLayout.kto:
        raise ValueError(f"layout {layout.value} is not a preference layout")
    mean = sum(e.reward or 0.0 for e in rated) / len(rated)
    prompt = split_conversation(best)[0]
    return [{"prompt": prompt, "completion": split_conversation(e)[1], "label": (e.reward or 0.0) > mean,
             "tools": tools_column(e), "reward": e.reward, "group_mean_reward": mean,
             "trajectory_id": e.trajectory_id, **ids, "policy_version": e.policy_version} for e in rated]


def tools_column(event: TrajectoryEvent) -> list[str] | None:
    """The captured tool schemas of ``event`` (``metadata["tools"]``) as JSON texts, one per tool; None: none
    captured (or metadata that is not a JSON list)."""
    return _merged_tools_column([event])


def _merged_tools_column(events: Sequence[TrajectoryEvent]) -> list[str] | None:
    texts: list[str] = []
    for event in events:
        raw = event.metadata.get(TOOLS_METADATA_KEY)
        if raw is None:
            continue
        try:
            tools = json.loads(raw)
        except ValueError:
            log.warning("tool schemas in metadata are not JSON; not exported", trajectory_id=event.trajectory_id)
            continue
        if isinstance(tools, list):
            texts.extend(t for t in (json.dumps(tool) for tool in tools) if t not in texts)
    return texts or None


def argument_json(arguments: str) -> str:
    """A tool call's arguments as the JSON text of the export's JSON column: the text itself when it is JSON (an
    object, as the chat templates expect), else the text as a JSON string (it stays a string)."""
    try:
        json.loads(arguments, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return json.dumps(arguments)
    return arguments


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _openai_message(message: Message) -> dict[str, Any]:
    tool_calls = None
    if message.tool_calls is not None:
        tool_calls = [{"id": c.id, "type": c.type,
                       "function": {"name": c.name, "arguments": argument_json(c.arguments)}}
                      for c in message.tool_calls]
    return {"role": message.role, "content": message.content, "name": message.name, "tool_calls": tool_calls,
            "tool_call_id": message.tool_call_id}


async def _trajectory_rows(events: AsyncIterator[tuple[TrajectoryEvent, SourceRecord]],
                           layout: ParquetLayout) -> AsyncIterator[dict[str, Any]]:
    async for event, record in events:
        yield parquet_row(event, record, layout)


async def _preference_rows(events: AsyncIterator[tuple[TrajectoryEvent, SourceRecord]], layout: ParquetLayout,
                           report: ExportReport) -> AsyncIterator[dict[str, Any]]:
    """The rows of each group, once all its members are read (``group_size``) or at the end of the slice; only
    the groups not yet whole are held in memory."""
    pending: dict[str, list[TrajectoryEvent]] = {}

    def rows_of(group: list[TrajectoryEvent]) -> list[dict[str, Any]]:
        rows = preference_rows(group, layout)
        report.groups += 1
        report.groups_without_preference += not rows
        return rows

    async for event, _ in events:
        members = pending.setdefault(event.group_id, [])
        members.append(event)
        if len(members) >= event.group_size:
            for row in rows_of(pending.pop(event.group_id)):
                yield row
    for group in pending.values():
        for row in rows_of(group):
            yield row


async def _write_parquet(rows: AsyncIterator[dict[str, Any]], path: Path, layout: ParquetLayout) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema, text_schema = parquet_schema(layout), _schema(layout, pa.string())
    written = 0
    batch: list[dict[str, Any]] = []

    def table() -> "pa.Table":
        return pa.Table.from_pylist(batch, schema=text_schema).cast(schema)

    with pq.ParquetWriter(str(path), schema) as writer:
        async for row in rows:
            batch.append(row)
            if len(batch) >= PARQUET_BATCH_ROWS:
                writer.write_table(table())
                written, batch = written + len(batch), []
        # an empty slice still writes a file with the schema (a reader gets zero rows, not an error)
        writer.write_table(table())
        written += len(batch)
    return written


# --- ATIF -------------------------------------------------------------------------------------------------
async def _write_atif(events: AsyncIterator[tuple[TrajectoryEvent, SourceRecord]], path: Path) -> int:
    from rlstream.ops.atif import to_atif

    written = 0
    with path.open("w", encoding="utf-8") as out:
        async for event, _ in events:
            out.write(json.dumps(to_atif(event).to_json_dict(), ensure_ascii=False) + "\n")
            written += 1
    return written


@dataclass(frozen=True)
class FileRecord:
    """One record of an import file: its number, its JSON text, and what it parsed to (None: not JSON)."""

    index: int
    raw: bytes
    value: Any
    error: str | None = None


def read_records(path: Path) -> Iterator[FileRecord]:
    """The records of an ATIF file, read as they come: JSON Lines (blank lines skipped), or a file that is one JSON
    array or one JSON object (a file starting with ``[``, or a ``{`` whose first line is not a whole object)."""
    with path.open("rb") as handle:
        head = handle.read(1 << 16).lstrip()
    if head.startswith(b"[") or (head.startswith(b"{") and _parse(head.split(b"\n", 1)[0])[1] is not None):
        raw = path.read_bytes()
        value, error = _parse(raw)
        if isinstance(value, list):
            for index, item in enumerate(value):
                yield FileRecord(index, json.dumps(item).encode(), item)
            return
        if isinstance(value, dict):
            yield FileRecord(0, raw, value)
            return
        if head.startswith(b"["):
            yield FileRecord(0, raw, None, f"the file is not a JSON array: {error or type(value).__name__}")
            return
        # not one JSON object either: JSON Lines whose first line is broken
    with path.open("rb") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            value, error = _parse(line.rstrip(b"\r\n"))
            yield FileRecord(index, line.rstrip(b"\r\n"), value,
                             None if error is None else f"line {index + 1} is not JSON: {error}")


def _parse(raw: bytes) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, why)`` for text that is not UTF-8 JSON (too deep a nesting included)."""
    try:
        return json.loads(raw.decode("utf-8")), None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return None, str(exc) or type(exc).__name__


@dataclass
class ImportReport:
    """What an import did."""

    path: str
    new_run_id: str
    topic: str
    records: int = 0
    published: int = 0
    dead_lettered: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    trajectory_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def imported_copy(event: TrajectoryEvent, new_run_id: str, origin: str) -> TrajectoryEvent:
    """``event`` as run ``new_run_id`` publishes it (ids derived as a replay derives them, source=replay)."""
    metadata = dict(event.metadata)
    metadata.update(replay_of_trajectory_id=event.trajectory_id, replay_of_run_id=event.run_id,
                    replay_of_group_id=event.group_id,
                    replay_of_source=event.source.value if isinstance(event.source, TrajectorySource)
                    else str(event.source),
                    imported_from=origin)
    return event.model_copy(update=dict(
        trajectory_id=replay_trajectory_id(new_run_id, event.trajectory_id), run_id=new_run_id,
        group_id=replay_group_id(new_run_id, event.group_id), source=TrajectorySource.replay, metadata=metadata,
        producer_id=SERVICE), deep=True)


class RejectedRecord(Exception):
    """An import record that is not published: ``error_type`` is the dead letter's reason code."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def atif_event(record: FileRecord, new_run_id: str, cfg: RlstreamConfig, origin: str) -> TrajectoryEvent:
    """The event an import publishes for ``record``, checked by the stream app's ingest rules with this config's
    bounds; raises :class:`RejectedRecord` with the reason."""
    from nat.atif import Trajectory

    from rlstream.ops.atif import AtifConversionError, from_atif

    if record.error is not None:
        raise RejectedRecord("invalid_json", record.error)
    try:
        trajectory = Trajectory.model_validate(record.value)
    except ValidationError as exc:
        raise RejectedRecord("invalid_atif", f"not a valid ATIF trajectory: {_short(exc)}") from None
    try:
        imported = from_atif(trajectory, default_policy=cfg.policy, default_run_id=new_run_id)
    except ValidationError as exc:
        raise RejectedRecord("invalid_atif", f"ATIF trajectory has no valid rlstream trajectory: {_short(exc)}") \
            from None
    except (AtifConversionError, RecursionError, TypeError, ValueError, KeyError, AttributeError) as exc:
        # the ``extra`` maps are free-form: a producer may put anything there
        raise RejectedRecord("invalid_atif", f"{type(exc).__name__}: {exc}") from None
    return _checked(imported_copy(imported.event, new_run_id, origin), cfg)


def _checked(event: TrajectoryEvent, cfg: RlstreamConfig) -> TrajectoryEvent:
    """``event`` when it passes the stream app's ingest rules with this config's bounds."""
    invalid = validate_trajectory(event, cfg.streams.min_allowed_group_size, cfg.streams.max_allowed_group_size,
                                  reward_range=RewardRange(*cfg.streams.reward_range),
                                  temperature_range=TemperatureRange(*cfg.streams.temperature_range))
    if invalid is not None:
        raise RejectedRecord(invalid.reason, invalid.message)
    return event


# --- Parquet import ---------------------------------------------------------------------------------------
_PARQUET_NAMESPACE = uuid.UUID("0d6c7f3a-52e1-4b8e-9f4e-6a1d2c9b7e15")


def read_parquet_records(path: Path) -> Iterator[FileRecord]:
    """The rows of a Parquet file, read a row group batch at a time; a file that is not Parquet raises
    ``ValueError`` (pyarrow's ``ArrowInvalid``) before any row."""
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(str(path)).iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            yield FileRecord(index, json.dumps(row, default=str, ensure_ascii=False).encode(), row)
            index += 1


def event_from_row(row: dict[str, Any], default_policy: str, default_run_id: str) -> TrajectoryEvent:
    """The TrajectoryEvent a row of an export (``messages`` or ``prompt-completion`` layout) describes; a row of
    another producer needs only ``messages`` (or ``prompt`` and ``completion``): the rest defaults (one trajectory
    per group, version 0, an id that is a uuid5 of the row's content). Raises ``ValueError`` / ``ValidationError``
    for a row that describes no trajectory."""
    if row.get("messages") is not None:
        raw_messages = list(row["messages"])
    elif row.get("prompt") is not None and row.get("completion") is not None:
        raw_messages = [*row["prompt"], *row["completion"]]
    else:
        raise ValueError("the row has no messages (nor prompt and completion)")
    messages = [_row_message(m) for m in raw_messages]
    turns = [Turn.model_validate({**(turn or {}), "prompt_token_ids": prompt, "completion_token_ids": completion,
                                  "completion_logprobs": logprobs})
             for turn, prompt, completion, logprobs in zip(
                 row.get("turns") or [], row.get("prompt_token_ids") or [], row.get("completion_token_ids") or [],
                 row.get("completion_logprobs") or [], strict=True)]
    metadata = _json_object(row.get("metadata"), "metadata")
    if row.get("task") is not None:
        metadata.setdefault("task", str(row["task"]))
    if row.get("tools") and TOOLS_METADATA_KEY not in metadata:
        metadata[TOOLS_METADATA_KEY] = json.dumps([_json_value(t) for t in row["tools"]], sort_keys=True)
    trajectory_id = row.get("trajectory_id") or str(uuid.uuid5(
        _PARQUET_NAMESPACE, json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)))
    fields: dict[str, Any] = {
        "trajectory_id": trajectory_id, "run_id": row.get("run_id") or default_run_id,
        "example_id": row.get("example_id") or trajectory_id, "group_id": row.get("group_id") or trajectory_id,
        "group_size": row.get("group_size") or 1, "generation_index": row.get("generation_index") or 0,
        "policy": row.get("policy") or default_policy, "policy_version": row.get("policy_version") or 0,
        "messages": messages, "turns": turns, "reward": row.get("reward"),
        "reward_components": _json_object(row.get("reward_components"), "reward_components"),
        "metadata": metadata, "target": row.get("target"), "producer_id": row.get("producer_id") or "",
    }
    for name in ("source", "created_at"):
        if row.get(name) is not None:
            fields[name] = row[name]
    return TrajectoryEvent.model_validate(fields)


def _row_message(raw: dict[str, Any]) -> Message:
    calls = raw.get("tool_calls")
    tool_calls = None if calls is None else [
        ToolCall(id=c.get("id") or "", type=c.get("type") or "function", name=(c.get("function") or {})["name"],
                 arguments=_argument_text((c.get("function") or {}).get("arguments")))
        for c in calls]
    return Message(role=raw["role"], content=raw.get("content"), name=raw.get("name"), tool_calls=tool_calls,
                   tool_call_id=raw.get("tool_call_id"))


def _argument_text(value: Any) -> str:
    """A tool call's arguments as the text rlstream keeps: the JSON text as written (an object), the string a JSON
    string holds (arguments that were not JSON), or an object written as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, str) else value
    return json.dumps(value)


def _json_value(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _json_object(value: Any, name: str) -> dict[str, Any]:
    value = _json_value(value) if value is not None else {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not a JSON object")
    return value


def parquet_event(record: FileRecord, new_run_id: str, cfg: RlstreamConfig, origin: str) -> TrajectoryEvent:
    """The event an import publishes for a Parquet row, checked like :func:`atif_event`; raises
    :class:`RejectedRecord` (``invalid_parquet``, or the ingest rule's reason)."""
    try:
        event = event_from_row(record.value, cfg.policy, new_run_id)
    except ValidationError as exc:
        raise RejectedRecord("invalid_parquet", f"the row has no valid rlstream trajectory: {_short(exc)}") \
            from None
    except (RecursionError, TypeError, ValueError, KeyError, AttributeError) as exc:
        raise RejectedRecord("invalid_parquet", f"{type(exc).__name__}: {exc}") from None
    return _checked(imported_copy(event, new_run_id, origin), cfg)


def _short(exc: ValidationError) -> str:
    errors = exc.errors()
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errors[:5])
    return shown + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else "")


async def import_atif(cfg: RlstreamConfig, path: Path, new_run_id: str) -> ImportReport:
    """Publish the ATIF trajectories of ``path`` to ``trajectories`` as run ``new_run_id``; bad records to
    ``dlq`` with the reason."""
    return await import_trajectories(cfg, path, new_run_id, ImportFormat.atif)


async def import_trajectories(cfg: RlstreamConfig, path: Path, new_run_id: str, fmt: ImportFormat) -> ImportReport:
    """Publish the trajectories of an ATIF or Parquet file to ``trajectories`` as run ``new_run_id``; bad records
    to ``dlq`` with the reason."""
    if not new_run_id.strip():
        raise ReplayError("the new run id is empty")
    names = TopicNames.from_config(cfg.topics)
    codec = codec_for(cfg)
    report = ImportReport(path=str(path), new_run_id=new_run_id, topic=names.trajectories)
    with path.open("rb"):
        pass  # a file that cannot be opened fails here, before anything is published
    records = read_records(path) if fmt == ImportFormat.atif else read_parquet_records(path)
    to_event = atif_event if fmt == ImportFormat.atif else parquet_event
    if fmt == ImportFormat.parquet:
        import pyarrow.parquet as pq

        pq.ParquetFile(str(path))  # a file that is not Parquet fails here too
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for record in records:
            report.records += 1
            origin = f"{path.name}:{record.index}"
            try:
                event = to_event(record, new_run_id, cfg, origin)
                encoded = codec.encode(event)
            except (RejectedRecord, CodecError) as exc:
                error_type = exc.error_type if isinstance(exc, RejectedRecord) else type(exc).__name__
                letter = dead_letter(topic=f"file:{path}", partition=0, offset=record.index, key=None,
                                     value=record.raw, error=exc, service=SERVICE, error_type=error_type)
                log.warning("import record rejected; sent to dlq", record=origin, error_type=error_type,
                            error=str(exc))
                await send_dead_letter(producer, codec, names.dlq, letter)
                report.dead_lettered += 1
                report.reasons[error_type] = report.reasons.get(error_type, 0) + 1
                continue
            await producer.send(names.trajectories, encoded, key=event.example_id.encode())
            report.published += 1
            report.trajectory_ids.append(event.trajectory_id)
        await producer.flush()
        tags = {"format": fmt.value}
        for metric in (MetricEvent(source=SERVICE, run_id=new_run_id, name=metric_names.IMPORT_PUBLISHED,
                                   value=float(report.published), tags=tags),
                       MetricEvent(source=SERVICE, run_id=new_run_id, name=metric_names.IMPORT_DEAD_LETTERED,
                                   value=float(report.dead_lettered), tags=tags)):
            await producer.send_and_wait(names.metrics, codec.encode(metric), key=SERVICE.encode())
    finally:
        await producer.stop()
    log.info("import done", path=str(path), new_run_id=new_run_id, records=report.records,
             published=report.published, dead_lettered=report.dead_lettered)
    return report
