"""``rlstream gateway serve``'s service: the command line's choices (:class:`GatewayOptions`) and the config become
a checked :class:`GatewayConfig` and access rules, then the gateway serves until SIGINT/SIGTERM with its capture
publisher, metrics and version routing wired in."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import SecretStr, ValidationError

from rlstream.gateway.app import Gateway
from rlstream.gateway.auth import AccessConfig, KeyStore, exposure_problem, inline_keys_from_env
from rlstream.gateway.config import GatewayConfig, default_spool_dir
from rlstream.gateway.server import run, serve_forever
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.routing import FleetRouter, StaticFleet
from rlstream.schemas.codec import codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.masking import secret_value
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.metrics import MetricsPublisher

SESSION_STITCHING = ("streams", "gateway")


class GatewayStartError(ValueError):
    """The options cannot start a gateway (bad keys, an exposed address without keys, a bad category...)."""


@dataclass
class GatewayOptions:
    """What ``rlstream gateway serve`` was asked for (its options, one field each)."""

    upstreams: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    host: str = "127.0.0.1"
    port: int = 8100
    served_model: str = "policy"
    session_idle_s: float = 300.0
    session_stitching: str = "streams"
    gateway_id: str | None = None
    queue_size: int = 10_000
    spool: bool = True
    spool_dir: Path | None = None
    spool_max_bytes: int = 1 << 30
    spool_after_s: float = 2.0
    route_versions: bool = True
    prometheus_port: int | None = None
    upstream_api_key: str | None = None
    metrics_host: str | None = None
    max_body_bytes: int = 16 << 20
    max_concurrent_requests: int = 1024
    body_read_timeout_s: float = 30.0
    max_open_sessions: int = 10_000
    logprobs: bool = True
    api_keys: list[str] = field(default_factory=list)
    api_keys_file: Path | None = None
    feedback_secret: str | None = None
    feedback_token_ttl_s: float | None = None
    insecure_no_auth: bool = False
    feedback_categories: list[str] = field(default_factory=list)


def parse_categories(pairs: list[str]) -> dict[str, float]:
    """``NAME=REWARD`` pairs as the categories table (ValueError naming the bad pair)."""
    table: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        try:
            reward = float(value)
        except ValueError:
            reward = math.nan
        if not sep or not name.strip() or not math.isfinite(reward):
            raise ValueError(f"{pair!r} is not NAME=REWARD with a finite reward")
        table[name.strip()] = reward
    return table


def field_errors(exc: Exception) -> str:
    """A key or keys-file problem without the key: fields and problems only."""
    if isinstance(exc, ValidationError):  # its message may quote a key
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return type(exc).__name__ if not isinstance(exc, OSError) else str(exc)


@dataclass
class PreparedGateway:
    """A checked gateway: its config, access rules and loaded keys."""

    gw: GatewayConfig
    access: AccessConfig
    keys: KeyStore


def prepare_gateway(cfg: RlstreamConfig, options: GatewayOptions) -> PreparedGateway:
    """Check the options against the config; raises :class:`GatewayStartError` with the message to show."""
    try:
        access = AccessConfig(api_keys=[SecretStr(k) for k in [*options.api_keys, *inline_keys_from_env()]],
                              api_keys_file=options.api_keys_file,
                              feedback_secret=SecretStr(options.feedback_secret) if options.feedback_secret else None,
                              feedback_token_ttl_s=options.feedback_token_ttl_s or cfg.streams.reward_window_s,
                              reward_range=cfg.streams.reward_range)
        keys = access.key_store()
    except Exception as exc:  # a bad key or keys file: say which field, never the key
        raise GatewayStartError(f"API keys not usable: {type(exc).__name__}: {field_errors(exc)}") from None
    problem = exposure_problem(options.host, keys.enabled, options.insecure_no_auth)
    if problem is not None:
        raise GatewayStartError(problem)
    try:
        categories = parse_categories(options.feedback_categories)
    except ValueError as exc:
        raise GatewayStartError(f"--feedback-category: {exc}") from None
    if options.session_stitching not in SESSION_STITCHING:
        raise GatewayStartError(f"--session-stitching is streams or gateway, not {options.session_stitching!r}")
    spool_dir = (options.spool_dir or default_spool_dir(options.port)) if options.spool else None
    gw = GatewayConfig(host=options.host, port=options.port, upstream_url=options.upstreams[0], run_id=cfg.run_id,
                       policy=cfg.policy, served_model=options.served_model, session_idle_s=options.session_idle_s,
                       queue_size=options.queue_size, session_stitching=options.session_stitching,
                       gateway_id=options.gateway_id or "", spool_dir=spool_dir,
                       spool_max_bytes=options.spool_max_bytes, spool_after_s=options.spool_after_s,
                       prometheus_port=options.prometheus_port, request_logprobs=options.logprobs,
                       metrics_host=options.metrics_host, max_body_bytes=options.max_body_bytes,
                       max_concurrent_requests=options.max_concurrent_requests,
                       body_read_timeout_s=options.body_read_timeout_s, max_open_sessions=options.max_open_sessions,
                       max_choices=cfg.streams.max_allowed_group_size,
                       upstream_api_key=options.upstream_api_key or secret_value(cfg.inference.api_key),
                       **({"feedback_categories": categories} if categories else {}))
    return PreparedGateway(gw, access, keys)


def run_gateway(cfg: RlstreamConfig, options: GatewayOptions, say: Callable[[str], None] = print) -> None:
    """Serve the gateway until SIGINT/SIGTERM; ``say`` gets the lines an operator reads (address, keys, spool).
    Raises :class:`GatewayStartError` before serving when the options cannot start one."""
    prepared = prepare_gateway(cfg, options)
    gw = prepared.gw
    spooled = f"spool {gw.spool_dir}" if gw.spool_dir else "no spool"
    say(f"gateway on http://{options.host}:{options.port} -> {gw.upstream_shown} (policy {cfg.policy}, {spooled})")
    if prepared.keys.enabled:
        file_note = f", file {options.api_keys_file}" if options.api_keys_file else ""
        say(f"clients authenticate with API keys ({len(prepared.keys)} loaded{file_note})")
    elif options.insecure_no_auth:
        say(f"WARNING: no API keys on {options.host}: anyone who reaches it may call and reward")
    else:
        say("no API keys: serving loopback only, every caller trusted (--api-key or --api-keys-file to "
            "authenticate clients)")
    run(_serve(cfg, gw, options.route_versions, prepared.access, options.upstreams, say))


async def _serve(cfg: RlstreamConfig, gw: GatewayConfig, route_versions: bool, access: AccessConfig,
                 upstreams: list[str], say: Callable[[str], None]) -> None:
    topics = TopicNames.from_config(cfg.topics)
    publisher = TrajectoryPublisher.from_config(cfg.kafka, topics.trajectories, topics.rewards,
                                                codec=codec_for(cfg), calls_topic=topics.calls)  # metrics too
    metrics = None
    if gw.prometheus_port is not None:  # its figures go to Prometheus only (see metric_names.GATEWAY_OVERHEAD_S)
        metrics = MetricsPublisher(publisher.producer, publisher.codec, topics.metrics, source="gateway",
                                   run_id=cfg.run_id, prometheus_port=gw.prometheus_port,
                                   prometheus_addr=gw.metrics_host or gw.host)
    control = ControlPlane(str(cfg.redis.url)) if route_versions and cfg.redis.url else None
    # policy -> the serving version, policy@N -> version N; each request and session pinned to one version, sent to
    # a replica that acknowledged loading it (docs/promotion.md)
    fleet: FleetRouter | StaticFleet | None = FleetRouter(
        control, cfg.policy, gw.served_model, session_ttl_s=gw.session_idle_s,
        serve_unpromoted=gw.serve_unpromoted) if control is not None else None
    if fleet is None and len(upstreams) > 1:  # replicas named here: each serves the configured version
        fleet = StaticFleet(upstreams, cfg.policy, gw.served_model, gw.policy_version)
    try:
        await publisher.start()
    except Exception as exc:  # Kafka down at start: serve anyway, capture counts the failures
        say(f"Kafka not reachable yet ({exc}); serving, capture will retry")
    try:
        await serve_forever(Gateway(gw, publisher, metrics=metrics, access=access, fleet=fleet))
    finally:
        await close_publisher(publisher, gw.drain_timeout_s, spooled=gw.spool_dir is not None, say=say)
        if control is not None:
            await control.close()


async def close_publisher(publisher: TrajectoryPublisher, timeout_s: float, spooled: bool,
                          say: Callable[[str], None] = print) -> None:
    """Flush and stop the producer, waiting at most ``timeout_s``: with Kafka down the producer's stop waits for
    ever (what it holds unacknowledged was spooled by the gateway, when it has a spool)."""
    closing = asyncio.create_task(publisher.close())
    await asyncio.wait({closing}, timeout=timeout_s)
    for _ in range(2):  # the first cancel ends the flush, a second one the producer's own stop
        if closing.done():
            break
        closing.cancel()
        await asyncio.wait({closing}, timeout=2.0)
    if not closing.done() or closing.cancelled() or closing.exception() is not None:
        problem = "not acknowledged in time" if not closing.done() or closing.cancelled() else closing.exception()
        where = "they are in the spool and sent at the next start" if spooled else "they are lost"
        say(f"some captured events were not written ({problem}); {where}")
