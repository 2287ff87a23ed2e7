"""The trained model: load any transformers causal LM, LoRA (peft) or full, pick device and dtype,
compute completion logprobs, and provide the KL reference."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from rlstream.learner.batch import Batch
from rlstream.learner.grpo import DEFAULT_LOGPROB_CHUNK, token_entropy, token_logprobs
from rlstream.transport.log import get_logger
from rlstream.schemas.config import ConfigError, LearnerConfig

if TYPE_CHECKING:
    from rlstream.learner.distributed import DataParallel
    from rlstream.learner.sharded import Sharding

log = get_logger(__name__)


def pick_device(requested: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("learner.device is cuda but no CUDA device is available")
    return torch.device(requested)


def pick_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU, bf16 on GPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class Policy:
    """A model being trained, its tokenizer and how to get reference logprobs."""

    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    lora: bool
    base_model: str
    reference: Any = None  # frozen copy (full fine-tuning with beta > 0)
    publish_merged: bool = False  # LoRA: versions are published as full weights (the adapter merged in)
    sharding: "Sharding | None" = None  # learner.parallelism fsdp: the model is sharded over the ranks

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer is not None else 0
        return int(pad)

    @property
    def vocab_size(self) -> int | None:
        """Rows of the input embedding: token ids must lie in ``[0, vocab_size)``."""
        embeddings = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        return int(embeddings.num_embeddings) if embeddings is not None else None

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def nonfinite_parameters(self) -> list[str]:
        """Names of the trainable parameters holding a NaN or an infinity (the only ones training changes); when
        sharded, over every rank's shards (a collective)."""
        if self.sharding is not None:
            return self.sharding.nonfinite(self.model)
        return nonfinite_parameters(self.model)

    @contextlib.contextmanager
    def publishable(self) -> Iterator["Policy"]:
        """The policy whose ``model`` holds the whole weights, to write a version from: this one, or, when sharded,
        rank 0's host copy holding the gathered weights (a collective; see :mod:`rlstream.learner.sharded`)."""
        if self.sharding is None:
            yield self
            return
        with self.sharding.publishable(self) as plain:
            yield plain

    @contextlib.contextmanager
    def reference_mode(self) -> Iterator[Any]:
        """Yield the reference model: the base with the adapter disabled (LoRA) or the frozen copy (full)."""
        if self.lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            if self.reference is None:
                raise RuntimeError("no reference model (full fine-tuning builds one only when beta > 0)")
            yield self.reference


class ModelDirectoryError(ConfigError):
    """The model to train is not a local transformers model directory (models are never downloaded)."""


def require_model_dir(value: str | Path, key: str = "learner.model") -> Path:
    """``value`` as an existing transformers model directory (one with a ``config.json``), else
    :class:`ModelDirectoryError` saying what is wrong and what to do."""
    if not str(value):
        raise ModelDirectoryError(f"{key} is empty: give the path of a transformers model directory")
    path = Path(value).expanduser()
    advice = "models are never downloaded: give a local transformers model directory (`rlstream models tiny DIR` " \
             "builds a small test model)"
    if not path.exists():
        raise ModelDirectoryError(f"model directory {path} does not exist ({key}); {advice}")
    if not path.is_dir():
        raise ModelDirectoryError(f"{path} ({key}) is a file, not a model directory; {advice}")
    if not (path / "config.json").is_file():
        raise ModelDirectoryError(f"{path} ({key}) has no config.json: not a transformers model directory; {advice}")
    return path


def load_policy(cfg: LearnerConfig, model_path: str | Path | None = None, *, with_reference: bool | None = None,
                parallel: "DataParallel | None" = None, device: torch.device | None = None) -> Policy:
    """Load ``cfg.model`` (or ``model_path``) for training as the config says (LoRA or full), on ``device``
    (default: ``learner.device``). With a sharded ``parallel`` (``learner.parallelism: fsdp``) the model is loaded
    in fp32 on the host and sharded over the ranks onto ``device`` (:mod:`rlstream.learner.sharded`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(require_model_dir(model_path or cfg.model))
    device = device if device is not None else pick_device(cfg.device)
    dtype = pick_dtype(device)
    sharded = parallel is not None and parallel.sharded
    # sharded: fp32 master weights on the host, each rank's shards moved to the device when sharded
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if sharded else dtype,
                                                 local_files_only=True)
    if not sharded:
        model = model.to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer with the model; turns must carry token ids", model=path, error=str(exc))
        tokenizer = None
    need_ref = cfg.beta > 0 if with_reference is None else with_reference
    reference = None
    torch.manual_seed(cfg.seed)  # the adapter's initialisation is reproducible (and equal on every rank)
    if cfg.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(model, PeftLoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"))
    elif need_ref:
        reference = copy.deepcopy(model).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    log.info("policy loaded", model=path, device=str(device), dtype=str(dtype), lora=cfg.lora.enabled,
             trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
             gradient_checkpointing=cfg.gradient_checkpointing, sharded=sharded)
    policy = Policy(model=model, tokenizer=tokenizer, device=device, dtype=dtype, lora=cfg.lora.enabled,
                    base_model=path, reference=reference, publish_merged=cfg.lora.enabled and cfg.lora.publish_merged)
    if sharded:
        from rlstream.learner.sharded import shard_policy

        assert parallel is not None
        policy = shard_policy(policy, parallel, cfg)
    return policy


def nonfinite_parameters(model: Any) -> list[str]:
    """Names of the trainable parameters of ``model`` that hold a NaN or an infinity."""
    with torch.no_grad():
        return [name for name, p in model.named_parameters() if p.requires_grad and not bool(torch.isfinite(p).all())]


def completion_logprobs(model: Any, batch: Batch, temperature: float | torch.Tensor | None = None,
                        chunk_size: int = DEFAULT_LOGPROB_CHUNK) -> torch.Tensor:
    """Logprobs (B, T) of the completion tokens of ``batch`` under ``model`` (float32), by the chunked selective
    log-softmax of :func:`grpo.token_logprobs` (``chunk_size`` positions at a time), each row at its sampling
    temperature (``batch.temperatures``; ``temperature`` overrides them)."""
    return completion_logprobs_and_entropy(model, batch, temperature, chunk_size, entropy_stride=None)[0]


def completion_logprobs_and_entropy(model: Any, batch: Batch, temperature: float | torch.Tensor | None = None,
                                    chunk_size: int = DEFAULT_LOGPROB_CHUNK,
                                    entropy_stride: int | None = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`completion_logprobs` and, from the same forward pass, the policy's entropy at every
    ``entropy_stride``-th completion position (:func:`grpo.token_entropy`, no gradient; shape
    ``(B, ceil(T / stride))``; None when ``entropy_stride`` is None). A full-vocabulary pass per position costs about
    a tenth of a small model's step on a GPU, so the learner measures a strided sample of positions."""
    t = batch.completion_len
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False, logits_to_keep=t + 1)
    logits = out.logits[:, -t - 1:-1, :]
    if temperature is None:
        temperature = batch.temperatures if batch.temperatures is not None else 1.0
    logprobs = token_logprobs(logits, batch.completion_ids, temperature, chunk_size)
    if entropy_stride is None:
        return logprobs, None
    return logprobs, token_entropy(logits[:, ::entropy_stride], temperature, chunk_size)
