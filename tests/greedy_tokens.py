"""Greedy tokens of our engine and of ``transformers`` on the same checkpoint, for model tests.

Tests of a new architecture save a tiny random model with ``transformers``, then
compare :func:`engine_greedy_tokens` (the whole offline engine, at any tensor-parallel
size) with :func:`transformers_greedy_tokens` (``generate`` without sampling).
"""

from __future__ import annotations

from typing import Any

import torch

from fastdeploy import LLM, SamplingParams

TINY_ENGINE = dict(dtype="float32", num_threads=1, kv_cache_memory=0.1, max_model_len=256)
"""Engine settings for tiny float32 models on the CI CPU."""
TOKEN_PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 7], [11] * 9]
"""Token-id prompts for tiny models without a tokenizer (vocabularies of 300 ids or more)."""


CHUNKED_PREFIX_CACHED = dict(block_size=4, max_num_batched_tokens=6, enable_prefix_caching=True)
"""Engine settings under which the token-id prompts' prefills are split into chunks of the step's
6-token budget and (run twice, ``passes=2``) the second pass reads their whole 4-token blocks
from the prefix cache."""


def engine_greedy_tokens(
    model: str | None, prompts: list, max_tokens: int, tp: int = 1, passes: int = 1, **engine: Any
) -> list[list[int]]:
    """The offline engine's greedy continuation of each prompt (``model`` None: the default model).

    ``engine``: more ``LLM`` settings (over :data:`TINY_ENGINE`); ``passes`` > 1 generates the
    same prompts again in the same engine (prefix-cache hits) and asserts every pass agrees.
    """
    llm = LLM(model=model, tensor_parallel_size=tp, **{**TINY_ENGINE, **engine})
    try:
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
        runs = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] for _ in range(passes)]
    finally:
        llm.shutdown()
    assert all(run == runs[0] for run in runs), f"passes differ: {runs}"
    return runs[0]


def transformers_greedy_tokens(reference: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """``reference.generate`` without sampling (and without stopping at EOS) for each token-id prompt."""
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
            )
            expected.append(out[0, len(prompt) :].tolist())
    return expected
