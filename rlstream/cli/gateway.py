"""``rlstream gateway``: the OpenAI-compatible capture gateway."""
from __future__ import annotations

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
    from rlstream.gateway.service import GatewayOptions, GatewayStartError, run_gateway

    cfg = load_or_exit(config, override)
    options = GatewayOptions(
        upstreams=upstream or ["http://127.0.0.1:8000"], host=host, port=port, served_model=served_model,
        session_idle_s=session_idle_s, session_stitching=session_stitching, gateway_id=gateway_id,
        queue_size=queue_size, spool=spool, spool_dir=spool_dir, spool_max_bytes=spool_max_bytes,
        spool_after_s=spool_after_s, route_versions=route_versions, prometheus_port=prometheus_port,
        upstream_api_key=upstream_api_key, metrics_host=metrics_host, max_body_bytes=max_body_bytes,
        max_concurrent_requests=max_concurrent_requests, body_read_timeout_s=body_read_timeout_s,
        max_open_sessions=max_open_sessions, logprobs=logprobs, api_keys=api_key or [], api_keys_file=api_keys_file,
        feedback_secret=feedback_secret, feedback_token_ttl_s=feedback_token_ttl_s,
        insecure_no_auth=insecure_no_auth, feedback_categories=feedback_category or [])
    try:
        run_gateway(cfg, options, say=lambda line: console.print(line, highlight=False))
    except GatewayStartError as exc:
        console.print(str(exc), highlight=False)
        raise typer.Exit(2) from None
