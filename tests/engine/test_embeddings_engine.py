"""The pooling runner through the offline engine: ``LLM.embed`` against ``transformers``.

Tiny random bare decoders (``Qwen3Model`` / ``LlamaModel``); prompts longer than the step's
token budget (chunked prefill), run twice in one engine (prefix-cache hits for last-token
pooling; mean pooling reads none), with and without async scheduling, and under KV-cache
pressure that preempts requests mid-prefill.
"""

from __future__ import annotations

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.transformers_utils.pooling import PoolerConfigError
from tests.embedding_models import cosine, reference_vectors, save_embedding_model

PROMPTS = [[5, 17, 42, 99, 3], list(range(100, 141)), [7] * 23, [300, 301]]
ENGINE = dict(dtype="float32", num_threads=1, max_model_len=256, block_size=4, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-embed")
    return folder, save_embedding_model(folder, "qwen3", with_tokenizer=False)


def check(outputs, expected, prompts) -> None:
    assert [o.prompt_token_ids for o in outputs] == prompts
    for out, ref in zip(outputs, expected):
        got = out.outputs.embedding
        assert len(got) == len(ref)
        assert cosine(got, ref) > 0.999999
        assert max(abs(a - b) for a, b in zip(got, ref.tolist())) < 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_embed_equals_transformers(qwen3, async_scheduling):
    folder, reference = qwen3
    llm = LLM(str(folder), kv_cache_memory=0.05, async_scheduling=async_scheduling, **ENGINE)
    try:
        assert llm.engine.source.pooler.pooling_type == "last"  # a bare Qwen3Model: pooling runner, defaults
        for pooling in ("last", "mean"):
            for normalize in (True, False):
                expected = reference_vectors(reference, PROMPTS, pooling, normalize)
                for _ in range(2):  # the second pass finds the prompts' blocks in the prefix cache
                    check(llm.embed(PROMPTS, PoolingParams(pooling, normalize)), expected, PROMPTS)
        default = llm.embed(PROMPTS[:1])[0].outputs.embedding  # the model's pooling: last, normalised
        assert cosine(default, reference_vectors(reference, PROMPTS[:1], "last", True)[0]) > 0.999999
        with pytest.raises(ValueError, match="LLM.embed"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


def test_embed_under_preemption_and_full_context(tmp_path):
    """Too few KV blocks for the requests in flight (async scheduling frees a finished request's
    blocks a step late): chunks of running requests preempt others, which are recomputed from
    their first token; a prompt of exactly max_model_len tokens fits (nothing is generated)."""
    reference = save_embedding_model(tmp_path, "llama", with_tokenizer=False, seed=1)
    prompts = [[(i * 37 + j) % 3000 + 1 for j in range(40)] for i in range(6)] + [list(range(1, 65))]
    engine = {**ENGINE, "max_model_len": 64, "max_num_batched_tokens": 32}
    llm = LLM(str(tmp_path), num_gpu_blocks_override=17, async_scheduling=True, **engine)
    try:
        for pooling in ("mean", "last"):
            outputs = llm.embed(prompts, PoolingParams(pooling, True))
            check(outputs, reference_vectors(reference, prompts, pooling, True), prompts)
        assert llm.engine.stats.num_preemptions > 0
    finally:
        llm.shutdown()


def test_generation_model_refuses_embed(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=128,
        )
    ).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_threads=1, kv_cache_memory=0.02)
    try:
        assert llm.engine.source.pooler is None
        with pytest.raises(ValueError, match="generation"):
            llm.embed([[1, 2, 3]])
    finally:
        llm.shutdown()
    with pytest.raises(PoolerConfigError, match="runner pooling"):
        LLM(str(tmp_path), dtype="float32", pooler_config={"pooling_type": "MEAN"})


@pytest.mark.slow
def test_embed_at_tensor_parallel_2(qwen3):
    """Two gloo workers: every rank pools its (all-reduced) hidden states, rank 0's vectors come back."""
    folder, reference = qwen3
    llm = LLM(str(folder), tensor_parallel_size=2, kv_cache_memory=0.05, **ENGINE)
    try:
        for pooling in ("last", "mean"):
            expected = reference_vectors(reference, PROMPTS, pooling, False)
            check(llm.embed(PROMPTS, PoolingParams(pooling, False)), expected, PROMPTS)
    finally:
        llm.shutdown()


def test_causal_lm_packaged_as_sentence_transformers(tmp_path):
    """Qwen3-Embedding's layout: a Qwen3ForCausalLM checkpoint (tied LM head) with modules.json,
    last-token pooling and a Normalize module: detected as an embedding model, pooled from the
    decoder's final hidden states."""
    import json

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.embedding_models import TINY

    torch.manual_seed(5)
    causal = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=3000, head_dim=16, tie_word_embeddings=True, **TINY)
    ).eval()
    causal.save_pretrained(tmp_path)
    modules = [
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    llm = LLM(str(tmp_path), kv_cache_memory=0.05, **ENGINE)
    try:
        check(llm.embed(PROMPTS), reference_vectors(causal.model, PROMPTS, "last", True), PROMPTS)
    finally:
        llm.shutdown()
