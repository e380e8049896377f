"""The Triton MoE routing kernels against their torch references on random inputs.

* :func:`topk_softmax` against ``select_experts_torch``: identical expert ids (same slot order;
  with bf16 logits, which tie often, the same scores slot by slot, as a tie may go either way),
  weights equal to 2e-6 relative (the exp and the sums are computed in another order, and on a
  GPU ``tl.exp`` is ``ex2.approx`` of a rounded ``x * log2(e)``: ~1e-6 for arguments near -10;
  a wrong expert or a missing renormalisation is O(1)); with and without renormalisation and
  with Ernie-4.5's correction bias.
* :func:`moe_align_block_size` against ``align_block_size_torch``: the same padded length and
  the same ``sorted_ids`` / ``expert_ids`` up to it, entry for entry (the atomic counters' sort up
  to the order inside each expert's run); batch 1 to prefill sizes, each sort forced at every
  size, experts receiving no pair, all pairs on two experts, another rank's pairs left out.
  The routing kernel's load statistic equals a bincount of the ids.
"""

from __future__ import annotations

import os

import pytest
import torch

routing = pytest.importorskip("fastdeploy.ops.triton_moe_routing")

from fastdeploy.model_executor.layers.fused_moe import select_experts_torch  # noqa: E402
from fastdeploy.ops.triton_fused_moe import align_block_size_torch  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)


def _logits(tokens, experts, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=g) * 2).to(dtype)


@pytest.mark.parametrize(
    "tokens,experts,top_k,renormalize,bias,dtype",
    [
        (1, 128, 8, True, False, torch.float32),
        (7, 60, 4, False, False, torch.float32),  # experts not a power of two
        (33, 64, 6, True, True, torch.float32),  # Ernie-4.5: bias-corrected choice
        (5, 8, 2, False, True, torch.bfloat16),
        (16, 128, 8, True, False, torch.bfloat16),
    ],
)
def test_topk_softmax_matches_torch(tokens, experts, top_k, renormalize, bias, dtype):
    logits = _logits(tokens, experts, seed=tokens + experts, dtype=dtype)
    correction = _logits(1, experts, seed=99)[0] * 0.05 if bias else None
    ref_w, ref_ids = select_experts_torch(logits, top_k, renormalize, correction)
    args = [t.to(DEVICE) if t is not None else None for t in (logits, correction)]
    counts = torch.arange(experts, dtype=torch.int64, device=DEVICE)  # the statistic adds to it
    w, ids = routing.topk_softmax(args[0], top_k, renormalize, args[1], counts)
    assert ids.dtype == torch.int64 and w.dtype == dtype and w.shape == (tokens, top_k)
    ids = ids.cpu()
    assert torch.equal(
        counts.cpu(), torch.arange(experts) + torch.bincount(ids.reshape(-1), minlength=experts)
    )
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    else:  # bf16 logits tie often (8-bit mantissa): the same scores chosen, slot by slot
        score = torch.softmax(logits.float(), -1) + (0 if correction is None else correction)
        assert torch.equal(score.gather(1, ids), score.gather(1, ref_ids))
        assert all(len(set(row)) == top_k for row in ids.tolist())
    if dtype == torch.float32:
        torch.testing.assert_close(w.cpu(), ref_w, rtol=2e-6, atol=1e-8)
    else:  # one bf16 ulp: the interpreter truncates float32 -> bf16 where torch (and the GPU) round
        torch.testing.assert_close(w.cpu(), ref_w, rtol=2**-7, atol=0)
    if renormalize:
        torch.testing.assert_close(w.float().sum(-1).cpu(), torch.ones(tokens), rtol=1e-2, atol=0)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_partials_then_topk_equal_the_router_then_topk(tokens, dtype):
    """Split-K partial logits (``router_partials``, H not a multiple of the split) summed by the
    top-k kernel: the float64 product's logits, and the routing of those logits rounded to the
    model's dtype (as the router's output is), against the torch path."""
    g = torch.Generator().manual_seed(tokens)
    hidden, experts = 200, 40
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(dtype)
    partials = routing.router_partials(x.to(DEVICE), weight.to(DEVICE))
    assert partials.dtype == torch.float32 and partials.shape == (2, tokens, experts)
    exact = x.double() @ weight.double().t()
    torch.testing.assert_close(partials.sum(0).cpu().double(), exact, rtol=1e-5, atol=1e-5)
    rounded = partials.sum(0).cpu().to(dtype)
    ref_w, ref_ids = select_experts_torch(rounded, 4, True)
    w, ids = routing.topk_softmax(partials, 4, True, dtype=dtype)
    assert w.dtype == dtype and torch.equal(ids.cpu(), ref_ids)
    # bf16: two ulps (the interpreter truncates where torch rounds, in the logits and the weights)
    tol = 2e-6 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(w.cpu(), ref_w, rtol=tol, atol=1e-8)
    with pytest.raises(ValueError, match="router_partials takes"):
        routing.router_partials(torch.zeros(5, hidden, dtype=dtype, device=DEVICE), weight.to(DEVICE))


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_router_partials_equal_the_norm_then_the_router(tokens, dtype):
    """The residual add + RMSNorm inside the split router (``norm_router_partials``): the new
    residual and the normalized rows bit for bit those of the norm kernel (``fused_add_rms_norm``,
    the same rounding points), the inputs untouched, and the partials those of ``router_partials``
    on the normalized rows (the same product, split by split)."""
    layer_ops = pytest.importorskip("fastdeploy.ops.triton_layer_ops")
    g = torch.Generator().manual_seed(10 + tokens)
    hidden, experts = 200, 40  # H not a multiple of the split: a partial last split
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    weight = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(dtype).to(DEVICE)
    x0, r0 = x.clone(), residual.clone()
    normed, new_residual, partials = routing.norm_router_partials(x, residual, norm_weight, 1e-6, weight)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    ref_normed, ref_residual = layer_ops.fused_add_rms_norm(x0.clone(), r0.clone(), norm_weight, 1e-6)
    assert torch.equal(new_residual, ref_residual) and torch.equal(normed, ref_normed)
    assert partials.shape == (2, tokens, experts)
    torch.testing.assert_close(partials, routing.router_partials(ref_normed, weight), rtol=1e-6, atol=1e-6)
    exact = (x0.double() + r0.double()) * torch.rsqrt(
        (x0.double() + r0.double()).pow(2).mean(-1, keepdim=True)
    )
    exact = (exact * norm_weight.double()) @ weight.double().t()
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # (bf16: the residual and the normalized rows rounded)
    torch.testing.assert_close(partials.sum(0).double(), exact, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="norm_weight"):
        routing.norm_router_partials(x, residual, norm_weight[:-1], 1e-6, weight)


def test_topk_softmax_rejects_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        routing.topk_softmax(_logits(2, 4, 0).to(DEVICE), 5, True)
    with pytest.raises(ValueError, match="correction_bias"):
        routing.topk_softmax(_logits(2, 4, 0).to(DEVICE), 2, True, torch.zeros(3, device=DEVICE))


def _check_layout(ids, block_m, experts, stable=True, ranked=None):
    """The Triton sort's layout equals the torch reference's; ``stable=False``: up to the order of
    the pairs inside each expert's run (each run holds the same pairs, padding in the same slots).
    ``ranked``: the pairs' ranks from the routing kernel, passed to the sort."""
    ref_sorted, ref_experts, ref_padded = align_block_size_torch(ids, block_m, experts)
    sorted_ids, expert_ids, num_padded = routing.moe_align_block_size(
        ids.to(DEVICE), block_m, experts, ranked
    )
    n = int(ref_padded)
    assert int(num_padded) == n and sorted_ids.numel() == ref_sorted.numel()
    assert torch.equal(expert_ids[: n // block_m].cpu(), ref_experts[: n // block_m])
    got = sorted_ids[:n].cpu()
    if stable:
        assert torch.equal(got, ref_sorted[:n])
        return
    for b in range(0, n, block_m):  # the runs are whole blocks: compare each run's blocks as a set
        same = ref_experts[b // block_m] == ref_experts[: n // block_m]
        first, last = int(same.nonzero().min()) * block_m, (int(same.nonzero().max()) + 1) * block_m
        if b == first:
            assert torch.equal(got[first:last].sort().values, ref_sorted[first:last].sort().values)
    assert torch.equal(got == ids.numel(), ref_sorted[:n] == ids.numel())  # the padding slots


SORTS = ("one-program", "atomics")
"""The two expert sorts, each forced for any pair count (by default one program sorts up to
``ALIGN_SINGLE_MAX`` pairs, the atomic counters more)."""


def _force_sort(sort, monkeypatch):
    """Make ``moe_align_block_size`` take ``sort`` whatever the pair count; True if that sort keeps
    the pairs' order inside each expert's run (the one program) and False if not (the atomics)."""
    monkeypatch.setattr(routing, "ALIGN_SINGLE_MAX", 1 << 30 if sort == "one-program" else 0)
    return sort == "one-program"


@pytest.mark.parametrize("sort", SORTS)
@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m",
    [
        (1, 8, 128, 16),  # batch-1 decode: 8 experts touched, 120 empty
        (3, 2, 8, 16),
        (13, 4, 60, 32),  # experts not a power of two
        (32, 8, 128, 16),  # the most pairs one program sorts by default
        (256, 8, 128, 64),  # a decode step of 256 tokens
        (300, 8, 128, 128),  # prefill tiles
        (700, 2, 16, 16),  # every expert busy
    ],
)
def test_align_matches_torch(sort, tokens, top_k, experts, block_m, monkeypatch):
    """Both sorts give the torch layout (the atomics up to the order inside each expert's run), also
    with another rank's pairs left out and with every pair on two experts."""
    stable = _force_sort(sort, monkeypatch)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    _check_layout(ids, block_m, experts, stable)
    ids[torch.rand(ids.shape, generator=g) < 0.5] = -1
    _check_layout(ids, block_m, experts, stable)
    _check_layout(torch.randint(0, 2, (tokens, 1), generator=g) * 3 + 1, block_m, experts, stable)


def test_align_default_sort_by_size():
    """By default a decode step's pairs (up to ``ALIGN_SINGLE_MAX``) keep their order inside each
    expert's run (one program) and larger steps get the layout in some order (the atomics)."""
    g = torch.Generator().manual_seed(8)
    _check_layout(torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(32)]), 16, 128)
    _check_layout(torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(33)]), 16, 128, False)


@pytest.mark.parametrize("sort", SORTS)
def test_align_skewed_and_empty_experts(sort, monkeypatch):
    """Every pair on two experts (the rest receive none), and one pair on the last expert."""
    stable = _force_sort(sort, monkeypatch)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 2, (600, 2), generator=g) * 7 + 3  # experts 3 and 10 of 16
    _check_layout(ids, 16, 16, stable)
    _check_layout(torch.full((1, 1), 15), 16, 16, stable)


@pytest.mark.parametrize("sort", SORTS)
def test_align_leaves_out_negative_ids(sort, monkeypatch):
    """Expert parallelism: ids of -1 (another rank's experts) are in no block, the rest as usual."""
    stable = _force_sort(sort, monkeypatch)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(300)])
    ids[torch.rand(ids.shape, generator=g) < 0.5] = -1
    ids[0] = -1  # a token with no pair here
    _check_layout(ids, 16, 16, stable)
    ref_sorted, _, ref_padded = align_block_size_torch(ids, 16, 16)
    used = ref_sorted[: int(ref_padded)]
    kept = used[used < ids.numel()].sort().values
    assert torch.equal(kept, torch.nonzero(ids.reshape(-1) >= 0).squeeze(1).to(kept.dtype))


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # numpy, under the interpreter
def test_topk_softmax_nan_logits_give_valid_experts():
    """A NaN logit makes every probability NaN: the ids stay valid expert indices (the expert GEMMs
    and the statistic index with them), never out of range."""
    logits = _logits(2, 16, seed=3)
    logits[1, 5] = float("nan")
    counts = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    _, ids = routing.topk_softmax(logits.to(DEVICE), 4, True, None, counts)
    assert ((ids >= 0) & (ids < 16)).all() and int(counts.sum()) == 8


@pytest.mark.parametrize("tokens,place_in_layout", [(40, True), (300, False)])
def test_ranks_taken_by_the_routing_kernel(tokens, place_in_layout, monkeypatch):
    """``topk_softmax(ranked=...)``: each expert's counter ends at its pair count and its pairs hold
    the ranks 0..count-1 once each; the atomic sort fed those ranks (its rank kernel skipped; the
    pairs placed by the layout kernel's program or by the place kernel) gives the torch layout up to
    the order inside each run. Buffers of the wrong size are refused."""
    from fastdeploy.ops import triton_moe_align_atomic as atomic

    monkeypatch.setattr(atomic, "PLACE_IN_LAYOUT_MAX", 1 << 30 if place_in_layout else 0)
    experts, top_k = 60, 8
    logits = _logits(tokens, experts, seed=tokens).to(DEVICE)
    ranked = atomic.new_pair_ranks(tokens * top_k, experts, torch.device(DEVICE))
    _, ids = routing.topk_softmax(logits, top_k, True, ranked=ranked)
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=64).to(torch.int32)
    assert torch.equal(ranked.counts.cpu(), counts)
    ranks = ranked.ranks.cpu()
    for e in flat.unique():
        assert torch.equal(ranks[flat == e].sort().values, torch.arange(int(counts[e]), dtype=torch.int32))
    _check_layout(ids.cpu(), 32, experts, stable=False, ranked=ranked)
    with pytest.raises(ValueError, match="ranked"):
        routing.topk_softmax(
            logits, top_k, True, ranked=atomic.new_pair_ranks(8, experts, torch.device(DEVICE))
        )
    with pytest.raises(ValueError, match="ranked"):
        routing.moe_align_block_size(
            ids, 32, experts, atomic.new_pair_ranks(8, experts, torch.device(DEVICE))
        )
