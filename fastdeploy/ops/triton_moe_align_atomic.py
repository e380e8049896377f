"""The MoE expert sort of steps beyond one program's pairs
(:data:`fastdeploy.ops.triton_moe_routing.ALIGN_SINGLE_MAX`) by atomic counters, in three short kernels
(a prefill step of 8,192 tokens x top-8 is 65,536 pairs).

1. :func:`_rank_kernel`: every pair adds one to its expert's counter; the counter's old value is
   the pair's rank within its expert (a unique slot; the order among an expert's pairs is the
   order the atomics land in, not the pairs' order).
2. :func:`_layout_kernel` (one program): each expert's run padded to ``BLOCK_M``, its start, the
   padded length, the padding entries and the block -> expert map.
3. :func:`_place_kernel`: ``sorted_ids[start[expert] + rank] = pair``.

The layout is the one-program sort's (same padded length, same block -> expert map, same set of
pairs in each expert's run), only the order within a run may differ. The grouped GEMM computes each pair's
row on its own, so the MoE's output is the same either way (bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue

BLOCK_P = 1024
"""Pairs per program of the rank and place kernels."""


@triton.jit
def write_layout(
    sorted_ptr, expert_ids_ptr, num_padded_ptr, totals, padded, start, end, e_mask, P, E, BLOCK_M: tl.constexpr
):  # fmt: skip
    """The padded length, each expert's padding entries (``P`` in slots ``[start + count, end)``)
    and the expert of every ``BLOCK_M`` block, from the experts' pair counts ``totals`` and their
    padded runs ``[start, end)`` (both sorts share it)."""
    num_padded = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, num_padded)
    fill = start + totals
    for j0 in tl.static_range(0, BLOCK_M, 16):
        j = j0 + tl.arange(0, 16)
        pos = fill[:, None] + j[None, :]
        tl.store(sorted_ptr + pos, tl.zeros_like(pos) + P, mask=pos < end[:, None])
    # block b belongs to the first expert whose padded run ends past b * BLOCK_M
    for b0 in range(0, num_padded // BLOCK_M, 64):
        b = b0 + tl.arange(0, 64)
        ended = (end[None, :] <= b[:, None] * BLOCK_M) & e_mask[None, :]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), E - 1)
        tl.store(expert_ids_ptr + b, expert, mask=b * BLOCK_M < num_padded)


@triton.jit(do_not_specialize=["P"])
def _rank_kernel(ids_ptr, counts_ptr, ranks_ptr, P, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """``ranks[p]``: how many pairs of ``p``'s expert took a slot before it (atomically)."""
    pdl_prologue(USE_PDL)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
    valid = (p < P) & (e >= 0)  # a negative id: an expert another rank holds (left out)
    ones = tl.full([BLOCK], 1, tl.int32)  # (relaxed: only the counts matter, read by the next kernel)
    rank = tl.atomic_add(counts_ptr + tl.where(valid, e, 0), ones, mask=valid, sem="relaxed")
    tl.store(ranks_ptr + p, rank, mask=valid)


@triton.jit(do_not_specialize=["P"])
def _layout_kernel(
    counts_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, P, E,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Each expert's padded start, the padded length, the padding entries (``P``) and the expert of
    every ``BLOCK_M`` block."""
    pdl_prologue(USE_PDL)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    totals = tl.load(counts_ptr + offs_e, mask=e_mask, other=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    tl.store(starts_ptr + offs_e, start, mask=e_mask)
    write_layout(
        sorted_ptr, expert_ids_ptr, num_padded_ptr, totals, padded, start, end, e_mask, P, E, BLOCK_M
    )


@triton.jit(do_not_specialize=["P"])
def _place_kernel(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, P, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """``sorted_ids[start[expert] + rank] = pair`` for the pairs whose expert id is not negative."""
    pdl_prologue(USE_PDL)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
    valid = (p < P) & (e >= 0)
    dest = tl.load(starts_ptr + e, mask=valid, other=0) + tl.load(ranks_ptr + p, mask=valid, other=0)
    tl.store(sorted_ptr + dest, p.to(tl.int32), mask=valid)


def align_by_atomics(
    flat_ids: torch.Tensor,
    block_m: int,
    num_experts: int,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
) -> None:
    """Fill ``sorted_ids``, ``expert_ids`` and ``num_padded`` (allocated by
    :func:`fastdeploy.ops.triton_moe_routing.moe_align_block_size`) for the ``P`` pairs of
    ``flat_ids`` by atomic counters; every size comes from shapes (CUDA-graph safe)."""
    pairs, device = flat_ids.numel(), flat_ids.device
    block_e = triton.next_power_of_2(num_experts)
    counts = torch.zeros((block_e,), dtype=torch.int32, device=device)
    starts = torch.empty((block_e,), dtype=torch.int32, device=device)
    ranks = torch.empty((pairs,), dtype=torch.int32, device=device)
    grid = (triton.cdiv(pairs, BLOCK_P),)
    _rank_kernel[grid](flat_ids, counts, ranks, pairs, BLOCK=BLOCK_P, num_warps=8, **pdl_kwargs(ranks))
    _layout_kernel[(1,)](
        counts, starts, sorted_ids, expert_ids, num_padded, pairs, num_experts,
        BLOCK_E=block_e, BLOCK_M=block_m, num_warps=4, **pdl_kwargs(ranks),
    )  # fmt: skip
    _place_kernel[grid](
        flat_ids, ranks, starts, sorted_ids, pairs, BLOCK=BLOCK_P, num_warps=8, **pdl_kwargs(ranks)
    )
