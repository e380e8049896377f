"""The whole engine at tensor-parallel size 2 on CPU (two worker processes joined by gloo).

Greedy tokens in float32 must equal TP=1's on the default model, and equal
``transformers``' on tiny random Llama and Qwen3 checkpoints; layouts that
cannot run are refused up front with one clear error.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fastdeploy import LLM
from fastdeploy.engine.parallel_layout import ParallelLayoutError
from tests.greedy_tokens import (
    TINY_ENGINE,
    TOKEN_PROMPTS,
    engine_greedy_tokens,
    transformers_greedy_tokens,
)

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12
TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def test_default_model_tp2_equals_tp1():
    tp2 = engine_greedy_tokens(None, PROMPTS, MAX_TOKENS, tp=2)
    assert tp2 == engine_greedy_tokens(None, PROMPTS, MAX_TOKENS, tp=1)


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "extra"),
    [
        (LlamaConfig, LlamaForCausalLM, {}),
        (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
        (LlamaConfig, LlamaForCausalLM, {"num_key_value_heads": 1}),  # one KV head, replicated
    ],
    ids=["llama", "qwen3", "llama-one-kv-head"],
)
def test_tiny_random_models_at_tp2_equal_transformers(tmp_path, config_cls, model_cls, extra):
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra})
    reference = model_cls(config).eval()
    reference.save_pretrained(tmp_path)
    expected = transformers_greedy_tokens(reference, TOKEN_PROMPTS, MAX_TOKENS)
    assert engine_greedy_tokens(str(tmp_path), TOKEN_PROMPTS, MAX_TOKENS, tp=2) == expected


def test_layouts_that_cannot_run_are_refused():
    with pytest.raises(ParallelLayoutError, match="cannot split 9 attention heads"):
        LLM(tensor_parallel_size=4, **TINY_ENGINE)
    with pytest.raises(ParallelLayoutError, match="fastdeploy serve"):
        LLM(data_parallel_size=2, **TINY_ENGINE)
    with pytest.raises(ParallelLayoutError, match="must be >= 1"):
        LLM(tensor_parallel_size=0, **TINY_ENGINE)
