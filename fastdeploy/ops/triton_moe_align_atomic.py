"""The MoE expert sort of steps beyond one program's pairs
(:data:`fastdeploy.ops.triton_moe_routing.ALIGN_SINGLE_MAX`) by atomic counters, in three short kernels
(a prefill step of 8,192 tokens x top-8 is 65,536 pairs).

1. :func:`_rank_kernel`: every pair adds one to its expert's counter; the counter's old value is
   the pair's rank within its expert (a unique slot; the order among an expert's pairs is the
   order the atomics land in, not the pairs' order). With ``FD_MOE_RANKS_IN_ROUTER`` the routing
   kernel takes the ranks as it picks the experts (:class:`PairRanks`) and this kernel does not run.
2. :func:`_layout_kernel` (one program): each expert's run padded to ``BLOCK_M``, its start, the
   padded length, the padding entries and the block -> expert map; up to
   :data:`PLACE_IN_LAYOUT_MAX` pairs (a decode batch) also step 3, one launch fewer.
3. :func:`_place_kernel`: ``sorted_ids[start[expert] + rank] = pair``.

The layout is the one-program sort's (same padded length, same block -> expert map, same set of
pairs in each expert's run), only the order within a run may differ. The grouped GEMM computes each pair's
row on its own, so the MoE's output is the same either way (bit for bit).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue

BLOCK_P = 1024
"""Pairs per program of the rank and place kernels."""
PLACE_IN_LAYOUT_MAX = 2048
"""Up to this many pairs (256 tokens x top-8) the layout kernel's one program also places them."""


@dataclasses.dataclass
class PairRanks:
    """The (token, slot) pairs' ranks within their experts, taken by atomic adds where the pairs
    are routed (:func:`fastdeploy.ops.triton_moe_routing.topk_softmax`), for :func:`align_by_atomics`.

    ``counts``: int32 ``[next_pow2(E)]``, zero before the routing, then each expert's pairs;
    ``ranks``: int32 ``[P]``, pair ``p``'s slot among its expert's pairs."""

    counts: torch.Tensor
    ranks: torch.Tensor


def new_pair_ranks(pairs: int, num_experts: int, device: torch.device) -> PairRanks:
    """Zeroed counters and room for ``pairs`` ranks."""
    counts = torch.zeros((triton.next_power_of_2(num_experts),), dtype=torch.int32, device=device)
    return PairRanks(counts, torch.empty((pairs,), dtype=torch.int32, device=device))


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


@triton.jit
def _place(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, first, P, BLOCK: tl.constexpr):
    """``sorted_ids[start[expert] + rank] = pair`` for the pairs ``[first, first + BLOCK)`` below ``P``
    whose expert id is not negative."""
    p = first + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
    valid = (p < P) & (e >= 0)
    dest = tl.load(starts_ptr + e, mask=valid, other=0) + tl.load(ranks_ptr + p, mask=valid, other=0)
    tl.store(sorted_ptr + dest, p.to(tl.int32), mask=valid)


@triton.jit(do_not_specialize=["P"])
def _layout_kernel(
    counts_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, ids_ptr, ranks_ptr, P, E,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, PLACE: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Each expert's padded start, the padded length, the padding entries (``P``) and the expert of
    every ``BLOCK_M`` block; with ``PLACE`` the pairs too (:func:`_place`, ``BLOCK`` at a time)."""
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
    if PLACE:
        tl.debug_barrier()  # the starts stored above, seen by every thread of the program
        for first in range(0, P, BLOCK):
            _place(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, first, P, BLOCK)


@triton.jit(do_not_specialize=["P"])
def _place_kernel(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, P, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """:func:`_place` of one ``BLOCK`` of pairs a program."""
    pdl_prologue(USE_PDL)
    _place(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, tl.program_id(0) * BLOCK, P, BLOCK)


def align_by_atomics(
    flat_ids: torch.Tensor,
    block_m: int,
    num_experts: int,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    ranked: PairRanks | None = None,
) -> None:
    """Fill ``sorted_ids``, ``expert_ids`` and ``num_padded`` (allocated by
    :func:`fastdeploy.ops.triton_moe_routing.moe_align_block_size`) for the ``P`` pairs of
    ``flat_ids`` by atomic counters (``ranked``: already taken by the routing kernel); every size
    comes from shapes (CUDA-graph safe)."""
    pairs, device = flat_ids.numel(), flat_ids.device
    block_e = triton.next_power_of_2(num_experts)
    grid = (triton.cdiv(pairs, BLOCK_P),)
    if ranked is None:
        ranked = new_pair_ranks(pairs, num_experts, device)
        _rank_kernel[grid](
            flat_ids, ranked.counts, ranked.ranks, pairs, BLOCK=BLOCK_P, num_warps=8, **pdl_kwargs(sorted_ids)
        )  # fmt: skip
    elif ranked.ranks.numel() != pairs or ranked.counts.numel() != block_e:
        raise ValueError(
            f"ranked holds {ranked.ranks.numel()} ranks and {ranked.counts.numel()} counters, "
            f"expected {pairs} and {block_e}"
        )
    starts = torch.empty((block_e,), dtype=torch.int32, device=device)
    place = pairs <= PLACE_IN_LAYOUT_MAX
    _layout_kernel[(1,)](
        ranked.counts, starts, sorted_ids, expert_ids, num_padded, flat_ids, ranked.ranks, pairs, num_experts,
        BLOCK_E=block_e, BLOCK_M=block_m, PLACE=place, BLOCK=BLOCK_P, num_warps=8 if place else 4,
        **pdl_kwargs(sorted_ids),
    )  # fmt: skip
    if not place:
        _place_kernel[grid](
            flat_ids, ranked.ranks, starts, sorted_ids, pairs, BLOCK=BLOCK_P, num_warps=8, **pdl_kwargs(sorted_ids)
        )  # fmt: skip
