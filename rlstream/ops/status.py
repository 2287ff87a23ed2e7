"""``rlstream status``: one look at a deployment.

Policy versions (the Redis latest pointer and the recent PolicyVersion messages the fenced learner announced;
records that do not count are listed apart with the reason, see transport/trusted_versions.py), the learner
lease holder, the serving pointer and the last promotion decisions (docs/promotion.md), inference workers and the
versions each acknowledged loading, lag per topic and consumer group, the run's status hash and its latest metrics. Reads only: it joins no group and commits
nothing.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import client_options
from rlstream.transport.log import get_logger
from rlstream.transport.serving import ServingControl
from rlstream.transport.topic_reader import (TopicMissingError, TopicReader, open_reader, partitions_of,
                                             read_to_end)
from rlstream.transport.trusted_versions import TrustedVersions, UntrustedVersionRecord
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import KafkaConfig, RlstreamConfig
from rlstream.schemas.masking import mask_data, mask_url
from rlstream.schemas.models import MetricEvent, PolicyVersion
from rlstream.schemas.topics import ALL_TOPICS, TopicNames

log = get_logger(__name__)


@dataclass
class GroupLag:
    """Lag of one consumer group on one topic (sums over partitions; ``per_partition`` holds the detail)."""

    group: str
    topic: str
    committed: int = 0
    end: int = 0
    lag: int = 0
    per_partition: dict[int, int] = field(default_factory=dict)


async def consumer_group_lags(kafka: KafkaConfig, prefix: str = "", groups: list[str] | None = None) -> list[GroupLag]:
    """Lag of every consumer group (or of ``groups``) on the topics whose name starts with ``prefix``.

    A partition the group never committed counts its whole end offset as lag.
    """
    admin = AIOKafkaAdminClient(**client_options(kafka))
    await admin.start()
    try:
        if groups is None:
            groups = sorted({str(g[0]) for g in await admin.list_consumer_groups()})
        committed: dict[tuple[str, TopicPartition], int] = {}
        for group in groups:
            for tp, meta in (await admin.list_consumer_group_offsets(group)).items():
                if tp.topic.startswith(prefix):
                    committed[(group, tp)] = meta.offset
    finally:
        await admin.close()
    if not committed:
        return []
    reader = await open_reader(kafka)
    try:
        ends = await reader.end_offsets(sorted({tp for _, tp in committed}))
    finally:
        await reader.stop()
    out: dict[tuple[str, str], GroupLag] = {}
    for (group, tp), offset in sorted(committed.items(), key=lambda kv: (kv[0][0], kv[0][1].topic, kv[0][1].partition)):
        entry = out.setdefault((group, tp.topic), GroupLag(group=group, topic=tp.topic))
        end = ends.get(tp, 0)
        lag = max(0, end - max(offset, 0))
        entry.committed += max(offset, 0)
        entry.end += end
        entry.lag += lag
        entry.per_partition[tp.partition] = lag
    return list(out.values())


async def topic_end_offsets(kafka: KafkaConfig, names: TopicNames) -> dict[str, int]:
    """Per rlstream topic (short name, e.g. ``groups``), the sum of its partitions' end offsets: how much was
    written to it (transaction markers included). A topic that does not exist is left out."""
    reader = await open_reader(kafka)
    try:
        out: dict[str, int] = {}
        for short, topic in zip(ALL_TOPICS, names.all()):
            try:
                parts = await partitions_of(reader, topic)
            except TopicMissingError:
                continue
            out[short] = sum((await reader.end_offsets(parts)).values())
        return out
    finally:
        await reader.stop()


@dataclass
class UntrustedVersionSeen:
    """A PolicyVersion record that does not count (not announced by the fenced learner), and why."""

    partition: int
    offset: int
    version: int
    fencing_token: int
    reason: str
    message: str


async def recent_versions(kafka: KafkaConfig, topic: str, policy: str, trust: TrustedVersions,
                          limit: int = 5) -> tuple[list[PolicyVersion], list[UntrustedVersionSeen]]:
    """The newest ``limit`` PolicyVersion messages of ``policy`` that ``trust`` accepts, newest first, and the
    untrusted ones among the records read (the last ``max(50, 10 * limit)`` per partition), newest first."""
    codec = AvroCodec.from_config(kafka, {})  # reads only: no subject is ever named
    found: list[PolicyVersion] = []
    untrusted: list[UntrustedVersionSeen] = []
    reader = await open_reader(kafka)
    try:
        versions = TopicReader(reader, codec, PolicyVersion)  # read-only: an undecodable record is skipped
        async for item in versions.stream(read_to_end(reader, topic, tail=max(50, limit * 10))):
            if item.event.policy != policy:
                continue
            try:
                await trust.check(item.event, item.source.value)
            except UntrustedVersionRecord as exc:
                untrusted.append(UntrustedVersionSeen(item.source.partition, item.source.offset, item.event.version,
                                                      item.event.fencing_token, exc.reason, str(exc)))
                continue
            found.append(item.event)
    finally:
        await reader.stop()
    found.sort(key=lambda v: (v.version, v.created_at), reverse=True)
    untrusted.sort(key=lambda u: (u.partition, u.offset), reverse=True)
    return found[:limit], untrusted[:limit]


async def latest_metrics(kafka: KafkaConfig, topic: str, run_id: str | None, tail: int = 500) -> list[MetricEvent]:
    """The last event of each (source, name) among the last ``tail`` per partition, for ``run_id`` (or all)."""
    codec = AvroCodec.from_config(kafka, {})  # reads only: no subject is ever named
    last: dict[tuple[str, str], MetricEvent] = {}
    reader = await open_reader(kafka)
    try:
        metrics = TopicReader(reader, codec, MetricEvent)  # read-only: an undecodable record is skipped
        async for item in metrics.stream(read_to_end(reader, topic, tail=tail)):
            event = item.event
            if run_id and event.run_id != run_id:
                continue
            key = (event.source, event.name)
            if key not in last or event.ts >= last[key].ts:
                last[key] = event
    finally:
        await reader.stop()
    return sorted(last.values(), key=lambda e: (e.source, e.name))


async def last_decisions(cfg: RlstreamConfig, limit: int) -> list[Any]:
    """The last ``limit`` decisions about ``cfg.policy`` on ``promotions``, newest first."""
    from rlstream.ops.promotion import read_decisions

    return list(reversed(await read_decisions(cfg, cfg.policy, tail=max(50, 10 * limit))))[:limit]


async def control_plane_status(url: str, policy: str, run_id: str) -> dict[str, Any]:
    """Latest pointer, lease holder, workers (with heartbeat age) and the run's status hash."""
    plane = ControlPlane(url, retry_max_s=2.0)
    try:
        now = time.time()
        workers = await plane.workers(policy)
        for info in workers.values():
            if "heartbeat_at" in info:
                info["age_s"] = f"{max(0.0, now - float(info['heartbeat_at'])):.1f}"
        pointer = await ServingControl(plane).serving(policy)
        return {
            "latest": await plane.latest(policy),
            "serving": asdict(pointer) if pointer is not None else None,
            "lease_holder": await plane.lease_holder(policy),
            "workers": workers,
            "run_status": await plane.status(run_id),
        }
    finally:
        await plane.close()


async def collect_status(cfg: RlstreamConfig, run_id: str | None = None, versions: int = 5) -> dict[str, Any]:
    """Everything ``rlstream status`` shows, as JSON-ready data; an unreachable part is reported, not raised.
    Secrets (a password in the Redis URL, any configured secret quoted in an error) come out masked."""
    run_id = run_id or cfg.run_id
    names = TopicNames.from_config(cfg.topics)
    status: dict[str, Any] = {"policy": cfg.policy, "run_id": run_id, "errors": []}
    if cfg.redis.url:
        try:
            status.update(await control_plane_status(cfg.redis.url, cfg.policy, run_id))
        except Exception as exc:  # a down Redis must not hide what Kafka can tell
            status["errors"].append(f"redis {mask_url(cfg.redis.url)}: {exc}")
    else:
        status["errors"].append("redis.url is not set: no control-plane figures")
    status["recent_versions"], status["untrusted_versions"] = [], []
    if cfg.redis.url:
        try:
            control = ControlPlane(cfg.redis.url, retry_max_s=2.0)
            try:
                trust = TrustedVersions(control, cfg.inference.max_version_jump, wait_pending=False)
                trusted, untrusted = await recent_versions(cfg.kafka, names.policy_versions, cfg.policy, trust,
                                                           versions)
            finally:
                await control.close()
            status["recent_versions"] = [v.model_dump(mode="json") for v in trusted]
            status["untrusted_versions"] = [asdict(u) for u in untrusted]
        except TopicMissingError as exc:
            status["errors"].append(str(exc))
        except Exception as exc:
            status["errors"].append(f"recent_versions: {type(exc).__name__}: {exc}")
    for key, call in (
        ("promotions", lambda: last_decisions(cfg, versions)),
        ("lag", lambda: consumer_group_lags(cfg.kafka, cfg.topics.prefix)),
        ("metrics", lambda: latest_metrics(cfg.kafka, names.metrics, run_id)),
    ):
        try:
            value = await call()
        except TopicMissingError as exc:
            status["errors"].append(str(exc))
            value = []
        except Exception as exc:
            status["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            value = []
        status[key] = [v.model_dump(mode="json") if hasattr(v, "model_dump") else asdict(v) for v in value]
    return mask_data(status)


def render_status(status: dict[str, Any], console: Any) -> None:
    """Print ``status`` as rich tables."""
    from rich.table import Table

    latest = status.get("latest") or {}
    console.print(f"[bold]policy[/bold] {status['policy']}   [bold]run[/bold] {status['run_id']}")
    console.print(f"latest version (redis): {latest.get('version', '-')}  uri: {latest.get('uri', '-')}")
    console.print(f"learner lease: {status.get('lease_holder') or 'free'}")
    serving = status.get("serving")
    if serving:
        canary = (f"  canary: {serving['canary_version']} ({serving['canary_share']:.0%} of new sessions)"
                  if serving.get("canary_version") is not None else "")
        pending = f"  pending: {serving['pending_version']}" if serving.get("pending_version") is not None else ""
        console.print(f"serving version: {serving['version']}  by {serving['decided_by'] or '-'}: "
                      f"{serving['reason'] or '-'}{pending}{canary}", highlight=False)
    else:
        console.print("serving version: no serving pointer (routing follows the newest loaded version)")
    if status.get("promotions"):
        table = Table("time", "decision", "version", "serving before", "by", "reason", title="promotion decisions")
        for d in status["promotions"]:
            table.add_row(str(d["decided_at"]), str(d["decision"]), str(d["version"]),
                          "-" if d["serving_before"] is None else str(d["serving_before"]), d["decided_by"],
                          d["reason"])
        console.print(table)

    table = Table("version", "kind", "learner step", "groups", "run", "created", "uri", title="recent policy versions")
    for v in status.get("recent_versions", []):
        table.add_row(str(v["version"]), str(v["kind"]), str(v["learner_step"]), str(v["group_count"]), v["run_id"],
                      str(v["created_at"]), v["uri"])
    console.print(table)
    if status.get("untrusted_versions"):
        table = Table("partition:offset", "version", "fencing token", "reason",
                      title="[red]untrusted policy-versions records (not counted)[/red]")
        for u in status["untrusted_versions"]:
            table.add_row(f"{u['partition']}:{u['offset']}", str(u["version"]), str(u["fencing_token"]), u["reason"])
        console.print(table)

    table = Table("worker", "role", "name", "loaded version", "loaded (acknowledged)", "failed", "heartbeat age s",
                  title="inference workers")
    for wid, info in sorted((status.get("workers") or {}).items()):
        table.add_row(wid, info.get("role") or "serve", info.get("name", ""), info.get("version", ""),
                      info.get("loaded", ""),
                      info.get("failed", ""), info.get("age_s", ""))
    console.print(table)

    table = Table("consumer group", "topic", "committed", "end", "lag", title="lag per topic and consumer group")
    for lag in status.get("lag", []):
        table.add_row(lag["group"], lag["topic"], str(lag["committed"]), str(lag["end"]), str(lag["lag"]))
    console.print(table)

    run_status = status.get("run_status") or {}
    if run_status:
        table = Table("figure", "value", title=f"run status ({status['run_id']})")
        for k, v in sorted(run_status.items()):
            table.add_row(k, v)
        console.print(table)

    table = Table("source", "metric", "value", "step", "time", title="latest metrics")
    for m in status.get("metrics", []):
        table.add_row(m["source"], m["name"], f"{m['value']:.6g}", "" if m["step"] is None else str(m["step"]),
                      str(m["ts"]))
    console.print(table)
    for err in status.get("errors", []):
        console.print(f"[yellow]! {err}[/yellow]")
