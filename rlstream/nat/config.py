"""Settings of rlstream's three NAT components (``_type`` names ``rlstream_traj_builder``,
``rlstream_trainer_adapter``, ``rlstream_trainer``).

Names mirror the OpenPipe ART plugin where they mean the same thing (``num_generations``; the adapter's
``backend`` and ``training`` sections; ``backend.name`` is the run, ``backend.base_model`` the model trained).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from nat.data_models.finetuning import TrainerAdapterConfig, TrainerConfig, TrajectoryBuilderConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlstream.nat.keys import check_block


def _keys(model: type[BaseModel]) -> set[str]:
    """The keys a block accepts: its field names and aliases."""
    names = set(model.model_fields)
    for info in model.model_fields.values():
        for alias in (info.alias, info.validation_alias):
            if isinstance(alias, str):
                names.add(alias)
    return names


class RlstreamTrajectoryBuilderConfig(TrajectoryBuilderConfig, name="rlstream_traj_builder"):  # type: ignore[call-arg]
    """Runs NAT's evaluation ``num_generations`` times per epoch; the reward is ``reward_function.name``'s score."""

    num_generations: int = Field(2, ge=1, description="generations per example in the eval dataset (one GRPO group)")
    route_to_latest_version: bool = Field(
        True, description="send the target model's calls to the newest weight version vLLM has loaded (its LoRA "
        "name), by overriding llms.<target_model>.model_name for each evaluation run")
    capture_token_data: bool = Field(
        True, description="take each turn's token ids and logprobs from the target model's responses (vLLM's "
        "return_token_ids and logprobs; the target LLM, openai or rlstream_gateway, runs as rlstream_token_capture "
        "for the evaluation runs); turns without them are rendered with the chat template by the learner")
    include_tool_calls: bool = Field(True, description="tool calls are trained as tool calls (always; false is "
                                     "warned about)")
    min_episode_length: int = Field(0, ge=0, description="an episode with fewer messages is not "
                                    "trained on (logged)")

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        return check_block(data, _keys(cls), "trajectory_builders (_type: rlstream_traj_builder)")


class RlstreamBackendConfig(BaseModel):
    """Which rlstream deployment trains: an rlstream config file, and/or the fields that matter most.

    Fields set here win over the file; ``settings`` sets any other rlstream config key (dotted, as ``-o``).
    Without a broker or Redis, a local broker and Redis are started for the run.
    """

    model_config = ConfigDict(extra="forbid")

    config_file: Path | None = Field(None, description="an rlstream config YAML (rlstream config show prints one)")
    bootstrap_servers: str | None = Field(None, description="Kafka bootstrap servers (host:port[,host:port])")
    redis_url: str | None = Field(None, description="the control plane's Redis URL")
    policy: str | None = Field(None, description="the policy name (Kafka keys, Redis keys, LoRA names); default: "
                               "<project>-<a fresh id per run>, so that runs on one vLLM server never share "
                               "adapter names")
    project: str | None = Field(None, description="ART's project: the prefix of the run's policy name "
                                "(default 'policy')")
    name: str | None = Field(None, description="the run id of the trajectories (ART: the trainer run's name)")
    base_model: str | None = Field(None, description="the model the learner trains: a local transformers "
                                   "directory, or a model id in the Hugging Face cache; default: the base model "
                                   "the vLLM server serves (its /v1/models)")
    learning_rate: float | None = Field(None, gt=0, description="AdamW learning rate (learner.learning_rate; "
                                        "training.learning_rate wins)")
    batch_size: int | None = Field(None, ge=1, description="sequences per forward/backward "
                                   "(learner.micro_batch_size)")
    inference_url: str | None = Field(None, description="the vLLM server the workflow's target LLM calls "
                                      "(default: that LLM's base_url in this NAT config)")
    settings: dict[str, Any] = Field(default_factory=dict, description="other rlstream config keys, dotted "
                                     "(e.g. learner.lora.r: 8, topics.prefix: 'exp1.')")


class RlstreamTrainingConfig(BaseModel):
    """The learner's knobs that ART's ``training`` section also has (None = the rlstream config's value)."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | None = Field(None, gt=0, description="AdamW learning rate (learner.learning_rate)")
    beta: float | None = Field(None, ge=0, description="weight of the KL to the base model (learner.beta)")
    num_iterations: int | None = Field(None, ge=1, description="optimizer steps per batch (learner.num_iterations)")
    groups_per_step: int | None = Field(None, ge=1, description="groups in one learner step "
                                        "(learner.groups_per_step; num_iterations optimizer steps on them)")
    max_grad_norm: float | None = Field(None, gt=0, description="gradient clipping (learner.max_grad_norm)")

    def overrides(self) -> list[tuple[str, str]]:
        """The set fields as dotted ``learner.*`` overrides."""
        return [(f"learner.{key}", str(value)) for key, value in self.model_dump(exclude_none=True).items()]


class RlstreamTrainerAdapterConfig(TrainerAdapterConfig, name="rlstream_trainer_adapter"):  # type: ignore[call-arg]
    """Publishes trajectories to Kafka; a job is done when vLLM serves the version trained on them."""

    backend: RlstreamBackendConfig = Field(default_factory=RlstreamBackendConfig)
    training: RlstreamTrainingConfig | None = Field(None, description="learner knobs (ART's name)")
    wait_for_load: bool = Field(True, description="a job completes only once the inference workers load its version")
    collect_timeout_s: float = Field(120.0, gt=0, description="wait this long for the streams worker to emit "
                                     "the submitted groups")
    start_timeout_s: float = Field(300.0, gt=0, description="wait this long for vLLM to answer at start")
    continue_on_failure: bool = Field(False, description="go on with the next epoch after a failed job (the run "
                                      "still exits non-zero at the end); default: stop at the first failure, as "
                                      "ART's trainer does")
    validate_trajectories: bool = Field(True, description="trajectories are checked before training (always; "
                                        "false is warned about)")

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        return check_block(data, _keys(cls), "trainer_adapters (_type: rlstream_trainer_adapter)", {
            "backend": _keys(RlstreamBackendConfig), "training": _keys(RlstreamTrainingConfig)})


class RlstreamTrainerConfig(TrainerConfig, name="rlstream_trainer"):  # type: ignore[call-arg]
    """NAT's epoch loop: curriculum, validation every ``validation_interval`` epochs and after the last one."""

    poll_interval_s: float = Field(0.5, gt=0, description="how often a submitted job's status is read")
    seed: int = Field(0, description="seed of the curriculum's random subsample")

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        return check_block(data, _keys(cls), "trainers (_type: rlstream_trainer)")
