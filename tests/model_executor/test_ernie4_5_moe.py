"""Ernie-4.5-MoE (``Ernie4_5_MoeForCausalLM``) against ``transformers`` on tiny random checkpoints.

Sparse layers follow ``moe_layer_start_index`` / ``_end_index`` / ``_interval``; the router
picks experts by softmax + ``e_score_correction_bias`` (random here, so that the bias changes
the choice) but weights them by the plain softmax; shared experts add to every token. Greedy
float32 tokens must equal ``transformers``' at tensor-parallel sizes 1 and 2 (gloo), with
chunked prefill and prefix caching on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

from fastdeploy.model_executor.layers.fused_moe import select_experts
from fastdeploy.model_executor.models.ernie4_5_moe import is_ernie_sparse_layer
from fastdeploy.transformers_utils.config import ModelArchConfig
from tests.greedy_tokens import (
    CHUNKED_PREFIX_CACHED,
    TOKEN_PROMPTS,
    engine_greedy_tokens,
    transformers_greedy_tokens,
)

MAX_TOKENS = 10
TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    moe_num_experts=8,
    moe_k=2,
    moe_num_shared_experts=2,
    moe_layer_start_index=1,
    moe_layer_end_index=2,
    moe_layer_interval=1,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def save_tiny_ernie_moe(folder: Path, **overrides) -> list[list[int]]:
    """Save a random tiny Ernie-4.5-MoE checkpoint in ``folder``; return transformers' greedy tokens."""
    torch.manual_seed(0)
    reference = Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # large enough that greedy tokens and routing vary
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif "e_score_correction_bias" in name:
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.5 if ("embed" in name or "gate.weight" in name) else 0.2)
    reference.save_pretrained(folder)
    expected = transformers_greedy_tokens(reference, TOKEN_PROMPTS, MAX_TOKENS)
    assert len({tuple(t) for t in expected}) > 1  # the prompts' continuations differ
    return expected


def test_sparse_layers_follow_start_end_and_interval():
    cfg = {"architectures": ["Ernie4_5_MoeForCausalLM"], **TINY, "num_hidden_layers": 8}
    arch = ModelArchConfig.from_dict({**cfg, "moe_layer_start_index": 2, "moe_layer_end_index": 6,
                                      "moe_layer_interval": 2})  # fmt: skip
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_num_shared_experts) == (8, 2, 2)
    assert [i for i in range(8) if is_ernie_sparse_layer(arch, i)] == [3, 5]
    arch = ModelArchConfig.from_dict({**cfg, "moe_layer_end_index": -1})
    assert [i for i in range(8) if is_ernie_sparse_layer(arch, i)] == [1, 2, 3, 4, 5, 6, 7]


def test_correction_bias_picks_experts_but_not_weights():
    torch.manual_seed(2)
    logits = torch.randn(50, 8)
    bias = torch.randn(8) * 0.2
    weights, ids = select_experts(logits, 2, renormalize=True, correction_bias=bias)
    probs = torch.softmax(logits, dim=-1)
    expected_ids = torch.topk(probs + bias, 2, dim=-1).indices
    assert torch.equal(ids, expected_ids)
    assert not torch.equal(ids, torch.topk(probs, 2, dim=-1).indices)  # the bias changed some choices
    chosen = probs.gather(-1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_tiny_random_ernie_moe_equals_transformers(tmp_path: Path, tp: int):
    expected = save_tiny_ernie_moe(tmp_path)
    got = engine_greedy_tokens(
        str(tmp_path), TOKEN_PROMPTS, MAX_TOKENS, tp, passes=2, **CHUNKED_PREFIX_CACHED
    )
    assert got == expected


def test_tiny_random_ernie_moe_with_biases_equals_transformers(tmp_path: Path):
    """``use_bias``: every projection, the shared experts and the LM head carry biases (TP=2 with
    expert parallelism: the shared experts' bias is added once)."""
    expected = save_tiny_ernie_moe(tmp_path, use_bias=True, tie_word_embeddings=False)
    engine = dict(enable_expert_parallel=True)
    assert engine_greedy_tokens(str(tmp_path), TOKEN_PROMPTS, MAX_TOKENS, 2, **engine) == expected
