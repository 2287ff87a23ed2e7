"""From TrajectoryGroups to padded training tensors.

One *sample* per trainable turn of the target model/functions: its prompt and completion token ids (recorded
by the rollout, or rebuilt with the tokenizer's chat template from the messages), the behaviour logprobs when
recorded, and its trajectory's advantage. Prompts are left-padded and completions right-padded, so the
completion occupies the last ``T`` positions of every row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from rlstream.schemas.models import GroupBaseline, Message, TrajectoryEvent, TrajectoryGroup, Turn
from rlstream.schemas.sampling import is_greedy

WORKFLOW = "<workflow>"


class BatchError(ValueError):
    """A group that cannot be turned into training samples (bad token data, no tokenizer...)."""


@dataclass
class Sample:
    """One trainable turn.

    ``group`` numbers the sample's group in the step; ``trajectory`` names its trajectory (its id), so that the
    turns of one trajectory share one advantage and count once in the group statistics. ``None`` = a
    trajectory of its own (one turn). ``policy_version`` is the version that produced the turn (the turn's own when
    recorded, else its trajectory's); ``temperature`` the one its logprobs are computed at (:func:`sampling_temperature`).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float] | None
    reward: float
    group: int
    policy_version: int
    advantage: float = 0.0
    baseline: GroupBaseline | None = None  # a single response's keyed baseline (its advantage is against it)
    trajectory: str | None = None
    temperature: float = 1.0
    trainable: bool = True  # False: counts in its group's statistics, not trained (learner.max_lag_without_logprobs)


@dataclass
class Batch:
    """Padded tensors of a list of samples (left-padded prompts, right-padded completions)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    behaviour_logprobs: torch.Tensor | None
    samples: list[Sample] = field(default_factory=list)
    temperatures: torch.Tensor | None = None  # (B,) float32: each row's sampling temperature (None: all 1.0)

    @property
    def completion_len(self) -> int:
        return int(self.completion_ids.size(1))

    def to(self, device: torch.device | str) -> "Batch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.position_ids),
                     move(self.completion_ids), move(self.completion_mask), move(self.advantages),
                     move(self.behaviour_logprobs), self.samples, move(self.temperatures))


def turn_is_target(turn: Turn, target_functions: Sequence[str], target_model: str | None) -> bool:
    """A turn is trained when it is trainable, from the target model (if one is set) and of a target
    function (``<workflow>`` in the list means every function)."""
    if not turn.trainable:
        return False
    if target_model and turn.model and turn.model != target_model:
        return False
    if WORKFLOW in target_functions:
        return True
    return turn.function is not None and turn.function in target_functions


def _message_dict(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.name:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    return d


def _template_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def tokens_from_messages(tokenizer: Any, messages: list[Message], message_index: int) -> tuple[list[int], list[int]]:
    """Prompt and completion ids of the assistant message at ``message_index`` via the chat template."""
    if tokenizer is None:
        raise BatchError("turn has no token ids and no tokenizer was given")
    if not 0 < message_index < len(messages) or messages[message_index].role != "assistant":
        raise BatchError(f"message_index {message_index} is not an assistant message")
    history = [_message_dict(m) for m in messages[:message_index]]
    prompt = _template_ids(tokenizer, history, add_generation_prompt=True)
    full = _template_ids(tokenizer, history + [_message_dict(messages[message_index])], add_generation_prompt=False)
    if full[: len(prompt)] != prompt or len(full) <= len(prompt):
        raise BatchError("chat template does not extend the prompt with the assistant message")
    completion = full[len(prompt):]
    # The template may add a newline after the end-of-turn token; train up to and including end of turn.
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos in completion:
        completion = completion[: completion.index(eos) + 1]
    return prompt, completion


def _implicit_turns(traj: TrajectoryEvent) -> list[Turn]:
    """Traffic recorded without turns: every assistant message is one turn of the trajectory's target."""
    return [Turn(message_index=i, function=traj.target) for i, m in enumerate(traj.messages) if m.role == "assistant"]


def sampling_temperature(turn: Turn, where: str) -> float:
    """The temperature the learner computes a turn's logprobs at: the one it was sampled at; 1.0 when none was
    recorded, and for a greedy call (below vLLM's greedy threshold, 0 included: no sampling distribution to match).
    Raises :class:`BatchError` for a negative or non-finite temperature."""
    t = turn.temperature
    if t is not None and (not math.isfinite(t) or t < 0):
        raise BatchError(f"{where}: sampling temperature {t} is not a finite number >= 0")
    if t is None or is_greedy(t):  # below vLLM's greedy threshold the call was decoded greedily
        return 1.0
    return float(t)


def check_token_ids(ids: Sequence[int], vocab_size: int | None, what: str) -> None:
    """Raise :class:`BatchError` for a token id outside ``[0, vocab_size)`` (an embedding look-up would fail:
    an IndexError on CPU, a device-side assert that kills the process on CUDA)."""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        raise BatchError(f"{what}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")


def samples_from_trajectory(traj: TrajectoryEvent, group: int, tokenizer: Any, target_functions: Sequence[str],
                            target_model: str | None, vocab_size: int | None = None) -> list[Sample]:
    """The samples of one trajectory (its trainable turns of the target).

    Raises :class:`BatchError` when the trajectory cannot be trained on: no or a non-finite reward, token ids
    outside ``[0, vocab_size)``, logprobs that do not match the completion or are not finite.
    """
    if traj.reward is None:
        raise BatchError(f"trajectory {traj.trajectory_id} has no reward")
    if not math.isfinite(traj.reward):
        raise BatchError(f"trajectory {traj.trajectory_id} has a non-finite reward {traj.reward}")
    samples = []
    for turn in traj.turns or _implicit_turns(traj):
        if not turn_is_target(turn, target_functions, target_model):
            continue
        if turn.prompt_token_ids and turn.completion_token_ids:
            prompt, completion = list(turn.prompt_token_ids), list(turn.completion_token_ids)
            logprobs = list(turn.completion_logprobs) if turn.completion_logprobs else None
            if logprobs is not None and len(logprobs) != len(completion):
                raise BatchError(f"trajectory {traj.trajectory_id}: {len(logprobs)} logprobs for "
                                 f"{len(completion)} completion tokens")
            if logprobs is not None and not all(math.isfinite(lp) for lp in logprobs):
                raise BatchError(f"trajectory {traj.trajectory_id}: non-finite behaviour logprobs")
        else:
            if turn.message_index is None:
                raise BatchError(f"trajectory {traj.trajectory_id}: turn without token ids nor message_index")
            prompt, completion = tokens_from_messages(tokenizer, traj.messages, turn.message_index)
            logprobs = None
        where = f"trajectory {traj.trajectory_id}"
        check_token_ids(prompt, vocab_size, f"{where} prompt")
        check_token_ids(completion, vocab_size, f"{where} completion")
        version = traj.policy_version if turn.policy_version is None else turn.policy_version
        samples.append(Sample(prompt, completion, logprobs, float(traj.reward), group, version,
                              trajectory=traj.trajectory_id, temperature=sampling_temperature(turn, where)))
    return samples


def mark_stale_rows_without_logprobs(samples: Sequence[Sample], version: int, max_lag: int | None) -> int:
    """Mark not ``trainable`` every row without behaviour logprobs produced more than ``max_lag`` versions before
    ``version`` (None: no bound); returns how many were marked.

    Such a row can only train with importance weight 1, as if on-policy: fine within a version or so, while the
    sampler is still close to the learner, but beyond that its gradient is off-policy with nothing correcting it
    (``bench/staleness.py``'s ``none`` correction: 17-27 % of the area lost at lag 4)."""
    if max_lag is None:
        return 0
    marked = 0
    for sample in samples:
        if sample.behaviour_logprobs is None and version - sample.policy_version > max_lag:
            sample.trainable = False
            marked += 1
    return marked


def behaviour_version(group: TrajectoryGroup, samples: Sequence[Sample]) -> int:
    """The oldest policy version behind what the learner trains of ``group``: of its trainable turns (each turn's
    own version where recorded, so a session that straddles a reload counts the turns before it), else of its
    oldest member."""
    return min((s.policy_version for s in samples), default=group.min_policy_version)


def samples_from_groups(groups: Sequence[TrajectoryGroup], tokenizer: Any, target_functions: Sequence[str],
                        target_model: str | None, vocab_size: int | None = None) -> list[Sample]:
    """Samples of every group, numbered by group (advantages are filled in later)."""
    out: list[Sample] = []
    for g, group in enumerate(groups):
        for traj in group.trajectories:
            samples = samples_from_trajectory(traj, g, tokenizer, target_functions, target_model, vocab_size)
            for s in samples:
                s.baseline = group.baseline
            out.extend(samples)
    return out


def collate(samples: Sequence[Sample], pad_id: int, max_completion_len: int | None = None) -> Batch:
    """Pad samples into a :class:`Batch` (behaviour logprobs: NaN-free; rows without them reuse 0 and are
    flagged by ``behaviour_logprobs is None`` only when no sample has them)."""
    if not samples:
        raise BatchError("no samples to collate")
    p_len = max(len(s.prompt_ids) for s in samples)
    c_len = max(len(s.completion_ids) for s in samples)
    if max_completion_len:
        c_len = max(c_len, max_completion_len)
    n = len(samples)
    prompt = torch.full((n, p_len), pad_id, dtype=torch.long)
    p_mask = torch.zeros((n, p_len), dtype=torch.long)
    comp = torch.full((n, c_len), pad_id, dtype=torch.long)
    c_mask = torch.zeros((n, c_len), dtype=torch.long)
    have_lp = any(s.behaviour_logprobs is not None for s in samples)
    behaviour = torch.zeros((n, c_len), dtype=torch.float32) if have_lp else None
    for i, s in enumerate(samples):
        if s.prompt_ids:
            prompt[i, p_len - len(s.prompt_ids):] = torch.tensor(s.prompt_ids)
            p_mask[i, p_len - len(s.prompt_ids):] = 1
        comp[i, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
        c_mask[i, : len(s.completion_ids)] = 1
        if behaviour is not None:
            if s.behaviour_logprobs is not None:
                behaviour[i, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs)
    attention = torch.cat([p_mask, c_mask], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return Batch(
        input_ids=torch.cat([prompt, comp], dim=1), attention_mask=attention, position_ids=positions,
        completion_ids=comp, completion_mask=c_mask,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        behaviour_logprobs=behaviour, samples=list(samples),
        temperatures=torch.tensor([s.temperature for s in samples], dtype=torch.float32),
    )


def behaviour_rows(batch: Batch) -> torch.Tensor:
    """1 for rows whose behaviour logprobs were recorded (the rest train on-policy)."""
    return torch.tensor([s.behaviour_logprobs is not None for s in batch.samples], dtype=torch.bool)
