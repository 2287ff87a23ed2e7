"""A LiteLLM callback that publishes the chat completions made through LiteLLM (its SDK or its proxy) as rlstream
trajectories (LiteLLM has no Kafka logger of its own).

Each successful call for the policy's models becomes one TrajectoryEvent (source ``production``, group of one, its
task from the call's metadata ``rlstream_task`` or the logger's default), with the exact token ids and logprobs when
the upstream returned them (vLLM behind LiteLLM with ``extra_body: {"return_token_ids": true}`` and
``logprobs: true``), else the messages alone (the learner then re-tokenizes them). Rewards come later on the
``rewards`` topic (``rlstream.integrations.litellm`` puts the trajectory id in the metadata LiteLLM logs, and the
response id ``chatcmpl-...`` names it in the trajectory's metadata).

The proxy loads it from its config (``litellm_settings: callbacks: rlstream.integrations.litellm.proxy_handler``),
built from rlstream's config file (``RLSTREAM_CONFIG``) and environment (``RLSTREAM_*``). Publication never fails a
call: an error is logged and counted (``RlstreamLogger.stats``).

The hook is LiteLLM's documented ``CustomLogger.async_log_success_event(kwargs, response_obj, start_time,
end_time)``; without LiteLLM installed the class keeps the same interface (and its tests call it so).
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from rlstream.rollout.capture import RecordedCall, Recording, token_data, to_message
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import TrajectoryEvent, TrajectorySource, Turn, new_id
from rlstream.transport.log import get_logger

log = get_logger(__name__)

try:  # LiteLLM's base class where LiteLLM is installed (the proxy); the same hooks otherwise
    from litellm.integrations.custom_logger import CustomLogger  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    class CustomLogger:  # type: ignore[no-redef]
        """The part of LiteLLM's ``CustomLogger`` interface this callback implements."""

        def __init__(self, **kwargs: Any) -> None:
            pass

        async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any,
                                          end_time: Any) -> None:
            return None

        async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any,
                                          end_time: Any) -> None:
            return None

#: the call metadata key that names the task (the baseline key) of a call
TASK_METADATA = "rlstream_task"


@dataclass
class LoggerStats:
    published: int = 0
    skipped: int = 0  # calls for models that are not the policy's
    failed: int = 0  # calls that could not be turned into a trajectory or published (logged)


def _metadata(kwargs: dict[str, Any]) -> dict[str, Any]:
    params = kwargs.get("litellm_params") or {}
    meta = params.get("metadata") if isinstance(params, dict) else None
    return meta if isinstance(meta, dict) else {}


def _as_dict(obj: Any) -> Any:
    """A LiteLLM ModelResponse / message (pydantic) as plain data, extras included."""
    dump = getattr(obj, "model_dump", None)
    return dump() if callable(dump) else obj


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else None


def trajectory_of_call(kwargs: dict[str, Any], response_obj: Any, *, run_id: str, policy: str, policy_version: int,
                       task: str | None = None, producer_id: str = "litellm") -> TrajectoryEvent:
    """The TrajectoryEvent of one LiteLLM chat completion (``kwargs`` and ``response_obj`` as LiteLLM hands them to
    a callback). Raises ValueError when the call is no chat completion."""
    messages = kwargs.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("the call has no chat messages")
    response = _as_dict(response_obj)
    choices = _get(response, "choices") or []
    if not choices:
        raise ValueError("the response has no choices")
    prompt_ids, completion_ids, logprobs = token_data(response)
    if completion_ids is not None and logprobs is not None and len(logprobs) != len(completion_ids):
        logprobs = None
    params = kwargs.get("optional_params") or {}
    temperature = params.get("temperature") if isinstance(params, dict) else None
    model = str(kwargs.get("model") or _get(response, "model") or policy)
    turn = Turn(model=model, prompt_token_ids=prompt_ids, completion_token_ids=completion_ids,
                completion_logprobs=logprobs, trainable=True, finish_reason=_get(choices[0], "finish_reason"),
                policy_version=policy_version,
                temperature=float(temperature) if isinstance(temperature, (int, float)) else None)
    recording = Recording()
    recording.add(RecordedCall(request_messages=[to_message(m) for m in messages],
                               response_message=to_message(_get(choices[0], "message") or {"role": "assistant"}),
                               turn=turn, served_model=model))
    trajectory_id = new_id()
    meta = _metadata(kwargs)
    task = str(meta.get(TASK_METADATA) or task or "") or None
    info = {"capture": "litellm"}
    if task:
        info["task"] = task
    response_id = _get(response, "id")
    if isinstance(response_id, str):
        info["response_id"] = response_id
    event = recording.to_event(run_id=run_id, example_id=task or trajectory_id, group_id=trajectory_id,
                               group_size=1, generation_index=0, policy=policy, policy_version=policy_version,
                               metadata=info, source=TrajectorySource.production, producer_id=producer_id)
    return event.model_copy(update={"trajectory_id": trajectory_id})


class RlstreamLogger(CustomLogger):  # type: ignore[misc]
    """LiteLLM callback: each successful chat completion for ``models`` (None: every model) goes to ``trajectories``
    through ``publisher`` (started on first use)."""

    def __init__(self, publisher: TrajectoryPublisher, *, run_id: str, policy: str, policy_version: int = 0,
                 models: set[str] | None = None, task: str | None = None) -> None:
        super().__init__()
        self.publisher = publisher
        self.run_id, self.policy, self.policy_version = run_id, policy, policy_version
        self.models, self.task = models, task
        self.stats = LoggerStats()
        self._started: asyncio.Task[Any] | None = None

    @classmethod
    def from_config(cls, config_path: str | None = None, **kwargs: Any) -> "RlstreamLogger":
        """From rlstream's config (``config_path``, else ``RLSTREAM_CONFIG``; ``RLSTREAM_*`` overrides)."""
        from rlstream.schemas.config import load_config
        from rlstream.schemas.topics import TopicNames

        cfg = load_config(config_path or os.environ.get("RLSTREAM_CONFIG") or None, [])
        names = TopicNames.from_config(cfg.topics)
        publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards)
        return cls(publisher, run_id=cfg.run_id, policy=cfg.policy,
                   models=kwargs.pop("models", {cfg.policy, cfg.rollout.model}), **kwargs)

    async def _ensure_started(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self.publisher.start())
        await self._started

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        """LiteLLM's success hook: publish the call as a trajectory (never raises)."""
        try:
            model = str(kwargs.get("model") or "")
            if self.models is not None and model not in self.models:
                self.stats.skipped += 1
                return
            event = trajectory_of_call(kwargs, response_obj, run_id=self.run_id, policy=self.policy,
                                       policy_version=self.policy_version, task=self.task)
            await self._ensure_started()
            await self.publisher.publish_trajectory(event)
            meta = _metadata(kwargs)
            meta["rlstream_trajectory_id"] = event.trajectory_id  # LiteLLM logs it with the call
            self.stats.published += 1
        except Exception as exc:  # a call is never failed by its capture
            self.stats.failed += 1
            log.warning("LiteLLM call not published as a trajectory", error=str(exc), kind=type(exc).__name__)

    async def close(self) -> None:
        if self._started is not None:
            await self.publisher.close()


def __getattr__(name: str) -> Any:
    """``proxy_handler``: the logger the LiteLLM proxy's config names, built on first use from rlstream's config
    (importing this module needs no configuration)."""
    if name == "proxy_handler":
        handler = globals().get("_proxy_handler")
        if handler is None:
            handler = globals()["_proxy_handler"] = RlstreamLogger.from_config()
        return handler
    raise AttributeError(name)


__all__ = ["RlstreamLogger", "trajectory_of_call", "proxy_handler", "TASK_METADATA"]
