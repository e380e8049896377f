"""Fused MoE for a few tokens in one pass over the chosen experts' weights (``FD_MOE_GEMV_ONE_PASS``).

The two-kernel path of :mod:`fastdeploy.ops.triton_moe_gemv` first writes every pair's whole
``silu(gate) * up`` row, then reads it back in a second grid whose programs each loop over all k
experts' ``w2`` rows for a few output columns: at one token of Qwen3-30B-A3B, 2048 / 16 = 128
programs on 132 SMs, each walking 8 experts in turn (8.6 µs for 12.6 MB, a third of the copy rate,
twenty-sixth session). Here the intermediate dimension is split instead, so that both halves of
an expert's MLP stream in the same program:

1. :func:`_expert_slice_kernel` — one program per (pair, ``BLOCK_I`` intermediate columns): the
   ``2 x BLOCK_I`` gate / up rows against the token (``act = silu(gate) * up``, rounded as the
   unfused path rounds it, kept in registers), then the matching ``BLOCK_I`` columns of the
   expert's ``w2`` against ``act``, times the routing weight: a float32 partial output row
   ``[H]`` per program;
2. :func:`_sum_partials_kernel` — the ``k x I / BLOCK_I`` partial rows of each token summed in a
   fixed order (deterministic, no atomics) and rounded once to the output dtype.

The partial rows are ``T x k x I / BLOCK_I x H`` float32 (1.5 MB at one token of that shape with
the default ``BLOCK_I = 32``), written and read once, mostly from L2. FP8 weights are read as FP8 and scaled
in registers against unquantized activations (w8a16), as in the two-kernel path: per-channel
scales after each row's dot, 128 x 128 block scales on the activations (``BLOCK_I`` divides the
block, so a tile's rows share one scale row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastdeploy import envs
from fastdeploy.ops.fp8_quant import FP8_DTYPE
from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_moe_gemv import scale_groups
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue, pdl_trigger


@dataclass(frozen=True)
class OnePassConfig:
    """Meta-parameters: intermediate columns per program, the gate / up K step, the ``w2`` row
    step, warps, pipeline stages, and the summing kernel's output columns per program."""

    block_i: int = 32
    block_k: int = 256
    block_h: int = 128
    num_warps: int = 4
    num_stages: int = 4
    sum_block_h: int = 128


SUM_BLOCK_R = 16
"""Partial rows the summing kernel loads a step (x ``sum_block_h`` float32 columns: 8 KB at 128)."""
DEFAULT = OnePassConfig()
"""Not yet measured on a GPU (``tools/gpu_pending.sh OUT moe_fusions`` sweeps it)."""
INTERPRETER = OnePassConfig(16, 32, 32, 4, 1, 32)


def enabled() -> bool:
    """Whether few-token MoE calls take this path where :func:`supports` holds (``FD_MOE_GEMV_ONE_PASS``)."""
    return envs.FD_MOE_GEMV_ONE_PASS


def supports(
    w13: torch.Tensor, block_shape: tuple[int, int] | None, config: OnePassConfig | None = None
) -> bool:
    """Whether the layout fits: unquantized weights, per-channel FP8, or FP8 blocks that
    ``block_i`` divides (one scale row per tile and one ``w2`` scale column per program) with
    the intermediate size a whole number of row blocks (the up rows start on a block)."""
    if w13.dtype != FP8_DTYPE or block_shape is None:
        return True
    block_i = (config or default_config()).block_i
    bn, bk = block_shape
    return bn % block_i == 0 and bk % block_i == 0 and (w13.shape[1] // 2) % bn == 0


def default_config() -> OnePassConfig:
    """The interpreter's small tiles under ``TRITON_INTERPRET=1``, else :data:`DEFAULT`."""
    return INTERPRETER if triton_interpreting() else DEFAULT


@triton.jit
def _expert_slice_kernel(
    x_ptr,
    w13_ptr,
    s13_ptr,
    w2_ptr,
    s2_ptr,
    ids_ptr,
    topk_w_ptr,
    part_ptr,
    H,
    INTER,
    stride_xm,
    stride_13e,
    stride_13n,
    stride_s13e,
    stride_s13n,
    stride_2e,
    stride_2n,
    stride_s2e,
    stride_s2n,
    TOP_K: tl.constexpr,
    FP8: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    SKIP_NEGATIVE: tl.constexpr,
):
    """``part[pair, pid_i, :] = topk_w[pair] * w2[e][:, cols] @ (silu(x . gate_e[cols]) * (x . up_e[cols]))``
    for the ``BLOCK_I`` intermediate columns ``cols`` of program ``pid_i`` (``SKIP_NEGATIVE``: a
    pair whose id is negative writes zeros without reading a weight)."""
    pdl_prologue(USE_PDL)
    pid_i = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    weight = tl.load(topk_w_ptr + pair).to(tl.float32)
    end = H  # of both loops: 0 for another rank's expert (SKIP_NEGATIVE), no loads, a row of zeros
    if SKIP_NEGATIVE:
        end = tl.where(expert >= 0, H, 0)
        expert = tl.maximum(expert, 0)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < INTER
    rows = tl.minimum(offs_i, INTER - 1).to(tl.int64)  # clamped: no row mask on the weight loads
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = w13_ptr + expert * stride_13e + rows[:, None] * stride_13n + offs_k[None, :]
    up_ptrs = gate_ptrs + INTER * stride_13n
    x_ptrs = x_ptr + token * stride_xm + offs_k
    # FP8 blocks: the tile's gate rows share one scale row, its up rows another (scale x by them)
    gate_s_row = s13_ptr + expert * stride_s13e + ((pid_i * BLOCK_I) // GROUP_N) * stride_s13n
    up_s_row = s13_ptr + expert * stride_s13e + ((pid_i * BLOCK_I + INTER) // GROUP_N) * stride_s13n
    acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, end, BLOCK_K, num_stages=STAGES):
        k_mask = (k0 + offs_k) < H
        x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0).to(tl.float32)
        x_g = x
        x_u = x
        if FP8 and not PER_CHANNEL:
            k_blocks = (k0 + offs_k) // GROUP_K
            x_g = x * tl.load(gate_s_row + k_blocks, mask=k_mask, other=0.0)
            x_u = x * tl.load(up_s_row + k_blocks, mask=k_mask, other=0.0)
        g = tl.load(gate_ptrs + k0, mask=k_mask[None, :], other=0.0).to(tl.float32)
        u = tl.load(up_ptrs + k0, mask=k_mask[None, :], other=0.0).to(tl.float32)
        acc_g += g * x_g[None, :]
        acc_u += u * x_u[None, :]
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if FP8 and PER_CHANNEL:
        gate = gate * tl.load(s13_ptr + expert * stride_s13e + rows * stride_s13n)
        up = up * tl.load(s13_ptr + expert * stride_s13e + (rows + INTER) * stride_s13n)
    dtype = x_ptr.dtype.element_ty
    # rounded as the unfused path: gate_up in the activation dtype, silu(gate), then the product
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    act = tl.where(i_mask, act.to(dtype).to(tl.float32), 0.0) * weight
    # the matching BLOCK_I columns of w2 [H, INTER], BLOCK_H rows a step
    offs_h = tl.arange(0, BLOCK_H)
    part_row = part_ptr + (pair * tl.num_programs(0) + pid_i) * H
    for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
        h = h0 + offs_h
        h_mask = h < end
        w_ptrs = w2_ptr + expert * stride_2e + h.to(tl.int64)[:, None] * stride_2n + rows[None, :]
        w = tl.load(w_ptrs, mask=h_mask[:, None] & i_mask[None, :], other=0.0).to(tl.float32)
        out = tl.sum(w * act[None, :], axis=1)
        if FP8:
            s_ptrs = s2_ptr + expert * stride_s2e + (h // GROUP_N) * stride_s2n + (pid_i * BLOCK_I) // GROUP_K
            out = out * tl.load(s_ptrs, mask=h_mask, other=0.0)
        tl.store(part_row + h, out, mask=h < H)
    pdl_trigger(USE_PDL)


@triton.jit
def _sum_partials_kernel(
    part_ptr, out_ptr, H, ROWS, stride_om, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr
):
    """``out[token, cols] = sum over the token's ROWS partial rows``, ``BLOCK_R`` rows a step (one
    ``[BLOCK_R, BLOCK_H]`` load each, not ROWS dependent loads), in a fixed order."""
    pdl_prologue(USE_PDL)
    pid_h = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = offs_h < H
    rows = part_ptr + token * ROWS * H + offs_h[None, :]
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r0 in range(0, ROWS, BLOCK_R):
        r = r0 + offs_r
        tile = tl.load(
            rows + r.to(tl.int64)[:, None] * H, mask=(r < ROWS)[:, None] & h_mask[None, :], other=0.0
        )
        acc += tl.sum(tile, axis=0)
    pdl_trigger(USE_PDL)
    tl.store(out_ptr + token * stride_om + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


def fused_experts_one_pass(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = (128, 128),
    config: OnePassConfig | None = None,
    skip_negative_ids: bool = False,
) -> torch.Tensor:
    """:func:`fastdeploy.ops.triton_fused_moe.fused_experts` for a few tokens in two kernels (its
    arguments, already checked there; FP8 weights against unquantized activations), the layout
    one :func:`supports`. Returns ``[T, H]`` in ``hidden.dtype``."""
    config = config or default_config()
    if not supports(w13, block_shape, config):
        raise ValueError(f"block_i ({config.block_i}) must divide the FP8 weight blocks {block_shape}")
    num_tokens, top_k = topk_ids.shape
    _, two_i, h = w13.shape
    inter = two_i // 2
    out = torch.empty((num_tokens, h), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    fp8 = w13.dtype == FP8_DTYPE
    per_channel = fp8 and block_shape is None
    group_n, group_k = scale_groups(block_shape)
    n_slices = triton.cdiv(inter, config.block_i)
    partials = torch.empty((num_tokens * top_k, n_slices, h), dtype=torch.float32, device=hidden.device)
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    s13 = w13_scale if fp8 else w13
    s2 = w2_scale if fp8 else w2
    stages = 1 if triton_interpreting() else config.num_stages
    _expert_slice_kernel[(n_slices, num_tokens * top_k)](
        hidden, w13, s13, w2, s2, ids, weights, partials, h, inter, hidden.stride(0),
        w13.stride(0), w13.stride(1), s13.stride(0) if fp8 else 0, s13.stride(1) if fp8 else 0,
        w2.stride(0), w2.stride(1), s2.stride(0) if fp8 else 0, s2.stride(1) if fp8 else 0,
        TOP_K=top_k, FP8=fp8, PER_CHANNEL=per_channel, GROUP_N=group_n, GROUP_K=group_k,
        BLOCK_I=config.block_i, BLOCK_K=config.block_k, BLOCK_H=config.block_h, STAGES=stages,
        num_warps=config.num_warps, SKIP_NEGATIVE=skip_negative_ids, **pdl_kwargs(partials),
    )  # fmt: skip
    _sum_partials_kernel[(triton.cdiv(h, config.sum_block_h), num_tokens)](
        partials,
        out,
        h,
        top_k * n_slices,
        out.stride(0),
        BLOCK_R=SUM_BLOCK_R,
        BLOCK_H=config.sum_block_h,
        **pdl_kwargs(out),
    )
    return out
