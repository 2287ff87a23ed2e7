"""What one gateway runs with: the ``gateway`` section of the main configuration (its one declaration of every
setting and default, :class:`rlstream.schemas.config.GatewayConfig`) resolved against the rest of it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from rlstream.schemas.config import (GatewayConfig, InferenceConfig, KafkaConfig, RewardRulesConfig, RlstreamConfig,
                                     StreamsConfig)
from rlstream.schemas.masking import SecretUrl, mask_url


def _default(model: type[BaseModel], name: str) -> Any:
    """The default a configuration key declares (the resolved settings take it from there, not a copy)."""
    return model.model_fields[name].default


class GatewaySettings(GatewayConfig):
    """The gateway section with what it leaves to the rest of the configuration filled in: the upstreams (the first
    one is :attr:`upstream_url`), the run and policy, the upstream's model name and key, the largest ``n``, the spool
    directory (None: no spool)."""

    run_id: str = Field(_default(RlstreamConfig, "run_id"), description="the run")
    policy: str = Field(_default(RlstreamConfig, "policy"), description="the policy the captured trajectories train")
    upstream_url: SecretUrl = Field(_default(InferenceConfig, "url"), description="the upstream (with or without /v1)")
    served_model: str = Field(_default(InferenceConfig, "served_model"),
                              description="the base model name at the upstream")
    max_choices: int = Field(_default(StreamsConfig, "max_allowed_group_size"), ge=1,
                             description="largest n a chat request may ask for (400)")
    spool_dir: Path | None = Field(None, description="the on-disk spool; None: no spool")
    max_body_bytes: int = Field(_default(KafkaConfig, "max_message_bytes") // 2, ge=1024,
                                description="largest request body (413)")
    max_session_bytes: int = Field(_default(KafkaConfig, "max_message_bytes") // 2, ge=1024,
                                   description="approximate bytes of one session trajectory (split past it)")
    reward_window_s: float = Field(_default(StreamsConfig, "reward_window_s"), gt=0,
                                   description="how long the ids feedback names and stored Responses are kept "
                                   "(streams.reward_window_s)")
    temperature_range: tuple[float, float] = Field(_default(StreamsConfig, "temperature_range"),
                                                   description="a sampled temperature outside it is answered 400 "
                                                   "(streams.temperature_range)")
    correction_window_s: float = Field(_default(RewardRulesConfig, "correction_window_s"), ge=0,
                                       description="a correction of a single's feedback after its capture plus "
                                       "this is answered 409 (streams.reward.correction_window_s)")

    @classmethod
    def resolve(cls, cfg: RlstreamConfig, section: GatewayConfig | None = None) -> "GatewaySettings":
        """``section`` (default ``cfg.gateway``) with its unset keys taken from ``cfg``."""
        gw = section if section is not None else cfg.gateway
        resolved = {"upstreams", "upstream_api_key", "served_model", "max_choices", "spool_dir", "max_body_bytes",
                    "max_session_bytes"}
        record_max = cfg.kafka.max_message_bytes
        for name in ("max_body_bytes", "max_session_bytes"):
            value = getattr(gw, name)
            if value is not None and value >= record_max:  # answered 2xx, then dropped by the producer
                raise ValueError(f"gateway.{name} ({value}) must stay below kafka.max_message_bytes ({record_max}): "
                                 "a call Kafka cannot take would be answered and never captured")
        values = {name: getattr(gw, name) for name in GatewayConfig.model_fields if name not in resolved}
        return cls(**values, run_id=cfg.run_id, policy=cfg.policy,
                   upstreams=list(gw.upstreams) or [cfg.inference.url],
                   upstream_url=gw.upstreams[0] if gw.upstreams else cfg.inference.url,
                   upstream_api_key=gw.upstream_api_key if gw.upstream_api_key is not None else cfg.inference.api_key,
                   served_model=gw.served_model or cfg.inference.served_model,
                   max_choices=gw.max_choices or cfg.streams.max_allowed_group_size,
                   max_body_bytes=gw.max_body_bytes or record_max // 2,
                   max_session_bytes=gw.max_session_bytes or record_max // 2,
                   temperature_range=cfg.streams.temperature_range, reward_window_s=cfg.streams.reward_window_s,
                   correction_window_s=cfg.streams.reward.correction_window_s,
                   spool_dir=(gw.spool_dir or default_spool_dir(gw.port)) if gw.spool else None)

    @property
    def upstream_base(self) -> str:
        """The upstream URL ending in ``/v1``."""
        url = self.upstream_url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def upstream_shown(self) -> str:
        """:attr:`upstream_base` as logs may show it (a password in it masked)."""
        return mask_url(self.upstream_base)

    @property
    def upstream_key(self) -> str | None:
        """The clear value of :attr:`upstream_api_key`."""
        return self.upstream_api_key.get_secret_value() if self.upstream_api_key is not None else None


def default_spool_dir(port: int) -> Path:
    """``$XDG_STATE_HOME/rlstream/gateway-spool/<port>`` (``~/.local/state`` without XDG_STATE_HOME): a gateway
    restarted on the same port finds what its predecessor spooled."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "rlstream" / "gateway-spool" / str(port)

