"""Sampling controls through the whole offline engine with the default model."""

from __future__ import annotations

import random

import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.sampling_params import SamplingParamsError
from fastdeploy.engine.input_processor import bad_words_token_ids

PROMPT = "The capital of France is"
OTHER_PROMPTS = ["Once upon a time, there", "def fibonacci(n):", "List three facts about Mars:"]


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    engine = LLM(dtype="float32", max_model_len=128, max_num_seqs=8, num_threads=1)
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


def test_seeded_request_same_alone_and_in_mixed_batches(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10, presence_penalty=0.3)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    mixes = [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=1.3, top_k=20, max_tokens=12),
        SamplingParams(temperature=0.8, min_p=0.1, seed=1, max_tokens=4, repetition_penalty=1.3),
    ]
    for size in (1, 3):
        outs = llm.generate([*OTHER_PROMPTS[:size], PROMPT], [*mixes[:size], seeded])
        assert outs[-1].outputs[0].token_ids == alone


def test_logprobs_returned_per_token(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, repetition_penalty=1.5)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        top = [lp for lp in entry.values() if lp.rank <= 3]
        assert sorted(lp.rank for lp in top) == [1, 2, 3]
        ordered = sorted(top, key=lambda lp: lp.rank)
        assert [lp.logprob for lp in ordered] == sorted((lp.logprob for lp in ordered), reverse=True)
        assert entry[token].logprob <= 0


def test_greedy_logprobs_match_reference_model(llm, hf_reference_model):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=2))[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_reference_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    n = len(out.prompt_token_ids)
    for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(ref[n - 1 + i, token].item(), abs=2e-3)


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert "Paris" in plain.text
    banned = ["Paris", " the"]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, bad_words=banned))[0].outputs[0]
    assert "Paris" not in out.text
    for seq in bad_words_token_ids(tok, banned):
        n = len(seq)
        assert all(out.token_ids[i : i + n] != seq for i in range(len(out.token_ids)))


def test_min_tokens_suppresses_eos_until_reached(llm):
    eos = llm.get_tokenizer().eos_token_id
    bias = {eos: 100.0}
    early = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, logit_bias=bias))[0].outputs[
        0
    ]
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias=bias))[
        0
    ]
    ids = out.outputs[0].token_ids
    assert eos not in ids[:4] and ids[4] == eos and len(ids) == 5
    assert out.outputs[0].finish_reason == "stop"


def test_out_of_vocab_logit_bias_is_rejected(llm):
    with pytest.raises(SamplingParamsError) as info:
        llm.generate([PROMPT], SamplingParams(logit_bias={10**7: 1.0}))
    assert info.value.param == "logit_bias" and "out of vocabulary" in str(info.value)


@pytest.mark.parametrize("field,value", [("top_k", 1 << 63), ("seed", 1 << 64), ("seed", -(1 << 63) - 1)])
def test_integers_past_64_bits_are_refused(field, value):
    """(They would fail inside the engine's step, for every request of that step.)"""
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def _matmul_rows_invariant(rows: int = 32) -> bool:
    """Whether this CPU's bf16 matmul gives a row the same bits in any call of 2 to ``rows`` rows
    (what FD_CPU_BATCH_INVARIANT relies on, a single row padded to two; oneDNN chooses its kernel by
    the row count)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    two = torch.nn.functional.linear(x[:2], w)[:1]
    return all(torch.equal(torch.nn.functional.linear(x[:m], w)[:1], two) for m in (3, 5, 16, rows))


@pytest.mark.skipif(
    not _matmul_rows_invariant(), reason="this CPU's matmul rounds a row by the call's row count"
)
def test_requests_same_alone_and_beside_chunked_prefills_in_bf16():
    """The default dtype (bf16): a seeded and a greedy request give the same tokens and the same
    logprobs, to the bit, alone and sharing their steps with other prompts' chunked prefills (a
    64-token budget, so the decodes run beside 40-60 prompt tokens: matmuls of more than 32 rows,
    which FD_CPU_BATCH_INVARIANT takes 32 rows a call)."""
    engine = LLM(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    try:
        seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=24, logprobs=0)
        greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
        longs = [
            ("Tell me about the history of Rome and its emperors. " * 12)[: 500 + 40 * i] for i in range(3)
        ]
        others = [SamplingParams(temperature=0.7, seed=i, max_tokens=6) for i in range(3)]
        for params in (seeded, greedy):
            alone = engine.generate([PROMPT], params)[0].outputs[0]
            mixed = engine.generate([PROMPT, *longs], [params, *others])[0].outputs[0]
            assert mixed.token_ids == alone.token_ids
            logprobs = [[e[t].logprob for e, t in zip(o.logprobs, o.token_ids)] for o in (alone, mixed)]
            assert logprobs[0] == logprobs[1]
    finally:
        engine.shutdown()


@pytest.mark.skipif(
    not _matmul_rows_invariant(), reason="this CPU's matmul rounds a row by the call's row count"
)
def test_greedy_request_same_alone_and_decoding_beside_another():
    """A greedy request alone and decoding beside one other request (one-row against two-row
    matmuls: oneDNN takes another kernel for a single row, which FD_CPU_BATCH_INVARIANT pads to two;
    before, this request's fifth logprob moved by 0.12)."""
    rng = random.Random(0)
    words = (
        "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches in paris"
    )
    prompts = [" ".join(rng.choice(words.split()) for _ in range(rng.randint(20, 300))) for _ in range(2)]
    engine = LLM(enable_prefix_caching=False)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
        alone = engine.generate(prompts[:1], greedy)[0].outputs[0]
        beside = engine.generate(prompts, greedy)[0].outputs[0]
        assert beside.token_ids == alone.token_ids
        logprobs = [[e[t].logprob for e, t in zip(o.logprobs, o.token_ids)] for o in (alone, beside)]
        assert logprobs[0] == logprobs[1]
    finally:
        engine.shutdown()


@pytest.mark.skipif(
    not _matmul_rows_invariant(), reason="this CPU's matmul rounds a row by the call's row count"
)
def test_greedy_request_same_after_a_prefix_cache_hit():
    """A prompt served again from the prefix cache computes only its last tokens: the same greedy
    tokens and logprobs to the bit, also when one token is left (it stays a prompt token for the
    attention kernels: the decode kernel rounds differently, and its first logprob moved by 0.012)."""
    engine = LLM()  # prefix caching on
    try:
        tokenizer = engine.get_tokenizer()
        greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
        texts = (  # (two whose last token alone rounded differently through the decode kernel)
            "Translate to French: 'The coffee is very hot and the café is closed.'",
            "List some math symbols: ∑ ∫ √ ∞ ≈ ≠ and explain each one of them in a short sentence please.",
        )
        for text in texts:
            ids = tokenizer.encode(text)
            for left in (1, 5):  # tokens past the cached full block of 16
                prompt = {"prompt_token_ids": ids[: 16 + left]}
                runs = [engine.generate([prompt], greedy)[0] for _ in range(2)]
                assert runs[1].num_cached_tokens == 16
                first, again = (r.outputs[0] for r in runs)
                assert again.token_ids == first.token_ids
                logprobs = [[e[t].logprob for e, t in zip(o.logprobs, o.token_ids)] for o in (first, again)]
                assert logprobs[0] == logprobs[1]
    finally:
        engine.shutdown()
