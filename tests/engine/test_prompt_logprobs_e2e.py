"""Prompt logprobs through the whole offline engine, against transformers' float32 reference.

The same prompt is scored by an engine that prefills it in one step, by one
that prefills it in 16-token chunks, and again with the prefix cache warm: every
run must give the reference's ``log_softmax`` at every prompt position.
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy import LLM, SamplingParams

PROMPT = (
    "The history of the city begins with a small fishing village on the river. Over the centuries "
    "merchants, monks and soldiers arrived, and the village grew into a busy market town."
)
TOP = 5


@pytest.fixture(scope="module")
def engines():
    threads = torch.get_num_threads()
    common = dict(dtype="float32", max_model_len=128, max_num_seqs=4, num_threads=1)
    whole = LLM(**common)
    chunked = LLM(**common, max_num_batched_tokens=16)
    yield whole, chunked
    whole.shutdown()
    chunked.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(engines, hf_reference_model):
    """Token ids of PROMPT and the reference log_softmax at every position ([tokens, vocab])."""
    ids = engines[0].get_tokenizer().encode(PROMPT)
    with torch.no_grad():
        logits = hf_reference_model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, -1)


def score(llm: LLM, prompt_logprobs: int | None = TOP, max_tokens: int = 1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return llm.generate([PROMPT], params)[0]


def check_against_reference(out, reference) -> None:
    ids, ref = reference
    assert out.prompt_token_ids == ids and len(ids) >= 30
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for pos in range(1, len(ids)):
        token, entry, row = ids[pos], lps[pos], ref[pos - 1]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-3), pos
        # the rank is the reference's, up to near-ties
        lo = int((row > row[token] + 1e-3).sum()) + 1
        hi = int((row > row[token] - 1e-3).sum()) + 1
        assert lo <= entry[token].rank <= hi, (pos, entry[token].rank, lo, hi)
        top = sorted((lp for lp in entry.values() if lp.rank <= TOP), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, TOP + 1))
        values = [lp.logprob for lp in top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(row.topk(TOP).values.tolist(), abs=1e-3)
        assert len(entry) == TOP + (entry[token].rank > TOP)  # the prompt token is always there


def test_prompt_logprobs_match_reference(engines, reference):
    out = score(engines[0])
    check_against_reference(out, reference)
    assert len(out.outputs[0].token_ids) == 1


def test_chunked_prefill_gives_the_same_prompt_logprobs(engines, reference):
    whole, chunked = score(engines[0]), score(engines[1])
    check_against_reference(chunked, reference)
    for pos, token in enumerate(whole.prompt_token_ids[1:], start=1):
        a, b = whole.prompt_logprobs[pos][token], chunked.prompt_logprobs[pos][token]
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4) and b.rank == a.rank


def test_warm_prefix_cache_is_not_used_for_prompt_logprobs(engines, reference):
    llm = engines[1]
    score(llm, prompt_logprobs=None)  # fills the prefix cache with the prompt's blocks
    assert score(llm, prompt_logprobs=None).num_cached_tokens > 0
    first, second = score(llm), score(llm)
    for out in (first, second):
        assert out.num_cached_tokens == 0
        check_against_reference(out, reference)
    assert [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in first.prompt_logprobs] == [
        None if e is None else {t: lp.logprob for t, lp in e.items()} for e in second.prompt_logprobs
    ]


def test_max_tokens_zero_scores_the_prompt_only(engines, reference):
    out = score(engines[1], max_tokens=0)
    choice = out.outputs[0]
    assert choice.token_ids == [] and choice.text == "" and choice.finish_reason == "length"
    check_against_reference(out, reference)


def test_no_prompt_logprobs_unless_asked(engines):
    assert score(engines[0], prompt_logprobs=None).prompt_logprobs is None
