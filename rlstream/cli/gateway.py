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
    upstream: Optional[list[str]] = typer.Option(None, help="OpenAI-compatible upstream (vLLM), e.g. http://host:8000; "
                                                 "repeatable: replicas of the policy (without Redis routing); "
                                                 "default gateway.upstreams, else inference.url"),
    host: Optional[str] = typer.Option(None, help="address to bind (default gateway.host)"),
    port: Optional[int] = typer.Option(None, help="port to serve (default gateway.port; 0 = a free port)"),
    gateway_id: Optional[str] = typer.Option(None, help="this gateway's name on the calls it publishes "
                                             "(default gateway.gateway_id, else host:port)"),
    spool_dir: Optional[Path] = typer.Option(None, help="this process's spool directory (default gateway.spool_dir, "
                                             "else $XDG_STATE_HOME/rlstream/gateway-spool/PORT)"),
    prometheus_port: Optional[int] = typer.Option(None, help="serve the gateway's metrics to Prometheus on this port "
                                                  "(default gateway.prometheus_port)"),
    upstream_api_key: Optional[str] = typer.Option(None, envvar="RLSTREAM_GATEWAY_UPSTREAM_API_KEY",
                                                   show_default=False, help="the upstream's API key (vLLM's "
                                                   "--api-key); default gateway.upstream_api_key, else "
                                                   "inference.api_key; also RLSTREAM_GATEWAY_UPSTREAM_API_KEY"),
    api_key: Optional[list[str]] = typer.Option(None, "--api-key", help="a client key (Authorization: Bearer KEY) of "
                                                "the default tenant with every scope; repeatable; also "
                                                "RLSTREAM_GATEWAY_API_KEYS (comma separated)"),
    api_keys_file: Optional[Path] = typer.Option(None, help="YAML or JSON keys file: per key a tenant, scopes, "
                                                 "models, tasks, rpm, max_concurrent; re-read when it changes "
                                                 "(default gateway.api_keys_file)"),
    feedback_secret: Optional[str] = typer.Option(None, envvar="RLSTREAM_GATEWAY_FEEDBACK_SECRET",
                                                  help="HMAC secret of the feedback tokens (at least 16 bytes; the "
                                                  "same on every gateway behind one load balancer); default "
                                                  "gateway.feedback_secret, else a random one per start",
                                                  show_default=False),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth", help="serve a non-loopback address without "
                                          "API keys (anyone who reaches it can steer training)"),
) -> None:
    """Serve the OpenAI API in front of UPSTREAM and capture every call; every other setting is the gateway section
    of the configuration (-o gateway.KEY VALUE, RLSTREAM_GATEWAY__KEY; docs/configuration.md)."""
    from rlstream.gateway.service import GatewayOptions, GatewayStartError, run_gateway

    cfg = load_or_exit(config, override)
    options = GatewayOptions(
        upstreams=upstream or [], host=host, port=port, gateway_id=gateway_id, spool_dir=spool_dir,
        prometheus_port=prometheus_port, upstream_api_key=upstream_api_key, api_keys=api_key or [],
        api_keys_file=api_keys_file, feedback_secret=feedback_secret, insecure_no_auth=insecure_no_auth)
    try:
        run_gateway(cfg, options, say=lambda line: console.print(line, highlight=False))
    except GatewayStartError as exc:
        console.print(str(exc), highlight=False)
        raise typer.Exit(2) from None
