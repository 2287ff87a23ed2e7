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
  ``kafka_partition`` / ``kafka_offset``.
* **ATIF** (:mod:`rlstream.ops.atif`), JSON Lines, one ATIF trajectory per line, token ids per step.

``rlstream import --format atif FILE`` publishes the trajectories of an ATIF file (JSON Lines, a JSON array or one
JSON object) to ``trajectories`` as a new run with ``source = replay``: ids are re-derived as replay derives them
(uuid5 of new run + original id; ``group_id = "<new run>:<original group>"``), so importing a file twice gives the
same ids, and ``metadata`` keeps ``replay_of_trajectory_id`` / ``replay_of_run_id`` / ``replay_of_group_id`` /
``replay_of_source`` and ``imported_from`` (``file:record``). A record that is not JSON, not valid ATIF, has no
faithful trajectory, or breaks the ingest rules (:func:`rlstream.streams.validation.validate_trajectory`, with the
config's group-size and reward bounds) goes to ``dlq`` with the reason (source ``file:<path>``, offset = its record
number: the line number from 0 in JSON Lines, the element index in an array; value = its JSON text).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
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
from rlstream.schemas.models import Message, MetricEvent, TrajectoryEvent, TrajectorySource
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


class ParquetLayout(str, Enum):
    """``messages``: TRL's conversational language-modeling layout; ``prompt-completion``: TRL's conversational
    prompt-completion layout (GRPO's prompts, SFT on completions only)."""

    messages = "messages"
    prompt_completion = "prompt-completion"


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
    turns: int = 0
    token_ids: int = 0

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
        async for item in reader.stream(read_slice(consumer, {tp: r[0] for tp, r in ranges.items()},
                                                   {tp: r[1] for tp, r in ranges.items()})):
            if not selection.accepts(item.event):
                report.filtered += 1
                continue
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
                report.written = await _write_parquet(events, partial, layout)
            else:
                report.written = await _write_atif(events, partial)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    log.info("export done", **{k: v for k, v in report.to_dict().items() if k != "ranges"})
    return report


# --- Parquet ----------------------------------------------------------------------------------------------
def parquet_schema(layout: ParquetLayout = ParquetLayout.messages) -> "pa.Schema":
    """The Arrow schema of an export (see the module docstring)."""
    import pyarrow as pa

    tool_call = pa.struct([("id", pa.string()), ("type", pa.string()),
                           ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string()),
                         ("tool_calls", pa.list_(tool_call)), ("tool_call_id", pa.string())])
    turn = pa.struct([("message_index", pa.int32()), ("model", pa.string()), ("function", pa.string()),
                      ("trainable", pa.bool_()), ("finish_reason", pa.string()), ("policy_version", pa.int64()),
                      ("temperature", pa.float64())])
    conversation = ([("messages", pa.list_(message))] if layout == ParquetLayout.messages
                    else [("prompt", pa.list_(message)), ("completion", pa.list_(message))])
    return pa.schema([
        *conversation,
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


def parquet_row(event: TrajectoryEvent, record: SourceRecord | None = None,
                layout: ParquetLayout = ParquetLayout.messages) -> dict[str, Any]:
    """One trajectory as a row of :func:`parquet_schema`."""
    messages = [_openai_message(m) for m in event.messages]
    if layout == ParquetLayout.messages:
        conversation: dict[str, Any] = {"messages": messages}
    else:
        first = next((i for i, m in enumerate(event.messages) if m.role == "assistant"), len(messages))
        conversation = {"prompt": messages[:first], "completion": messages[first:]}
    return {
        **conversation,
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


def _openai_message(message: Message) -> dict[str, Any]:
    tool_calls = None
    if message.tool_calls is not None:
        tool_calls = [{"id": c.id, "type": c.type, "function": {"name": c.name, "arguments": c.arguments}}
                      for c in message.tool_calls]
    return {"role": message.role, "content": message.content, "name": message.name, "tool_calls": tool_calls,
            "tool_call_id": message.tool_call_id}


async def _write_parquet(events: AsyncIterator[tuple[TrajectoryEvent, SourceRecord]], path: Path,
                         layout: ParquetLayout) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema(layout)
    written = 0
    rows: list[dict[str, Any]] = []
    with pq.ParquetWriter(str(path), schema) as writer:
        async for event, record in events:
            rows.append(parquet_row(event, record, layout))
            if len(rows) >= PARQUET_BATCH_ROWS:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                written, rows = written + len(rows), []
        # an empty slice still writes a file with the schema (a reader gets zero rows, not an error)
        writer.write_table(pa.Table.from_pylist(rows, schema=schema))
        written += len(rows)
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
    event = imported_copy(imported.event, new_run_id, origin)
    invalid = validate_trajectory(event, cfg.streams.min_allowed_group_size, cfg.streams.max_allowed_group_size,
                                  reward_range=RewardRange(*cfg.streams.reward_range),
                                  temperature_range=TemperatureRange(*cfg.streams.temperature_range))
    if invalid is not None:
        raise RejectedRecord(invalid.reason, invalid.message)
    return event


def _short(exc: ValidationError) -> str:
    errors = exc.errors()
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errors[:5])
    return shown + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else "")


async def import_atif(cfg: RlstreamConfig, path: Path, new_run_id: str) -> ImportReport:
    """Publish the ATIF trajectories of ``path`` to ``trajectories`` as run ``new_run_id``; bad records to
    ``dlq`` with the reason."""
    if not new_run_id.strip():
        raise ReplayError("the new run id is empty")
    names = TopicNames.from_config(cfg.topics)
    codec = codec_for(cfg)
    report = ImportReport(path=str(path), new_run_id=new_run_id, topic=names.trajectories)
    with path.open("rb"):
        pass  # a file that cannot be opened fails here, before anything is published
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for record in read_records(path):
            report.records += 1
            origin = f"{path.name}:{record.index}"
            try:
                event = atif_event(record, new_run_id, cfg, origin)
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
        tags = {"format": ExportFormat.atif.value}
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
