"""The batched sampler against straightforward per-row reference implementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy.core.step_io import NewRequestData, WorkerSamplingParams
from fastdeploy.model_executor.sampler import (
    PenaltyTensors,
    Sampler,
    SamplingTensors,
    apply_penalties,
    apply_top_k_top_p_min_p,
    compute_logprobs,
)
from fastdeploy.worker.input_batch import InputBatch
from fastdeploy.worker.sampling_metadata import build_sampling_tensors

VOCAB = 64
NEG_INF = float("-inf")


def random_logits(seed: int, rows: int, vocab: int = VOCAB) -> torch.Tensor:
    """Random logits with ties (values on a coarse grid), extreme values and -inf entries."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-8, 8, (rows, vocab), generator=g).float() / 2
    logits[0, :5] = 1e4  # a block of tied huge values
    if rows > 1:
        logits[1, 3] = -1e4
        logits[1, 7] = NEG_INF
    if rows > 2:
        logits[2] = 0.0  # all tied
    return logits


def reference_mask(row: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """Tokens kept by top-k, then top-p over the top-k renormalised set, and min-p; ties at an edge kept."""
    keep = torch.ones_like(row, dtype=torch.bool)
    values = sorted(row.tolist(), reverse=True)
    if k > 0:
        keep &= row >= values[min(k, len(values)) - 1]
    if p < 1.0:
        kept = torch.tensor(sorted(row[keep].tolist(), reverse=True))
        probs = kept.softmax(-1)
        mass, threshold = 0.0, kept[0]
        for logit, prob in zip(kept.tolist(), probs.tolist()):
            if mass >= p:
                break
            threshold = logit
            mass += prob
        keep &= row >= threshold
    if min_p > 0:
        keep &= row >= values[0] + np.log(min_p)
    return keep


@pytest.mark.parametrize("seed", range(6))
def test_top_k_top_p_min_p_match_reference(seed):
    rows = 12
    logits = random_logits(seed, rows)
    rng = np.random.default_rng(seed)
    top_k = torch.tensor(rng.choice([0, 1, 2, 5, 17, VOCAB, VOCAB + 3], rows))
    top_p = torch.tensor(rng.choice([1.0, 0.9, 0.5, 0.1, 1e-6], rows), dtype=torch.float32)
    min_p = torch.tensor(rng.choice([0.0, 0.0, 0.05, 0.5, 1.0], rows), dtype=torch.float32)
    masked = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    for r in range(rows):
        expected = reference_mask(logits[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
        got = masked[r] > NEG_INF
        assert torch.equal(got, expected & (logits[r] > NEG_INF)), f"row {r}"
        assert torch.equal(masked[r][got], logits[r][got])


def reference_penalties(logits, prompts, outputs, rep, pres, freq):
    out = logits.clone()
    for r in range(logits.shape[0]):
        seen = set(prompts[r]) | set(outputs[r])
        for t in range(logits.shape[1]):
            v = out[r, t].item()
            if t in seen:
                v = v / rep[r] if v > 0 else v * rep[r]
            count = outputs[r].count(t)
            v -= freq[r] * count + pres[r] * (count > 0)
            out[r, t] = v
    return out


def make_batch(requests: list[tuple[list[int], list[int], dict]], vocab: int = VOCAB) -> InputBatch:
    """A persistent batch holding ``(prompt, output so far, sampling fields)`` per request."""
    batch = InputBatch(8, 64, 4, torch.device("cpu"))
    for i, (prompt, output, fields) in enumerate(requests):
        sampling = WorkerSamplingParams(**fields)
        batch.add_request(NewRequestData(f"r{i}", prompt + output, len(prompt), sampling, [0], 0))
    return batch


@pytest.mark.parametrize("seed", range(3))
def test_penalties_match_reference_formulas(seed):
    rng = np.random.default_rng(seed)
    rows = 5
    prompts = [rng.integers(0, VOCAB, rng.integers(1, 10)).tolist() for _ in range(rows)]
    outputs = [rng.integers(0, VOCAB, rng.integers(0, 12)).tolist() for _ in range(rows)]
    rep = rng.choice([1.0, 0.5, 1.3, 2.0], rows).tolist()
    pres = rng.uniform(-2, 2, rows).round(2).tolist()
    freq = rng.uniform(-2, 2, rows).round(2).tolist()
    fields = [
        {"repetition_penalty": rep[r], "presence_penalty": pres[r], "frequency_penalty": freq[r]}
        for r in range(rows)
    ]
    batch = make_batch([(prompts[r], outputs[r], fields[r]) for r in range(rows)])
    slots = np.array([batch.req_id_to_index[f"r{r}"] for r in range(rows)])
    params = build_sampling_tensors(batch, slots, VOCAB, torch.from_numpy)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))
    got = apply_penalties(logits.clone(), params.penalties)
    expected = reference_penalties(logits, prompts, outputs, rep, pres, freq)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_no_penalty_tensors_without_penalties():
    batch = make_batch([([1, 2], [3], {}), ([4], [], {"temperature": 0.0})])
    params = build_sampling_tensors(batch, np.array([0, 1]), VOCAB, torch.from_numpy)
    assert params.penalties is None and params.logit_bias is None and params.banned is None
    assert params.max_num_logprobs is None


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_are_log_softmax_of_raw_logits(k):
    logits = random_logits(3, 6) * 3
    logits[1, 7] = -1e4  # finite: log_softmax of -inf is -inf on both sides anyway
    sampled = torch.tensor([0, 7, 5, 63, 2, 11])
    lp = compute_logprobs(logits, sampled, k)
    ref = torch.log_softmax(logits.double(), -1).float()
    torch.testing.assert_close(
        lp.sampled_logprobs, ref.gather(1, sampled[:, None]).squeeze(1), atol=1e-4, rtol=0
    )
    assert lp.top_logprobs.shape == (6, k)
    for r in range(6):
        top = lp.top_logprobs[r].tolist()
        assert top == sorted(top, reverse=True)
        torch.testing.assert_close(lp.top_logprobs[r], ref[r, lp.top_ids[r]], atol=1e-4, rtol=0)
        if k:
            assert top[0] == pytest.approx(ref[r].max().item(), abs=1e-4)
        rank = int((ref[r] > ref[r, sampled[r]]).sum()) + 1
        assert int(lp.sampled_ranks[r]) == rank
        if rank <= k and len(set(ref[r].tolist())) == VOCAB:
            assert int(lp.top_ids[r, rank - 1]) == int(sampled[r])


def test_logprobs_ignore_penalties_and_temperature():
    """vLLM's default: logprobs describe the raw model distribution."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    batch = make_batch(
        [
            ([1, 2], [3, 3], {"logprobs": 2, "repetition_penalty": 2.0, "temperature": 0.3}),
            ([5], [], {"logprobs": 0}),
        ]
    )
    params = build_sampling_tensors(batch, np.array([0, 1]), VOCAB, torch.from_numpy)
    assert params.max_num_logprobs == 2
    out = Sampler()(logits, params)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(
        out.logprobs.sampled_logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1)
    )


def test_logit_bias_and_bans_applied_before_sampling():
    logits = torch.zeros(3, VOCAB)
    batch = make_batch(
        [
            ([1], [], {"temperature": 0.0, "logit_bias": {9: 50.0, 4: -100.0}}),
            ([1], [], {"temperature": 0.0, "logit_bias": {9: 50.0}, "bad_words_token_ids": [[9]]}),
            (
                [1],
                [2],
                {"temperature": 0.0, "logit_bias": {9: 50.0, 12: 20.0}, "bad_words_token_ids": [[2, 9]]},
            ),
        ]
    )
    params = build_sampling_tensors(batch, np.array([0, 1, 2]), VOCAB, torch.from_numpy)
    tokens = Sampler()(logits, params).token_ids.tolist()
    assert tokens[0] == 9  # biased up
    assert tokens[1] != 9  # single-token bad word
    assert tokens[2] == 12  # 9 would complete the bad word "2 9"


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 100.0  # EOS
    logits[:, 1] = 90.0  # a stop token id
    fields = {"temperature": 0.0, "min_tokens": 3, "eos_token_ids": [0], "stop_token_ids": [1]}
    batch = make_batch([([5, 6], [7, 8], fields), ([5, 6], [7, 8, 9], fields)])
    params = build_sampling_tensors(batch, np.array([0, 1]), VOCAB, torch.from_numpy)
    tokens = Sampler()(logits, params).token_ids.tolist()
    assert tokens[0] not in (0, 1)  # 2 outputs so far < 3
    assert tokens[1] == 0  # min_tokens reached


def seeded_tokens(batch_fields: list[dict], seeded_row: int, steps: int = 5) -> list[int]:
    """Tokens of ``seeded_row`` over a few steps of a batch built from ``batch_fields``."""
    batch = make_batch([([1, 2, 3], [], f) for f in batch_fields])
    slots = np.arange(len(batch_fields))
    out = []
    for step in range(steps):
        logits = torch.randn(len(batch_fields), VOCAB, generator=torch.Generator().manual_seed(100 + step))
        # the seeded row always sees the same logits, whatever the batch
        logits[seeded_row] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(step))
        tokens = Sampler()(logits, build_sampling_tensors(batch, slots, VOCAB, torch.from_numpy)).token_ids
        for slot, token in zip(slots.tolist(), tokens.tolist()):
            batch.append_token(slot, token)
        out.append(int(tokens[seeded_row]))
    return out


def test_seeded_row_is_independent_of_the_batch():
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "presence_penalty": 0.5}
    alone = seeded_tokens([seeded], 0)
    others = [
        {"temperature": 0.0},
        {"temperature": 1.2, "top_k": 5},
        {"temperature": 0.7, "min_p": 0.1, "seed": 7},
        {"temperature": 1.0, "repetition_penalty": 1.5, "logit_bias": {3: 5.0}},
    ]
    assert seeded_tokens([*others[:1], seeded], 1) == alone
    assert seeded_tokens([*others, seeded], 4) == alone
    assert seeded_tokens([seeded, *others[1:3]], 0) == alone


def test_all_greedy_fast_path_is_argmax():
    logits = random_logits(1, 4)
    params = SamplingTensors(
        torch.zeros(4), torch.ones(4), torch.zeros(4, dtype=torch.long), torch.zeros(4), {}, all_greedy=True
    )
    out = Sampler()(logits, params)
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.logprobs is None


def test_precomputed_greedy_tokens_are_used_only_without_logit_processing():
    """The decode graphs hand the sampler their argmax; bias / bans / penalties must override it."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    given = torch.tensor([5, 5])
    plain = build_sampling_tensors(
        make_batch([([1], [], {"temperature": 0.0})] * 2), np.array([0, 1]), VOCAB, torch.from_numpy
    )
    assert Sampler()(logits, plain, given).token_ids.tolist() == [5, 5]
    biased = build_sampling_tensors(
        make_batch([([1], [], {"temperature": 0.0, "logit_bias": {9: 50.0}})] * 2),
        np.array([0, 1]),
        VOCAB,
        torch.from_numpy,
    )
    assert Sampler()(logits, biased, given).token_ids.tolist() == [9, 9]


def test_penalty_tensors_shape():
    p = PenaltyTensors(
        torch.ones(1), torch.zeros(1), torch.zeros(1), torch.zeros(1, 4, dtype=torch.bool), torch.zeros(1, 4)
    )
    logits = torch.tensor([[1.0, -1.0, 0.0, 2.0]])
    assert torch.equal(apply_penalties(logits.clone(), p), logits)
