"""Ernie-4.5 dense (``Ernie4_5ForCausalLM``) through the Llama-family model.

It differs from Llama by rotary over interleaved feature pairs, biases on every projection
(``use_bias``) and tied embeddings by default. Greedy tokens of a tiny random checkpoint must
equal ``transformers``' in float32 at tensor-parallel sizes 1 and 2 (gloo, two processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Ernie4_5Config, Ernie4_5ForCausalLM
from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5RotaryEmbedding, apply_rotary_pos_emb

from fastdeploy.model_executor.layers.rotary_embedding import InterleavedRotaryEmbedding
from tests.greedy_tokens import TOKEN_PROMPTS, engine_greedy_tokens, transformers_greedy_tokens

MAX_TOKENS = 12
TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def save_tiny_ernie(folder: Path, use_bias: bool, tie_word_embeddings: bool) -> list[list[int]]:
    """Save a random tiny Ernie-4.5 checkpoint in ``folder``; return transformers' greedy tokens."""
    torch.manual_seed(0)
    config = Ernie4_5Config(**TINY, use_bias=use_bias, tie_word_embeddings=tie_word_embeddings)
    reference = Ernie4_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():  # large enough that greedy tokens vary
            if "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.5 if "embed" in name else 0.2)
    reference.save_pretrained(folder)
    return transformers_greedy_tokens(reference, TOKEN_PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(
    ("use_bias", "tied", "tp"),
    [(True, True, 1), (True, True, 2), (False, False, 1), (False, False, 2)],
    ids=["bias-tied-tp1", "bias-tied-tp2", "nobias-untied-tp1", "nobias-untied-tp2"],
)
def test_tiny_random_ernie_equals_transformers(tmp_path: Path, use_bias: bool, tied: bool, tp: int):
    expected = save_tiny_ernie(tmp_path, use_bias, tied)
    assert engine_greedy_tokens(str(tmp_path), TOKEN_PROMPTS, MAX_TOKENS, tp) == expected


def test_interleaved_rotary_matches_transformers():
    torch.manual_seed(0)
    config = Ernie4_5Config(**TINY)
    num_tokens, num_heads, head_dim = 7, 3, config.head_dim
    positions = torch.randint(0, 200, (num_tokens,))
    x = torch.randn(num_tokens, num_heads * head_dim + 5)  # trailing features must stay untouched
    cos, sin = Ernie4_5RotaryEmbedding(config)(x, positions[None])
    heads = x[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim).transpose(0, 1)[None]
    expected, _ = apply_rotary_pos_emb(heads, heads, cos, sin)
    expected = expected[0].transpose(0, 1).reshape(num_tokens, -1)
    rope = InterleavedRotaryEmbedding(
        head_dim, config.max_position_embeddings, config.rope_parameters["rope_theta"]
    )
    out = x.clone()
    rope(positions, out, num_heads)
    torch.testing.assert_close(out[:, : num_heads * head_dim], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, num_heads * head_dim :], x[:, num_heads * head_dim :])
