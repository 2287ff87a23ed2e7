"""``rlstream tail metrics|groups|dlq|versions|promotions``: read a topic as a table or as JSON lines.

Without ``--from-beginning`` it starts ``--last`` records before the end of each partition (like
``tail``); without ``--follow`` it stops at the end offsets of the moment it started. ``--follow``
keeps reading until Ctrl-C, ``--max-messages`` or ``--idle-timeout``. Each record carries the
reader's lag (records still behind it in that partition); ``--group`` adds the committed-offset
lag of a consumer group (e.g. the learner's) to the table caption.

``--run`` keeps the events of one run. A dead letter belongs to the run of the event it carries
when that event decodes; a dead letter whose run cannot be told is shown (it may be exactly the
broken event of that run). Undecodable records are shown with their error, never skipped.

``versions`` checks each record against the control plane (transport/trusted_versions.py): a record the fenced
learner did not announce is shown flagged ``untrusted`` with the reason (JSON: ``_untrusted``), never as a version.
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any, AsyncIterator, Callable, TextIO

from aiokafka import AIOKafkaConsumer, TopicPartition

from rlstream.transport.control import ControlPlane
from rlstream.transport.log import get_logger
from rlstream.transport.topic_reader import open_reader, partitions_of
from rlstream.transport.trusted_versions import TrustedVersions, UntrustedVersionRecord
from rlstream.schemas.codec import AvroCodec, CodecError, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import (DeadLetter, MetricEvent, PolicyVersion, PromotionDecision, TrajectoryGroup,
                                     WireModel)
from rlstream.schemas.topics import TopicNames

log = get_logger(__name__)
TAIL_KINDS = ("metrics", "groups", "dlq", "versions", "promotions")
_MODELS: dict[str, type[WireModel]] = {"metrics": MetricEvent, "groups": TrajectoryGroup, "dlq": DeadLetter,
                                       "versions": PolicyVersion, "promotions": PromotionDecision}


def topic_for(kind: str, names: TopicNames) -> str:
    """The topic a tail kind reads."""
    return {"metrics": names.metrics, "groups": names.groups, "dlq": names.dlq,
            "versions": names.policy_versions, "promotions": names.promotions}[kind]


@dataclass
class TailOptions:
    """What to read and when to stop."""

    run: str | None = None
    follow: bool = False
    from_beginning: bool = False
    last: int = 10
    max_messages: int | None = None
    idle_timeout_s: float | None = None
    group: str | None = None


@dataclass
class TailItem:
    """One record read: the decoded event, or the error that kept it from decoding."""

    topic: str
    partition: int
    offset: int
    lag: int
    event: WireModel | None
    error: str | None = None
    untrusted: str | None = None  # versions: why the record does not count ("<reason>: <message>")


class Tailer:
    """Reads one kind's topic with the options' bounds; a group-less reader that commits nothing."""

    def __init__(self, cfg: RlstreamConfig, kind: str, options: TailOptions) -> None:
        if kind not in TAIL_KINDS:
            raise ValueError(f"unknown tail kind {kind!r}; one of {', '.join(TAIL_KINDS)}")
        self.cfg = cfg
        self.kind = kind
        self.options = options
        self.topic = topic_for(kind, TopicNames.from_config(cfg.topics))
        self.model = _MODELS[kind]
        self.codec: AvroCodec = codec_for(cfg)
        self.consumer: AIOKafkaConsumer | None = None
        self.partitions: list[TopicPartition] = []
        self.highwater: dict[int, int] = {}
        self.positions: dict[int, int] = {}
        self.shown = 0
        self.control: ControlPlane | None = None
        self.trust: TrustedVersions | None = None

    async def start(self) -> None:
        if self.kind == "versions" and self.cfg.redis.url:
            self.control = ControlPlane(self.cfg.redis.url, retry_max_s=self.cfg.redis.retry_max_s)
            self.trust = TrustedVersions(self.control, self.cfg.inference.max_version_jump, wait_pending=False)
        self.consumer = await open_reader(self.cfg.kafka)
        self.partitions = await partitions_of(self.consumer, self.topic)
        self.consumer.assign(self.partitions)
        begins = await self.consumer.beginning_offsets(self.partitions)
        ends = await self.consumer.end_offsets(self.partitions)
        for tp in self.partitions:
            start = begins[tp] if self.options.from_beginning else max(begins[tp], ends[tp] - max(0, self.options.last))
            self.consumer.seek(tp, start)
            self.positions[tp.partition] = start
            self.highwater[tp.partition] = ends[tp]
        self._stops = {tp.partition: ends[tp] for tp in self.partitions}

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
        if self.control is not None:
            await self.control.close()
            self.control = None

    async def __aenter__(self) -> "Tailer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def reader_lag(self) -> dict[int, int]:
        """Records in each partition that this reader has not reached yet."""
        return {p: max(0, self.highwater[p] - self.positions[p]) for p in self.highwater}

    def _done(self) -> bool:
        if self.options.max_messages is not None and self.shown >= self.options.max_messages:
            return True
        if not self.options.follow:
            return all(self.positions[p] >= self._stops[p] for p in self._stops)
        return False

    async def items(self) -> AsyncIterator[TailItem]:
        """Yield the records to show, until the options' bound is reached."""
        assert self.consumer is not None, "start() first"
        last_record = time.monotonic()
        while not self._done():
            batch = await self.consumer.getmany(timeout_ms=200)
            for tp in self.partitions:
                self.highwater[tp.partition] = max(self.highwater[tp.partition], self.consumer.highwater(tp) or 0)
            got_any = False
            for tp, records in sorted(batch.items(), key=lambda kv: kv[0].partition):
                for record in records:
                    if not self.options.follow and record.offset >= self._stops[tp.partition]:
                        break
                    got_any = True
                    self.positions[tp.partition] = record.offset + 1
                    item = self._item(record.partition, record.offset, record.value)
                    if item is None:
                        continue
                    if isinstance(item.event, PolicyVersion):
                        item.untrusted = await self._untrusted(item.event, record.value)
                    self.shown += 1
                    yield item
                    if self._done():
                        return
            for tp in self.partitions:
                self.positions[tp.partition] = max(self.positions[tp.partition], await self.consumer.position(tp))
            if got_any:
                last_record = time.monotonic()
            elif self.options.idle_timeout_s is not None and time.monotonic() - last_record >= self.options.idle_timeout_s:
                return
            await asyncio.sleep(0)

    def _item(self, partition: int, offset: int, value: bytes | None) -> TailItem | None:
        lag = max(0, self.highwater.get(partition, 0) - offset - 1)
        try:
            event = self.codec.decode(value or b"", self.model)
        except CodecError as exc:
            return TailItem(self.topic, partition, offset, lag, None, f"{type(exc).__name__}: {exc}")
        if self.options.run is not None:
            run = self._run_of(event)
            if run is not None and run != self.options.run:
                return None
        return TailItem(self.topic, partition, offset, lag, event)

    async def _untrusted(self, event: PolicyVersion, value: bytes | None) -> str | None:
        """Why a version record does not count, None when it does."""
        if self.trust is None:
            return "unverified: redis.url is not set"
        try:
            await self.trust.check(event, value)
        except UntrustedVersionRecord as exc:
            return f"{exc.reason}: {exc}"
        return None

    def _run_of(self, event: WireModel) -> str | None:
        if isinstance(event, DeadLetter):
            try:
                inner = self.codec.decode_record(event.value or b"")
            except CodecError:
                return None
            run = inner.get("run_id") if isinstance(inner, dict) else None
            return str(run) if run else None
        return getattr(event, "run_id", None)


# --- rendering --------------------------------------------------------------------------
def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def json_line(item: TailItem) -> str:
    """One JSON object: the event's fields (bytes as base64) plus ``_kafka`` {topic, partition, offset, lag}."""
    row: dict[str, Any] = item.event.model_dump() if item.event is not None else {"_error": item.error}
    row["_kafka"] = {"topic": item.topic, "partition": item.partition, "offset": item.offset, "lag": item.lag}
    if item.untrusted is not None:
        row["_untrusted"] = item.untrusted
    return json.dumps(row, default=_json_default, separators=(",", ":"))


def _short(text: str | None, width: int = 60) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _time(ts: datetime) -> str:
    return ts.strftime("%H:%M:%S.%f")[:-3]


COLUMNS: dict[str, tuple[str, ...]] = {
    "metrics": ("time", "source", "run", "name", "value", "step", "tags"),
    "groups": ("time", "run", "example", "size", "reward mean", "std", "min", "max", "completion", "versions", "pct"),
    "dlq": ("time", "service", "from", "error", "message"),
    "versions": ("time", "policy", "version", "kind", "step", "groups", "run", "uri", "trust"),
    "promotions": ("time", "policy", "decision", "version", "serving before", "by", "token", "reason"),
}


def table_cells(kind: str, event: WireModel) -> list[str]:
    """The table row of one event of ``kind``."""
    if isinstance(event, MetricEvent):
        tags = ",".join(f"{k}={v}" for k, v in sorted(event.tags.items()))
        return [_time(event.ts), event.source, event.run_id, event.name, f"{event.value:.6g}",
                "" if event.step is None else str(event.step), _short(tags, 40)]
    if isinstance(event, TrajectoryGroup):
        pct = f"{event.curriculum.percentile:.2f}" if event.curriculum else ""
        versions = (str(event.min_policy_version) if event.min_policy_version == event.max_policy_version
                    else f"{event.min_policy_version}-{event.max_policy_version}")
        completion = event.completion.value if isinstance(event.completion, Enum) else str(event.completion)
        return [_time(event.assembled_at), event.run_id, event.example_id,
                f"{len(event.trajectories)}/{event.expected_size}", f"{event.reward_mean:.4g}",
                f"{event.reward_std:.3g}", f"{event.reward_min:.3g}", f"{event.reward_max:.3g}", completion, versions,
                pct]
    if isinstance(event, DeadLetter):
        return [_time(event.ts), event.service, f"{event.source_topic}:{event.source_partition}:{event.source_offset}",
                event.error_type, _short(event.error_message, 70)]
    if isinstance(event, PolicyVersion):
        kind_name = event.kind.value if isinstance(event.kind, Enum) else str(event.kind)
        return [_time(event.created_at), event.policy, str(event.version), kind_name, str(event.learner_step),
                str(event.group_count), event.run_id, _short(event.uri, 50), "announced"]
    if isinstance(event, PromotionDecision):
        decision = event.decision.value if isinstance(event.decision, Enum) else str(event.decision)
        before = "-" if event.serving_before is None else str(event.serving_before)
        return [_time(event.decided_at), event.policy, decision, str(event.version), before, event.decided_by,
                str(event.fencing_token), _short(event.reason, 60)]
    raise TypeError(f"no table row for {type(event).__name__}")


def build_table(kind: str, rows: list[TailItem], caption: str) -> Any:
    """A rich table of ``rows`` with the partition:offset and lag of each."""
    from rich.table import Table

    table = Table("p:offset", "lag", *COLUMNS[kind], caption=caption, title=f"rlstream tail {kind}")
    for item in rows:
        if item.event is None:
            cells = [f"[red]{_short(item.error, 80)}[/red]"] + [""] * (len(COLUMNS[kind]) - 1)
        else:
            cells = table_cells(kind, item.event)
            if item.untrusted is not None:
                cells[-1] = f"[red]untrusted {_short(item.untrusted, 60)}[/red]"
        table.add_row(f"{item.partition}:{item.offset}", str(item.lag), *cells)
    return table


async def lag_caption(tailer: Tailer) -> str:
    """``reader lag N`` plus the consumer group's lag when ``--group`` was given."""
    lag = tailer.reader_lag()
    text = f"reader lag {sum(lag.values())} ({', '.join(f'p{p}:{n}' for p, n in sorted(lag.items()))})"
    if tailer.options.group:
        from rlstream.ops.status import consumer_group_lags

        try:
            lags = await consumer_group_lags(tailer.cfg.kafka, tailer.topic, [tailer.options.group])
            group_lag = sum(g.lag for g in lags if g.topic == tailer.topic)
            text += f" | group {tailer.options.group} lag {group_lag}" if lags else \
                f" | group {tailer.options.group}: no committed offsets"
        except Exception as exc:
            text += f" | group lag unavailable: {exc}"
    return text


async def run_tail(cfg: RlstreamConfig, kind: str, options: TailOptions, fmt: str = "table",
                   out: TextIO | None = None, console: Any = None, window: int = 30) -> int:
    """Print the records (``fmt`` = ``json`` lines or a ``table``; live in follow mode). Returns how many."""
    import sys

    if fmt not in ("json", "table"):
        raise ValueError(f"unknown format {fmt!r}; json or table")
    out = out or sys.stdout
    async with Tailer(cfg, kind, options) as tailer:
        if fmt == "json":
            async for item in tailer.items():
                out.write(json_line(item) + "\n")
                out.flush()
            return tailer.shown
        if console is None:
            from rich.console import Console

            console = Console(file=out)
        if not options.follow:
            rows = [item async for item in tailer.items()]
            console.print(build_table(kind, rows, await lag_caption(tailer)))
            return tailer.shown
        return await _live_table(tailer, kind, console, window)


async def _live_table(tailer: Tailer, kind: str, console: Any, window: int) -> int:
    from rich.live import Live

    rows: deque[TailItem] = deque(maxlen=window)
    caption = await lag_caption(tailer)
    refresh_caption_every = 2.0
    last_caption = time.monotonic()
    render: Callable[[], Any] = lambda: build_table(kind, list(rows), caption)  # noqa: E731
    with Live(render(), console=console, refresh_per_second=4, transient=False) as live:
        async for item in tailer.items():
            rows.append(item)
            if time.monotonic() - last_caption >= refresh_caption_every:
                caption = await lag_caption(tailer)
                last_caption = time.monotonic()
            live.update(render())
        caption = await lag_caption(tailer)
        live.update(render())
    return tailer.shown
