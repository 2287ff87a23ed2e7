"""Which modules the sharded learner makes FSDP units of their own: untied input embeddings and LM head each get
one (the root would otherwise hold them gathered through the whole forward and backward); tied ones, one weight
at both ends, stay with the root."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlstream.learner.sharded import decoder_layers, embedding_units


def _model(tied: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))


def test_untied_embeddings_and_head_are_units_of_their_own() -> None:
    model = _model(tied=False)
    units = embedding_units(model)
    assert units == [model.get_input_embeddings(), model.get_output_embeddings()]
    assert len(decoder_layers(model)) == 2


def test_tied_embeddings_stay_with_the_root() -> None:
    model = _model(tied=True)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert embedding_units(model) == []


def test_a_model_without_embeddings_has_no_such_units() -> None:
    assert embedding_units(torch.nn.Linear(4, 4)) == []
