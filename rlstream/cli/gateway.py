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
    upstream: str = typer.Option("http://127.0.0.1:8000", help="OpenAI-compatible upstream (vLLM), e.g. http://host:8000"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8100),
    served_model: str = typer.Option("policy", help="the base model name at the upstream"),
    session_idle_s: float = typer.Option(300.0, help="publish a session trajectory after this long idle"),
    queue_size: int = typer.Option(10_000, help="events waiting for Kafka before new ones are dropped"),
    route_versions: bool = typer.Option(True, help="route the policy's model name to the newest loaded version "
                                        "(Redis heartbeats of the inference workers)"),
) -> None:
    """Serve /v1/chat/completions in front of UPSTREAM and publish every call to the trajectories topic."""
    from rlstream.rollout.gateway.config import GatewayConfig

    cfg = load_or_exit(config, override)
    gw = GatewayConfig(host=host, port=port, upstream_url=upstream, run_id=cfg.run_id, policy=cfg.policy,
                       served_model=served_model, session_idle_s=session_idle_s, queue_size=queue_size)
    console.print(f"gateway on http://{host}:{port} -> {gw.upstream_base} (policy {cfg.policy})", highlight=False)
    asyncio.run(_serve(cfg, gw, route_versions))


async def _serve(cfg, gw, route_versions: bool) -> None:  # type: ignore[no-untyped-def]
    from rlstream.rollout.gateway.app import Gateway
    from rlstream.rollout.gateway.server import serve_forever
    from rlstream.rollout.publisher import TrajectoryPublisher
    from rlstream.rollout.routing import VersionRouter
    from rlstream.schemas.topics import TopicNames
    from rlstream.transport.control import ControlPlane

    topics = TopicNames.from_config(cfg.topics)
    publisher = TrajectoryPublisher.from_config(cfg.kafka, topics.trajectories, topics.rewards)
    control = ControlPlane(str(cfg.redis.url)) if route_versions and cfg.redis.url else None
    route = None
    if control is not None:
        router = VersionRouter(control, cfg.policy, gw.served_model)

        async def route() -> tuple[str, int]:  # type: ignore[misc]
            current = await router.current()
            return current.model, current.version
    try:
        await publisher.start()
    except Exception as exc:  # Kafka down at start: serve anyway, capture counts the failures
        console.print(f"Kafka not reachable yet ({exc}); serving, capture will retry", highlight=False)
    try:
        await serve_forever(Gateway(gw, publisher, route=route))
    finally:
        try:
            await publisher.close()
        except Exception as exc:
            console.print(f"some captured events were not written: {exc}", highlight=False)
        if control is not None:
            await control.close()
