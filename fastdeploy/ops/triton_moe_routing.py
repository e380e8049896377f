"""MoE routing on a GPU in Triton: the router's split-K logits at a few tokens, top-k softmax in one
kernel, the expert sort/pad in one kernel or three.

A decode step of a 48-layer MoE model routes 48 times; the torch versions of these steps
(softmax, topk, the renormalising sum and divide, the casts; then a bincount, cumsums, a
stable argsort, gathers, scatters and a searchsorted for the sort) are about twenty small
kernels per layer, each costing a launch even inside a CUDA graph. Here:

* :func:`topk_softmax` — one program per token: the float32 softmax of its ``E`` logits, the
  ``k`` largest (by ``probs + correction_bias`` when a bias is given, weighted by the plain
  probabilities), optionally renormalised to sum to 1. It computes what
  :func:`fastdeploy.model_executor.layers.fused_moe.select_experts_torch` computes (same
  order of slots: descending score, the lower expert first on a tie).
* :func:`router_partials` — at decode steps of at most :data:`ROUTER_SPLIT_MAX_TOKENS` tokens, the
  router's ``[T, H] @ [E, H]^T`` as split-K partial sums ``[S, T, E]`` (float32): ``E / 16 x H /
  128`` programs each read one small tile of the router weight, where a GEMV's few programs each
  walk all of ``H`` (latency-bound for a router of a few hundred KB). :func:`topk_softmax` adds
  the partials up as it loads its row, rounded to the model's dtype as the router's output would
  be, so no reduction kernel runs between them.
* :func:`moe_align_block_size` — the layout :func:`fastdeploy.ops.triton_fused_moe.align_block_size_torch`
  builds (the (token, slot) pairs sorted stably by expert, each expert's run padded to a
  multiple of ``block_m``, the expert of every block, the padded length). Up to
  :data:`ALIGN_SINGLE_MAX` pairs (a decode step) it is one program of one kernel, the order within
  an expert the pairs' order; beyond that the atomic counters of
  :mod:`fastdeploy.ops.triton_moe_align_atomic` (three short kernels; the order within an expert
  is the atomics', which changes no output: the grouped GEMM computes each pair's row on its own).
  Every size comes from shapes, so nothing waits for the device (CUDA-graph safe).

The routing kernel also adds the step's per-expert pair counts into the load statistic
(``expert_counts``, atomically), which the torch path does with one more ``index_add_``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.ops.triton_layer_ops import inverse_rms, scaled_by_rms
from fastdeploy.ops.triton_moe_align_atomic import PairRanks, align_by_atomics, write_layout
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue

ROUTER_SPLIT_MAX_TOKENS = 4
"""Most tokens :func:`router_partials` takes (decode steps of a few requests)."""
ROUTER_BLOCK_E = 16
"""Experts (logits) per program of :func:`router_partials`."""
ROUTER_BLOCK_K = 128
"""Hidden columns per split of :func:`router_partials`."""
ALIGN_SINGLE_MAX = 256
"""Up to this many pairs (32 tokens x top-8) one program of one kernel sorts them; beyond, the
atomic counters of :mod:`fastdeploy.ops.triton_moe_align_atomic`."""
_SUB = 32
"""Pairs per step of the one-program sort (a ``[_SUB, experts]`` one-hot tile in registers)."""


@triton.jit
def _router_tile(w_ptr, offs_e, offs_k, e_mask, k_mask, stride_we):
    """The router weight's ``[BLOCK_E, BLOCK_K]`` tile of these experts and columns, in float32."""
    return tl.load(
        w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_k[None, :],
        mask=e_mask[:, None] & k_mask[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _router_partials_kernel(
    x_ptr, w_ptr, out_ptr, T, E, H, stride_xm, stride_we, stride_os, stride_ot,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``out[s, t, e] = sum over split s's columns of x[t, :] * w[e, :]`` (float32) for this program's
    ``BLOCK_E`` experts and split ``s``, every token."""
    pdl_prologue(USE_PDL)
    pid_e = tl.program_id(0)
    split = tl.program_id(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    e_mask = offs_e < E
    k_mask = offs_k < H
    w = _router_tile(w_ptr, offs_e, offs_k, e_mask, k_mask, stride_we)
    for t in tl.static_range(BLOCK_T):
        x_mask = k_mask & (tl.zeros([BLOCK_K], dtype=tl.int32) + t < T)
        x = tl.load(x_ptr + t * stride_xm + offs_k, mask=x_mask, other=0.0).to(tl.float32)
        part = tl.sum(w * x[None, :], axis=1)
        out_mask = e_mask & (tl.zeros([BLOCK_E], dtype=tl.int32) + t < T)
        tl.store(out_ptr + split * stride_os + t * stride_ot + offs_e, part, mask=out_mask)


def _check_router_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    tokens, hidden = x.shape
    if not 0 < tokens <= ROUTER_SPLIT_MAX_TOKENS or weight.shape[1] != hidden:
        raise ValueError(
            f"router_partials takes 1..{ROUTER_SPLIT_MAX_TOKENS} tokens of x [T, H] and weight [E, H], "
            f"got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need unit column strides")


def router_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Split-K partial router logits ``[S, T, E]`` float32 of ``x [T, H]`` (``T <=``
    :data:`ROUTER_SPLIT_MAX_TOKENS`) and the router ``weight [E, H]`` (unit column strides):
    ``partials.sum(0)`` is ``x @ weight.T`` in float32. Hand them to :func:`topk_softmax`."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    _check_router_operands(x, weight)
    splits = triton.cdiv(hidden, ROUTER_BLOCK_K)
    out = torch.empty((splits, tokens, experts), dtype=torch.float32, device=x.device)
    _router_partials_kernel[(triton.cdiv(experts, ROUTER_BLOCK_E), splits)](
        x, weight, out, tokens, experts, hidden, x.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        BLOCK_T=triton.next_power_of_2(tokens), BLOCK_E=ROUTER_BLOCK_E, BLOCK_K=ROUTER_BLOCK_K, num_warps=4,
        **pdl_kwargs(out),
    )  # fmt: skip
    return out


@triton.jit
def _norm_router_partials_kernel(
    x_ptr, r_ptr, g_ptr, w_ptr, normed_ptr, res_out_ptr, out_ptr, T, E, H, eps,
    stride_xm, stride_rm, stride_we, stride_os, stride_ot,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """:func:`_router_partials_kernel` of ``rms_norm(x + r) * g``, which each program forms itself:
    the whole row's sum of squares (``H`` columns from L2, a few KB), then its split's columns,
    rounded as :func:`~fastdeploy.ops.triton_layer_ops.fused_add_rms_norm` rounds them. The
    programs of the first expert block also store their split's ``x + r`` and normalized columns."""
    pdl_prologue(USE_PDL)
    pid_e = tl.program_id(0)
    split = tl.program_id(1)
    dtype = r_ptr.dtype.element_ty
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_H)
    e_mask = offs_e < E
    k_mask = offs_k < H
    w = _router_tile(w_ptr, offs_e, offs_k, e_mask, k_mask, stride_we)
    for t in tl.static_range(BLOCK_T):
        valid = tl.zeros([BLOCK_H], dtype=tl.int32) + t < T
        row_mask = (cols < H) & valid
        x = tl.load(x_ptr + t * stride_xm + cols, mask=row_mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + t * stride_rm + cols, mask=row_mask, other=0.0).to(tl.float32)
        inv = inverse_rms((x + r).to(dtype).to(tl.float32), H, eps)
        x_mask = k_mask & (tl.zeros([BLOCK_K], dtype=tl.int32) + t < T)
        xk = tl.load(x_ptr + t * stride_xm + offs_k, mask=x_mask, other=0.0).to(tl.float32)
        rk = tl.load(r_ptr + t * stride_rm + offs_k, mask=x_mask, other=0.0).to(tl.float32)
        summed_k = (xk + rk).to(dtype)
        normed = scaled_by_rms(summed_k.to(tl.float32), inv, g_ptr, offs_k, k_mask, dtype)
        if pid_e == 0:
            tl.store(res_out_ptr + t * H + offs_k, summed_k, mask=x_mask)
            tl.store(normed_ptr + t * H + offs_k, normed, mask=x_mask)
        part = tl.sum(w * normed.to(tl.float32)[None, :], axis=1)
        out_mask = e_mask & (tl.zeros([BLOCK_E], dtype=tl.int32) + t < T)
        tl.store(out_ptr + split * stride_os + t * stride_ot + offs_e, part, mask=out_mask)


def norm_router_partials(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden, new residual, partials)``: ``hidden = rms_norm(x + residual) * norm_weight`` (new
    tensors, the inputs untouched) and :func:`router_partials` of it, in one kernel (the residual
    add and the norm before a MoE block's router at a decode step of at most
    :data:`ROUTER_SPLIT_MAX_TOKENS` tokens: one launch fewer a layer). ``x``, ``residual`` ``[T, H]``
    of one dtype with unit column strides, ``norm_weight [H]``, ``weight [E, H]`` as
    :func:`router_partials` takes it."""
    tokens, hidden = x.shape
    if residual.shape != x.shape or residual.dtype != x.dtype or norm_weight.shape != (hidden,):
        raise ValueError(
            f"norm_router_partials needs x and residual of one shape and dtype and norm_weight [H]; got "
            f"{tuple(x.shape)} {x.dtype}, {tuple(residual.shape)} {residual.dtype}, {tuple(norm_weight.shape)}"
        )
    if residual.stride(1) != 1 or not norm_weight.is_contiguous():
        raise ValueError("residual needs a unit column stride and norm_weight to be contiguous")
    _check_router_operands(x, weight)
    experts = weight.shape[0]
    splits = triton.cdiv(hidden, ROUTER_BLOCK_K)
    out = torch.empty((splits, tokens, experts), dtype=torch.float32, device=x.device)
    normed = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    new_residual = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    _norm_router_partials_kernel[(triton.cdiv(experts, ROUTER_BLOCK_E), splits)](
        x, residual, norm_weight, weight, normed, new_residual, out, tokens, experts, hidden, eps,
        x.stride(0), residual.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        BLOCK_T=triton.next_power_of_2(tokens), BLOCK_E=ROUTER_BLOCK_E, BLOCK_K=ROUTER_BLOCK_K,
        BLOCK_H=triton.next_power_of_2(hidden), num_warps=4, **pdl_kwargs(out),
    )  # fmt: skip
    return normed, new_residual, out


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    counts_ptr,
    pair_counts_ptr,
    ranks_ptr,
    E,
    stride_lm,
    stride_ls,
    SPLITS: tl.constexpr,
    ROUND_TO: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token: ``probs = softmax(logits)``; the ``TOP_K`` best by ``probs (+ bias)``; their probs.
    ``SPLITS > 1``: the logits are the sum of that many float32 partials (``stride_ls`` apart),
    rounded to ``ROUND_TO`` as the router's output in the model's dtype would be. ``HAS_RANKS``:
    each chosen pair's rank among its expert's pairs of the step, by an atomic add on its counter."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    if SPLITS == 1:
        x = tl.load(logits_ptr + row * stride_lm + offs, mask=mask, other=-float("inf")).to(tl.float32)
    else:
        x = tl.zeros([BLOCK_E], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            x += tl.load(logits_ptr + s * stride_ls + row * stride_lm + offs, mask=mask, other=0.0)
        x = tl.where(mask, x.to(ROUND_TO).to(tl.float32), -float("inf"))
    ex = tl.exp(x - tl.max(x, axis=0))
    probs = ex / tl.sum(ex, axis=0)
    score = probs
    if HAS_BIAS:
        score = probs + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    score = tl.where(mask, score, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(score, axis=0)
        idx = tl.min(tl.where(score == best, offs, BLOCK_E), axis=0)  # the lowest expert on a tie
        idx = tl.minimum(idx, E - 1)  # NaN logits match nothing: still a valid expert, no stray reads
        w = tl.sum(tl.where(offs == idx, probs, 0.0), axis=0)
        chosen_w = tl.where(slots == j, w, chosen_w)
        chosen_id = tl.where(slots == j, idx.to(tl.int64), chosen_id)
        score = tl.where(offs == idx, -float("inf"), score)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.maximum(tl.sum(chosen_w, axis=0), 1e-12)
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, chosen_w.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + out, chosen_id, mask=slots < TOP_K)
    if HAS_COUNTS:  # integer adds: the same totals in any order
        tl.atomic_add(
            counts_ptr + chosen_id, tl.full([BLOCK_K], 1, tl.int64), mask=slots < TOP_K, sem="relaxed"
        )
    if HAS_RANKS:  # (relaxed: the ranks and counts are read by the next kernel)
        rank = tl.atomic_add(
            pair_counts_ptr + chosen_id, tl.full([BLOCK_K], 1, tl.int32), mask=slots < TOP_K, sem="relaxed"
        )
        tl.store(ranks_ptr + out, rank, mask=slots < TOP_K)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def topk_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    ranked: PairRanks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits → (weights ``[T, k]`` in the logits' dtype, expert ids ``[T, k]`` int64),
    as ``select_experts_torch`` (softmax in float32; ``correction_bias [E]`` chooses by
    ``probs + bias`` and weights by ``probs``; ``renormalize`` rescales the k weights to sum to 1).
    ``expert_counts [E]`` (int64), when given, gets each expert's chosen (token, slot) pairs added
    (the load statistic). ``[S, T, E]`` float32 logits are :func:`router_partials`' split-K sums:
    added up, rounded to ``dtype`` (the model's; the weights come back in it) and routed so.
    ``ranked`` (:func:`~fastdeploy.ops.triton_moe_align_atomic.new_pair_ranks` of ``T * k`` pairs):
    filled with the pairs' ranks within their experts for :func:`moe_align_block_size`."""
    partials = router_logits.dim() == 3
    if (
        router_logits.dim() not in (2, 3)
        or router_logits.stride(-1) != 1
        or (partials and router_logits.dtype != torch.float32)
    ):
        raise ValueError(
            "router_logits must be [T, E] with unit column stride, or float32 [S, T, E] partials, "
            f"got {router_logits.dtype} {tuple(router_logits.shape)}"
        )
    tokens, experts = router_logits.shape[-2:]
    splits = router_logits.shape[0] if partials else 1
    dtype = dtype or router_logits.dtype
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    bias = None if correction_bias is None else correction_bias.reshape(-1)
    if bias is not None and bias.numel() != experts:
        raise ValueError(f"correction_bias must have {experts} entries, got {bias.numel()}")
    weights = torch.empty((tokens, top_k), dtype=dtype, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    if ranked is not None and (ranked.ranks.numel() != tokens * top_k or ranked.counts.numel() < experts):
        raise ValueError(f"ranked must hold {tokens * top_k} ranks and {experts} counters")
    _topk_softmax_kernel[(tokens,)](
        router_logits, bias if bias is not None else router_logits, weights, ids,
        expert_counts if expert_counts is not None else ids,
        ranked.counts if ranked is not None else ids, ranked.ranks if ranked is not None else ids,
        experts, router_logits.stride(-2),
        router_logits.stride(0) if partials else 0, SPLITS=splits, ROUND_TO=_TL_DTYPES[dtype], TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts),
        HAS_BIAS=bias is not None, RENORMALIZE=renormalize, HAS_COUNTS=expert_counts is not None,
        HAS_RANKS=ranked is not None, num_warps=1 if experts <= 256 else 4, **pdl_kwargs(weights),
    )  # fmt: skip
    return weights, ids


@triton.jit(do_not_specialize=["P", "CHUNK"])  # batch-dependent: no compile when T*k changes
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    P,
    E,
    CHUNK,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """All ``P <= CHUNK`` pairs into their slots (in the pairs' order within an expert), the
    padding, the block -> expert map and the padded length, in one program."""
    pdl_prologue(USE_PDL)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        p = s + tl.arange(0, SUB)
        e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        totals += tl.sum((e[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    slot = start  # the next free slot of each expert
    for s in range(0, CHUNK, SUB):
        p = s + tl.arange(0, SUB)
        e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        valid = (p < P) & (e >= 0)  # a negative id: an expert another rank holds (left out)
        onehot = (e[:, None] == offs_e[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert in this step
        dest = tl.sum(onehot * (rank + slot[None, :]), axis=1)
        tl.store(sorted_ptr + dest, p.to(tl.int32), mask=valid)
        slot += tl.sum(onehot, axis=0)
    write_layout(
        sorted_ptr, expert_ids_ptr, num_padded_ptr, totals, padded, start, end, e_mask, P, E, BLOCK_M
    )


def padded_length(pairs: int, block_m: int, num_experts: int) -> int:
    """Entries of ``sorted_ids`` for ``pairs`` pairs: every expert's run padded, never more than one
    block per pair, rounded up to whole blocks (an upper bound from shapes only)."""
    length = min(pairs + num_experts * (block_m - 1), pairs * block_m)
    return triton.cdiv(length, block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_m: int,
    num_experts: int,
    ranked: PairRanks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``P = T*k`` (token, slot) pairs of ``topk_ids [T, k]`` by expert, each expert's run
    padded to a multiple of ``block_m`` (a power of two of at least 16).

    Returns ``(sorted_ids [L] int32, expert_ids [L / block_m] int32, num_padded [1] int32)`` with
    ``L = padded_length(P, block_m, num_experts)``: ``sorted_ids[:num_padded]`` holds the pair
    indices ``token * k + slot`` (stable within an expert up to :data:`ALIGN_SINGLE_MAX` pairs, in
    the atomics' order beyond; pairs with a negative id, experts another expert-parallel rank
    holds, are left out) and ``P`` for padding, block ``b < num_padded / block_m`` belongs to
    expert ``expert_ids[b]``; the entries past ``num_padded`` are left unwritten (the GEMM reads
    none of them). ``ranked``: the pairs' ranks taken by the routing kernel (:func:`topk_softmax`),
    used beyond :data:`ALIGN_SINGLE_MAX` pairs (the atomic sort then skips its rank kernel)."""
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    pairs, device = flat.numel(), flat.device
    length = padded_length(pairs, block_m, num_experts)
    sorted_ids = torch.empty((length,), dtype=torch.int32, device=device)
    expert_ids = torch.empty((length // block_m,), dtype=torch.int32, device=device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=device)
    if pairs == 0:
        num_padded.zero_()
        return sorted_ids, expert_ids, num_padded
    if pairs > ALIGN_SINGLE_MAX:
        align_by_atomics(flat, block_m, num_experts, sorted_ids, expert_ids, num_padded, ranked)
        return sorted_ids, expert_ids, num_padded
    _align_kernel[(1,)](
        flat, sorted_ids, expert_ids, num_padded, pairs, num_experts,
        CHUNK=triton.next_power_of_2(max(pairs, _SUB)), SUB=_SUB, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m, num_warps=4, **pdl_kwargs(sorted_ids),
    )  # fmt: skip
    return sorted_ids, expert_ids, num_padded
