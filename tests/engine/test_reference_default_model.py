"""The default model through the whole engine must reproduce transformers token for token."""

from __future__ import annotations

import pytest
import torch

from fastdeploy import LLM, SamplingParams

MAX_TOKENS = 24

_PARAGRAPH = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels; later, stored programs let the same hardware run many tasks. Compilers turned symbolic "
    "instructions into machine code, operating systems shared one computer among many users, and "
    "networks joined computers into systems that span the planet. "
)


def _prompts(tokenizer) -> list[list[int]]:
    texts = [
        "Hello",
        "The capital of France is",
        "def fibonacci(n):",
        "Translate to French: I love reading books in the garden.",
        "List three facts about the moon:\n1.",
        _PARAGRAPH * 5 + "In summary,",  # ~300 tokens
        _PARAGRAPH * 5 + "The most important idea here is",  # shares a long prefix with the one above
        _PARAGRAPH * 16 + "To conclude,",  # ~1,000 tokens
    ]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about autumn."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompts = [tokenizer.encode(t) for t in texts]
    prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", max_num_seqs=16, kv_cache_memory=0.5)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(llm):
    prompts = _prompts(llm.get_tokenizer())
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] <= 5 and any(250 <= n <= 400 for n in lengths) and 900 <= lengths[-1] <= 1100, lengths
    return prompts


@pytest.fixture(scope="module")
def reference(hf_reference_model, prompts):
    """Greedy continuations from transformers, one prompt at a time (stops at EOS like the engine)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf_reference_model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_one_at_a_time_matches_reference(llm, prompts, reference):
    for prompt, ref in zip(prompts, reference):
        assert _tokens(llm.generate([prompt], GREEDY))[0] == ref


def test_one_batch_matches_reference_and_hits_prefix_cache(llm, prompts, reference):
    hits_before = llm.engine.stats.prefix_cache_hits
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    # the earlier test ran the same prompts: this batch must reuse their cached blocks
    assert llm.engine.stats.prefix_cache_hits - hits_before > 0.8 * sum(len(p) for p in prompts)
    assert llm.engine.core.scheduler.kv.pool.num_used_blocks == 0
    # LLM.reset_prefix_cache (vLLM's): the same prompt is computed in full once the cache is reset
    assert llm.reset_prefix_cache()
    hits_before = llm.engine.stats.prefix_cache_hits
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))
    assert llm.engine.stats.prefix_cache_hits == hits_before


def test_prefill_logits_match_reference(llm, prompts, hf_reference_model):
    model = llm.engine.core.executor.worker.runner.model
    captured = []
    original = model.compute_logits
    model.compute_logits = lambda hidden: captured.append(original(hidden)) or captured[-1]
    try:
        llm.generate([prompts[-2]], SamplingParams(temperature=0, max_tokens=1))
    finally:
        model.compute_logits = original
    with torch.no_grad():
        ref = hf_reference_model(torch.tensor([prompts[-2]])).logits[0, -1]
    ours = captured[0][0]
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 64},  # forces chunked prefill of every long prompt
    ],
    ids=["no-prefix-cache", "chunked-prefill"],
)
def test_batch_variants_match_reference(engine_kwargs, prompts, reference):
    engine = LLM(dtype="float32", max_num_seqs=16, kv_cache_memory=0.5, **engine_kwargs)
    try:
        assert _tokens(engine.generate(prompts, GREEDY)) == reference
        if engine_kwargs.get("max_num_batched_tokens"):
            # a second pass with the cache warm: prefix hits plus chunking
            assert _tokens(engine.generate(prompts, GREEDY)) == reference
        assert engine.engine.core.scheduler.kv.pool.num_used_blocks == 0
    finally:
        engine.shutdown()
