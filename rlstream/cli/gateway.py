"""``rlstream gateway``: the OpenAI-compatible capture gateway."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, console, load_or_exit

gateway_app = typer.Typer(help="The capture gateway: an OpenAI-compatible server that records production traffic.",
                          no_args_is_help=True)


@gateway_app.command("serve")
def gateway_serve(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    upstream: Optional[list[str]] = typer.Option(None, help="OpenAI-compatible upstream (vLLM), e.g. http://host:8000 "
                                                 "(default http://127.0.0.1:8000); repeatable: replicas of the policy "
                                                 "(without Redis routing; with it the sync workers' heartbeats name "
                                                 "the replicas)"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8100),
    served_model: str = typer.Option("policy", help="the base model name at the upstream"),
    session_idle_s: float = typer.Option(300.0, help="with --session-stitching gateway: publish a session "
                                         "trajectory after this long idle (streams: streams.session_idle_s)"),
    session_stitching: str = typer.Option("streams", help="streams: each call of a session goes to the calls topic "
                                          "and the stream app stitches sessions (any number of gateways behind any "
                                          "load balancer); gateway: this gateway holds open sessions in memory"),
    gateway_id: Optional[str] = typer.Option(None, help="this gateway's name on the calls it publishes "
                                             "(default host:port)"),
    queue_size: int = typer.Option(10_000, help="events waiting in memory before new ones are dropped"),
    spool: bool = typer.Option(True, "--spool/--no-spool", help="keep events on disk while Kafka is slow or down "
                               "(re-sent in order once it answers, also after a restart); --no-spool drops them"),
    spool_dir: Optional[Path] = typer.Option(None, help="spool directory (default: "
                                             "$XDG_STATE_HOME/rlstream/gateway-spool/PORT, or ~/.local/state/... without it)"),
    spool_max_bytes: int = typer.Option(1 << 30, help="disk the spool may use; past it events are dropped (counted)"),
    spool_after_s: float = typer.Option(2.0, help="spool once Kafka has not taken or acknowledged an event this long"),
    route_versions: bool = typer.Option(True, help="route the policy's model name to the serving version and "
                                        "POLICY@N to version N, on the replicas that acknowledged loading it "
                                        "(Redis: the serving pointer and the inference workers' heartbeats)"),
    prometheus_port: Optional[int] = typer.Option(None, help="serve the gateway's metrics (overhead per call, "
                                                  "process) to Prometheus on this port"),
    upstream_api_key: Optional[str] = typer.Option(None, envvar="RLSTREAM_GATEWAY_UPSTREAM_API_KEY",
                                                   show_default=False, help="the upstream's API key (vLLM's "
                                                   "--api-key), sent as Authorization: Bearer; default "
                                                   "inference.api_key; also RLSTREAM_GATEWAY_UPSTREAM_API_KEY"),
    metrics_host: Optional[str] = typer.Option(None, help="address the Prometheus endpoint binds (default: --host)"),
    max_body_bytes: int = typer.Option(16 << 20, help="largest request body (413 past it)"),
    max_concurrent_requests: int = typer.Option(1024, help="requests served at once (503 past it)"),
    body_read_timeout_s: float = typer.Option(30.0, help="a request body not received whole within this long is "
                                              "answered 408 (slow clients)"),
    max_open_sessions: int = typer.Option(10_000, help="open session trajectories held at once; past it the least "
                                          "recently active is closed and published"),
    logprobs: bool = typer.Option(True, "--logprobs/--no-logprobs", help="ask the upstream for the sampled tokens' "
                                  "logprobs with their ids (the learner's off-policy correction); --no-logprobs asks "
                                  "for token ids only, saving the upstream's logprobs work, and those turns train "
                                  "as on-policy"),
    api_key: Optional[list[str]] = typer.Option(None, "--api-key", help="a client key (Authorization: Bearer KEY) of "
                                                "the default tenant with every scope; repeatable; also "
                                                "RLSTREAM_GATEWAY_API_KEYS (comma separated)"),
    api_keys_file: Optional[Path] = typer.Option(None, help="YAML or JSON keys file: per key a tenant, scopes, "
                                                 "models, tasks, rpm, max_concurrent; re-read when it changes"),
    feedback_secret: Optional[str] = typer.Option(None, envvar="RLSTREAM_GATEWAY_FEEDBACK_SECRET",
                                                  help="HMAC secret of the feedback tokens (at least 16 bytes; the "
                                                  "same on every gateway behind one load balancer); default: a "
                                                  "random one per start", show_default=False),
    feedback_token_ttl_s: Optional[float] = typer.Option(None, help="feedback tokens expire this long after their "
                                                         "response (default: streams.reward_window_s)"),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth", help="serve a non-loopback address without "
                                          "API keys (anyone who reaches it can steer training)"),
    feedback_category: Optional[list[str]] = typer.Option(
        None, "--feedback-category", help="NAME=REWARD: the reward of a categorical feedback value (Langfuse, "
        "LangSmith, OpenTelemetry labels; repeatable; replaces the default table: thumbs_up/good/correct/positive/"
        "pass = 1, their opposites 0)"),
) -> None:
    """Serve /v1/chat/completions in front of UPSTREAM and publish every call to the trajectories topic."""
    from rlstream.rollout.gateway.config import GatewayConfig, default_spool_dir
    from rlstream.schemas.masking import secret_value

    from pydantic import SecretStr

    from rlstream.rollout.gateway.auth import AccessConfig, exposure_problem, inline_keys_from_env

    cfg = load_or_exit(config, override)
    try:
        access = AccessConfig(api_keys=[SecretStr(k) for k in [*(api_key or []), *inline_keys_from_env()]],
                              api_keys_file=api_keys_file,
                              feedback_secret=SecretStr(feedback_secret) if feedback_secret else None,
                              feedback_token_ttl_s=feedback_token_ttl_s or cfg.streams.reward_window_s,
                              reward_range=cfg.streams.reward_range)
        keys = access.key_store()
    except Exception as exc:  # a bad key or keys file: say which field, never the key
        console.print(f"API keys not usable: {type(exc).__name__}: {_field_errors(exc)}", highlight=False)
        raise typer.Exit(2)
    problem = exposure_problem(host, keys.enabled, insecure_no_auth)
    if problem is not None:
        console.print(problem, highlight=False)
        raise typer.Exit(2)
    try:
        categories = _categories(feedback_category or [])
    except ValueError as exc:
        console.print(f"--feedback-category: {exc}", highlight=False)
        raise typer.Exit(2)
    if session_stitching not in ("streams", "gateway"):
        console.print(f"--session-stitching is streams or gateway, not {session_stitching!r}", highlight=False)
        raise typer.Exit(2)
    upstreams = upstream or ["http://127.0.0.1:8000"]
    gw = GatewayConfig(host=host, port=port, upstream_url=upstreams[0], run_id=cfg.run_id, policy=cfg.policy,
                       served_model=served_model, session_idle_s=session_idle_s, queue_size=queue_size,
                       session_stitching=session_stitching, gateway_id=gateway_id or "",
                       spool_dir=(spool_dir or default_spool_dir(port)) if spool else None,
                       spool_max_bytes=spool_max_bytes, spool_after_s=spool_after_s, prometheus_port=prometheus_port,
                       request_logprobs=logprobs, metrics_host=metrics_host, max_body_bytes=max_body_bytes,
                       max_concurrent_requests=max_concurrent_requests, body_read_timeout_s=body_read_timeout_s,
                       max_open_sessions=max_open_sessions, max_choices=cfg.streams.max_allowed_group_size,
                       upstream_api_key=upstream_api_key or secret_value(cfg.inference.api_key),
                       **({"feedback_categories": categories} if categories else {}))
    spooled = f"spool {gw.spool_dir}" if gw.spool_dir else "no spool"
    console.print(f"gateway on http://{host}:{port} -> {gw.upstream_shown} (policy {cfg.policy}, {spooled})",
                  highlight=False)
    from rlstream.rollout.gateway.server import run

    if keys.enabled:
        console.print(f"clients authenticate with API keys ({len(keys)} loaded"
                      f"{', file ' + str(api_keys_file) if api_keys_file else ''})", highlight=False)
    elif insecure_no_auth:
        console.print(f"WARNING: no API keys on {host}: anyone who reaches it may call and reward", highlight=False)
    else:
        console.print("no API keys: serving loopback only, every caller trusted (--api-key or --api-keys-file "
                      "to authenticate clients)", highlight=False)
    run(_serve(cfg, gw, route_versions, access, upstreams))


def _categories(pairs: list[str]) -> dict[str, float]:
    """``NAME=REWARD`` pairs as the categories table (ValueError naming the bad pair)."""
    import math

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


def _field_errors(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):  # its message may quote a key: fields and problems only
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return type(exc).__name__ if not isinstance(exc, OSError) else str(exc)


async def _serve(cfg, gw, route_versions: bool, access, upstreams: list[str]) -> None:  # type: ignore[no-untyped-def]
    from rlstream.rollout.gateway.app import Gateway
    from rlstream.rollout.gateway.server import serve_forever
    from rlstream.rollout.publisher import TrajectoryPublisher
    from rlstream.rollout.routing import FleetRouter, StaticFleet
    from rlstream.schemas.codec import codec_for
    from rlstream.schemas.topics import TopicNames
    from rlstream.transport.control import ControlPlane
    from rlstream.transport.metrics import MetricsPublisher

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
        control, cfg.policy, gw.served_model, session_ttl_s=gw.session_idle_s) if control is not None else None
    if fleet is None and len(upstreams) > 1:  # replicas named here: each serves the configured version
        fleet = StaticFleet(upstreams, cfg.policy, gw.served_model, gw.policy_version)
    try:
        await publisher.start()
    except Exception as exc:  # Kafka down at start: serve anyway, capture counts the failures
        console.print(f"Kafka not reachable yet ({exc}); serving, capture will retry", highlight=False)
    try:
        await serve_forever(Gateway(gw, publisher, metrics=metrics, access=access, fleet=fleet))
    finally:
        await _close_publisher(publisher, gw.drain_timeout_s, spooled=gw.spool_dir is not None)
        if control is not None:
            await control.close()


async def _close_publisher(publisher, timeout_s: float, spooled: bool) -> None:  # type: ignore[no-untyped-def]
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
        console.print(f"some captured events were not written ({problem}); {where}", highlight=False)
