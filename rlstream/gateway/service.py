"""``rlstream gateway serve``'s service: the ``gateway`` section of the configuration, with one process's choices
over it (:class:`GatewayOptions`), becomes checked :class:`GatewaySettings` and access rules, then the gateway
serves until SIGINT/SIGTERM with its capture publisher, metrics and version routing wired in."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import SecretStr, ValidationError

from rlstream.gateway.app import Gateway
from rlstream.gateway.auth import AccessConfig, KeyStore, KeysFileExposed, exposure_problem, inline_keys_from_env
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import run, serve_forever
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.routing import FleetRouter, StaticFleet
from rlstream.schemas.codec import codec_for
from rlstream.schemas.config import GatewayConfig, RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.metrics import MetricsPublisher


class GatewayStartError(ValueError):
    """The settings cannot start a gateway (bad keys, an exposed address without keys...)."""


@dataclass
class GatewayOptions:
    """What one ``rlstream gateway serve`` process sets over the ``gateway`` section (None: the section's)."""

    upstreams: list[str] = field(default_factory=list)
    host: str | None = None
    port: int | None = None
    gateway_id: str | None = None
    spool_dir: Path | None = None
    prometheus_port: int | None = None
    upstream_api_key: str | None = None
    api_keys: list[str] = field(default_factory=list)
    api_keys_file: Path | None = None
    feedback_secret: str | None = None
    insecure_no_auth: bool = False

    def section(self, cfg: RlstreamConfig) -> GatewayConfig:
        """``cfg.gateway`` with this process's choices over it (checked like the configuration)."""
        chosen = {name: value for name, value in (
            ("upstreams", self.upstreams or None), ("host", self.host), ("port", self.port),
            ("gateway_id", self.gateway_id), ("spool_dir", self.spool_dir), ("prometheus_port", self.prometheus_port),
            ("upstream_api_key", self.upstream_api_key), ("api_keys_file", self.api_keys_file),
            ("feedback_secret", self.feedback_secret)) if value is not None}
        current = {name: getattr(cfg.gateway, name) for name in GatewayConfig.model_fields}
        return GatewayConfig.model_validate({**current, **chosen})


def field_errors(exc: Exception) -> str:
    """A key or keys-file problem without the key: fields and problems only."""
    if isinstance(exc, ValidationError):  # its message may quote a key
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return str(exc) if isinstance(exc, (OSError, KeysFileExposed)) else type(exc).__name__


@dataclass
class PreparedGateway:
    """A checked gateway: its settings, its upstreams (replicas), access rules and loaded keys."""

    gw: GatewaySettings
    upstreams: list[str]
    access: AccessConfig
    keys: KeyStore


def prepare_gateway(cfg: RlstreamConfig, options: GatewayOptions | None = None) -> PreparedGateway:
    """The gateway ``cfg`` and this process's ``options`` describe; raises :class:`GatewayStartError` with the
    message to show."""
    options = options or GatewayOptions()
    try:
        section = options.section(cfg)
    except ValidationError as exc:
        raise GatewayStartError(f"gateway settings not usable: {field_errors(exc)}") from None
    try:
        access = AccessConfig(api_keys=[SecretStr(k) for k in [*options.api_keys, *inline_keys_from_env()]],
                              api_keys_file=section.api_keys_file, feedback_secret=section.feedback_secret,
                              feedback_secret_previous=section.feedback_secret_previous,
                              feedback_token_ttl_s=section.feedback_token_ttl_s or cfg.streams.reward_window_s,
                              reward_range=cfg.streams.reward_range)
        keys = access.key_store()
    except Exception as exc:  # a bad key or keys file: say which field, never the key
        raise GatewayStartError(f"API keys not usable: {type(exc).__name__}: {field_errors(exc)}") from None
    problem = exposure_problem(section.host, keys.enabled, options.insecure_no_auth)
    if problem is not None:
        raise GatewayStartError(problem)
    try:
        gw = GatewaySettings.resolve(cfg, section)
    except ValueError as exc:  # a bound Kafka cannot honour
        raise GatewayStartError(f"gateway settings not usable: {exc}") from None
    upstreams = [str(url) for url in section.upstreams] or [gw.upstream_url]
    return PreparedGateway(gw, upstreams, access, keys)


def run_gateway(cfg: RlstreamConfig, options: GatewayOptions | None = None,
                say: Callable[[str], None] = print) -> None:
    """Serve the gateway until SIGINT/SIGTERM; ``say`` gets the lines an operator reads (address, keys, spool).
    Raises :class:`GatewayStartError` before serving when the settings cannot start one."""
    options = options or GatewayOptions()
    prepared = prepare_gateway(cfg, options)
    gw = prepared.gw
    spooled = f"spool {gw.spool_dir}" if gw.spool_dir else "no spool"
    say(f"gateway on http://{gw.host}:{gw.port} -> {gw.upstream_shown} (policy {cfg.policy}, {spooled})")
    if prepared.keys.enabled:
        file_note = f", file {gw.api_keys_file}" if gw.api_keys_file else ""
        say(f"clients authenticate with API keys ({len(prepared.keys)} loaded{file_note})")
    elif options.insecure_no_auth:
        say(f"WARNING: no API keys on {gw.host}: anyone who reaches it may call and reward")
    else:
        say("no API keys: serving loopback only, every caller trusted (--api-key or --api-keys-file to "
            "authenticate clients)")
    run(_serve(cfg, gw, gw.route_versions, prepared.access, prepared.upstreams, say))


async def _serve(cfg: RlstreamConfig, gw: GatewaySettings, route_versions: bool, access: AccessConfig,
                 upstreams: list[str], say: Callable[[str], None]) -> None:
    topics = TopicNames.from_config(cfg.topics)
    publisher = TrajectoryPublisher.from_config(cfg.kafka, topics.trajectories, topics.rewards,
                                                codec=codec_for(cfg), calls_topic=topics.calls)  # metrics too
    metrics = None
    if gw.prometheus_port is not None:  # its figures go to Prometheus only (see metric_names.GATEWAY_OVERHEAD_S)
        metrics = MetricsPublisher(publisher.producer, publisher.codec, topics.metrics, source="gateway",
                                   run_id=cfg.run_id, prometheus_port=gw.prometheus_port,
                                   prometheus_addr=gw.metrics_host or gw.host)
    # Redis: version routing, and the ids feedback names and stored Responses every gateway shares
    control = ControlPlane(str(cfg.redis.url), cfg.redis.retry_max_s) if cfg.redis.url else None
    # policy -> the serving version, policy@N -> version N; each request and session pinned to one version, sent to
    # a replica that acknowledged loading it (docs/promotion.md)
    fleet: FleetRouter | StaticFleet | None = FleetRouter(
        control, cfg.policy, gw.served_model, session_ttl_s=gw.session_idle_s,
        serve_unpromoted=gw.serve_unpromoted) if control is not None and route_versions else None
    if fleet is None and len(upstreams) > 1:  # replicas named here: each serves the configured version
        fleet = StaticFleet(upstreams, cfg.policy, gw.served_model, gw.policy_version)
    try:
        await publisher.start()
    except Exception as exc:  # Kafka down at start: serve anyway, capture counts the failures
        say(f"Kafka not reachable yet ({exc}); serving, capture will retry")
    try:
        await serve_forever(Gateway(gw, publisher, metrics=metrics, access=access, fleet=fleet, control=control))
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
