"""Fused MoE for a few tokens (decode): two GEMV-like Triton kernels, no sort, no padding.

At a handful of tokens a MoE layer is a pass over the chosen experts' weights (batch 1 of
Qwen3-30B-A3B: 8 experts x 9.4 MB in bf16 per layer against 2 x 8 x 6 MFLOP), so its time is
the bytes read over the memory bandwidth plus the launches. The grouped GEMM of
:mod:`fastdeploy.ops.triton_fused_moe` needs the expert sort first and then four more kernels
(gate_up GEMM, SiLU-and-multiply, down GEMM, the sum over the k slots), pads every expert's
single row to a 16-row MMA tile and at batch 1 runs ~200 programs of 256 KB each on 132 SMs.
Here, for each (token, slot) pair straight from ``topk_ids``:

1. :func:`_gate_up_kernel` — one program per (pair, ``BLOCK_N`` intermediate columns) reads
   those columns of the expert's gate and up rows and writes ``silu(gate) * up`` (the
   SiLU-and-multiply fused; rounded as the unfused path rounds it);
2. :func:`_down_kernel` — one program per (token, ``BLOCK_N`` output columns) reads those
   rows of its k experts' ``w2`` (one pipelined loop over the k x I columns, as if the k
   experts' rows were one row of a GEMV) and writes ``sum_j weight_j * act_j @ w2[e_j].T``
   (the routing weights and the top-k sum fused; float32 accumulation, rounded once).

Each weight element is read once per pair that chose its expert: the same bytes as the grouped
GEMM while the tokens' experts are distinct (always at batch 1), more when tokens share experts
(8 tokens x top-8 of 128 experts: 64 pair reads of ~50 distinct experts, +27%, less what L2
catches). Hence :data:`SMALL_BATCH_MAX_TOKENS` (``FD_MOE_GEMV_MAX_TOKENS``).

FP8 experts are read as FP8 and dequantized in registers (each row's 1 x ``BLOCK_K`` slice
times its block scale, ``BLOCK_K`` dividing the scale block; per-channel scales are the blocks
of one row by every column, :func:`scale_groups`), against
activations kept in their dtype (w8a16): quantizing the few activation rows would cost two
kernels and add error, and saves nothing when the weights' bytes are the time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastdeploy import envs
from fastdeploy.ops.fp8_quant import FP8_DTYPE
from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue, pdl_trigger

CHANNEL_GROUP_K = 1 << 30
"""Columns one per-channel weight scale covers, as the kernels' ``GROUP_K`` (more than any K)."""


def scale_groups(block_shape: tuple[int, int] | None) -> tuple[int, int]:
    """``(GROUP_N, GROUP_K)``: the weight rows and columns one FP8 scale covers, as the kernels take
    them; per-channel scales (``block_shape`` None, ``[E, N]``) are blocks of one row by every column."""
    return (1, CHANNEL_GROUP_K) if block_shape is None else block_shape


def small_batch_max_tokens() -> int:
    """Most tokens :func:`fused_experts_gemv` is used for (``FD_MOE_GEMV_MAX_TOKENS``; 0 turns it off)."""
    return envs.FD_MOE_GEMV_MAX_TOKENS


@dataclass(frozen=True)
class GemvConfig:
    """Meta-parameters of the two kernels: columns per program, K per step, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Measured on an H200 (Qwen3-30B-A3B experts, `moe_bench --sweep --tokens 1,4`; docs/benchmarks.md):
# (gate_up, down) per dtype for one or two tokens and for more. FP8 tiles of <= 128 rows scale
# the activations, so their K steps may span several 128-column scale blocks.
BF16_ONE_TOKEN = (GemvConfig(8, 256, 4, 3), GemvConfig(8, 512, 4, 4))
BF16_FEW_TOKENS = (GemvConfig(16, 256), GemvConfig(16, 256))
FP8_ONE_TOKEN = (GemvConfig(32, 256, 4, 4), GemvConfig(16, 512, 4, 4))
FP8_FEW_TOKENS = (GemvConfig(64, 64, 4, 3), GemvConfig(64, 256, 4, 4))
INTERPRETER = GemvConfig(16, 32, 4, 1)


@triton.jit
def _weight_tile(w_ptrs, s_ptrs, k_mask, FP8: tl.constexpr, EVEN_K: tl.constexpr):
    """One ``[BLOCK_N, BLOCK_K]`` weight tile in float32 (FP8: times its rows' block scales)."""
    if EVEN_K:
        w = tl.load(w_ptrs).to(tl.float32)
    else:
        w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
    if FP8:
        w = w * tl.load(s_ptrs)[:, None]
    return w


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    act_ptr,
    INTER,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_am,
    TOP_K: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_ON_X: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    SKIP_NEGATIVE: tl.constexpr = False,
):
    """``act[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, INTER + n])`` for ``BLOCK_N`` columns
    (``SKIP_NEGATIVE``: 0 for a pair whose id is negative, without reading a weight)."""
    pdl_prologue(USE_PDL)
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    k_end = K
    if SKIP_NEGATIVE:  # another rank's expert: no K steps, so an act row of zeros
        k_end = tl.where(expert >= 0, K, 0)
        expert = tl.maximum(expert, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    rows = tl.minimum(offs_n, INTER - 1).to(tl.int64)  # clamped: no N mask on the weight loads
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + INTER * stride_wn
    gate_s = s_ptr + expert * stride_se + (rows // GROUP_N) * stride_sn
    up_s = s_ptr + expert * stride_se + ((rows + INTER) // GROUP_N) * stride_sn
    x_ptrs = x_ptr + token * stride_xm + offs_k
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SCALE_ON_X:  # the tile's rows share one scale row (per gate / up): scale x, not the tile
        gate_s = s_ptr + expert * stride_se + ((pid_n * BLOCK_N) // GROUP_N) * stride_sn
        up_s = s_ptr + expert * stride_se + ((pid_n * BLOCK_N + INTER) // GROUP_N) * stride_sn
    for k0 in tl.range(0, k_end, BLOCK_K, num_stages=STAGES):
        k_mask = (k0 + offs_k) < K
        if EVEN_K:
            x = tl.load(x_ptrs + k0).to(tl.float32)
        else:
            x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0).to(tl.float32)
        if SCALE_ON_X:
            k_blocks = (k0 + offs_k) // GROUP_K
            x_g = x * tl.load(gate_s + k_blocks, mask=k_mask, other=0.0)
            x_u = x * tl.load(up_s + k_blocks, mask=k_mask, other=0.0)
            acc_g += _weight_tile(gate_ptrs + k0, gate_s, k_mask, False, EVEN_K) * x_g[None, :]
            acc_u += _weight_tile(up_ptrs + k0, up_s, k_mask, False, EVEN_K) * x_u[None, :]
        else:
            g = _weight_tile(gate_ptrs + k0, gate_s + k0 // GROUP_K, k_mask, FP8, EVEN_K)
            u = _weight_tile(up_ptrs + k0, up_s + k0 // GROUP_K, k_mask, FP8, EVEN_K)
            acc_g += g * x[None, :]
            acc_u += u * x[None, :]
    pdl_trigger(USE_PDL)
    dtype = act_ptr.dtype.element_ty
    # rounded as the unfused path: gate_up in the activation dtype, silu(gate), then the product
    gate = tl.sum(acc_g, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_u, axis=1).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(dtype), mask=n_mask)


@triton.jit
def _down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    topk_w_ptr,
    out_ptr,
    H,
    INTER,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    TOP_K: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_ON_X: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    SKIP_NEGATIVE: tl.constexpr = False,
):
    """``out[token, n] = sum_j topk_w[token, j] * act[pair_j] . w2[e_j, n]`` for ``BLOCK_N`` columns
    (``SKIP_NEGATIVE``: the slots whose id is negative are left out, their weights not read)."""
    pdl_prologue(USE_PDL)
    pid_n = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    rows = tl.minimum(offs_n, H - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # one pipelined loop over (slot, K step), so that the loads stream across the k experts'
    # rows without a pipeline drain between experts; the routing weight scales the activations
    k_steps = tl.cdiv(INTER, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in tl.range(0, TOP_K * k_steps, num_stages=STAGES):
        j = step // k_steps
        k0 = (step - j * k_steps) * BLOCK_K
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(topk_w_ptr + pair).to(tl.float32)
        k_mask = (k0 + offs_k) < INTER
        if SKIP_NEGATIVE:  # another rank's expert: every load masked off (EVEN_K is False)
            k_mask = (k0 + offs_k) < tl.where(expert >= 0, INTER, 0)
            expert = tl.maximum(expert, 0)
        a_ptrs = act_ptr + pair * stride_am + k0 + offs_k
        if EVEN_K:
            a = tl.load(a_ptrs).to(tl.float32)
        else:
            a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + (k0 + offs_k)[None, :]
        if SCALE_ON_X:  # the tile's rows share one scale row: scale the activations
            s_row = s_ptr + expert * stride_se + ((pid_n * BLOCK_N) // GROUP_N) * stride_sn
            a = a * tl.load(s_row + (k0 + offs_k) // GROUP_K, mask=k_mask, other=0.0)
            acc += _weight_tile(w_ptrs, s_row, k_mask, False, EVEN_K) * (a * weight)[None, :]
        else:
            s_ptrs = s_ptr + expert * stride_se + (rows // GROUP_N) * stride_sn + k0 // GROUP_K
            acc += _weight_tile(w_ptrs, s_ptrs, k_mask, FP8, EVEN_K) * (a * weight)[None, :]
    out = tl.sum(acc, axis=1)
    pdl_trigger(USE_PDL)
    tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def default_configs(fp8: bool, num_tokens: int = 1) -> tuple[GemvConfig, GemvConfig]:
    """The (gate_up, down) configurations used when the caller gives none."""
    if triton_interpreting():
        return INTERPRETER, INTERPRETER
    if num_tokens <= 2:
        return FP8_ONE_TOKEN if fp8 else BF16_ONE_TOKEN
    return FP8_FEW_TOKENS if fp8 else BF16_FEW_TOKENS


def fused_experts_gemv(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = (128, 128),
    configs: tuple[GemvConfig, GemvConfig] | None = None,
    skip_negative_ids: bool = False,
) -> torch.Tensor:
    """:func:`fastdeploy.ops.triton_fused_moe.fused_experts` for a few tokens, in two kernels (its
    arguments, already checked there; FP8 weights against unquantized activations).
    ``configs`` (gate_up, down) override the defaults."""
    num_tokens, top_k = topk_ids.shape
    e, two_i, h = w13.shape
    inter = two_i // 2
    fp8 = w13.dtype == FP8_DTYPE
    gate_up_cfg, down_cfg = configs or default_configs(fp8, num_tokens)
    block_shape = scale_groups(block_shape)
    # FP8: where a tile's rows share one scale row the scales multiply the activations (any
    # block_k); otherwise each row's scale multiplies its tile row (block_k divides the block)
    gate_up_on_x = fp8 and block_shape[0] % gate_up_cfg.block_n == 0 and inter % block_shape[0] == 0
    down_on_x = fp8 and block_shape[0] % down_cfg.block_n == 0
    if fp8:
        for cfg, on_x in ((gate_up_cfg, gate_up_on_x), (down_cfg, down_on_x)):
            if not on_x and block_shape[1] % cfg.block_k:
                raise ValueError(
                    f"block_k ({cfg.block_k}) must divide the scale block's columns ({block_shape[1]})"
                )
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    act = torch.empty((num_tokens * top_k, inter), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((num_tokens, h), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    interpreting = triton_interpreting()
    s13 = w13_scale if fp8 else w13
    _gate_up_kernel[(triton.cdiv(inter, gate_up_cfg.block_n), num_tokens * top_k)](
        hidden, w13, s13, ids, act, inter, h, hidden.stride(0), w13.stride(0), w13.stride(1),
        s13.stride(0) if fp8 else 0, s13.stride(1) if fp8 else 0, act.stride(0),
        TOP_K=top_k, FP8=fp8, SCALE_ON_X=gate_up_on_x, GROUP_N=block_shape[0], GROUP_K=block_shape[1],
        EVEN_K=h % gate_up_cfg.block_k == 0, BLOCK_N=gate_up_cfg.block_n, BLOCK_K=gate_up_cfg.block_k,
        STAGES=1 if interpreting else gate_up_cfg.num_stages, num_warps=gate_up_cfg.num_warps,
        SKIP_NEGATIVE=skip_negative_ids, **pdl_kwargs(act),
    )  # fmt: skip
    s2 = w2_scale if fp8 else w2
    _down_kernel[(triton.cdiv(h, down_cfg.block_n), num_tokens)](
        act, w2, s2, ids, weights, out, h, inter, act.stride(0), w2.stride(0), w2.stride(1),
        s2.stride(0) if fp8 else 0, s2.stride(1) if fp8 else 0, out.stride(0),
        TOP_K=top_k, FP8=fp8, SCALE_ON_X=down_on_x, GROUP_N=block_shape[0], GROUP_K=block_shape[1],
        EVEN_K=inter % down_cfg.block_k == 0 and not skip_negative_ids, BLOCK_N=down_cfg.block_n,
        BLOCK_K=down_cfg.block_k, STAGES=1 if interpreting else down_cfg.num_stages,
        num_warps=down_cfg.num_warps, SKIP_NEGATIVE=skip_negative_ids, **pdl_kwargs(out),
    )  # fmt: skip
    return out
