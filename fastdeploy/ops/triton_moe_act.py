"""The elementwise steps of the fused MoE between and after its two grouped GEMMs, per (token,
slot) pair, in Triton (:mod:`fastdeploy.ops.triton_fused_moe` calls them):

* :func:`silu_mul_quant` — ``silu(gate) * up`` of each pair's ``[gate | up]`` row quantized to
  FP8 for the down GEMM (1 x ``bk`` groups or one scale per token) in one kernel: the same bits
  as :func:`fastdeploy.ops.layer_ops.silu_and_mul` followed by :mod:`fastdeploy.ops.fp8_quant`,
  without the activation's round trip through memory;
* :func:`silu_and_mul_pairs` — the bf16 activation, skipping pairs whose expert id is negative;
* :func:`sum_pairs` — each token's sum over its k pair outputs, leaving such pairs out.

A negative id marks an expert another expert-parallel rank holds: when the tokens of n
data-parallel ranks are gathered, about (n-1)/n of the pairs, whose rows are then neither
computed nor read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.ops.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_AMAX, quantize_activation_per_token
from fastdeploy.ops.layer_ops import silu_and_mul
from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_layer_ops import silu_mul_cols
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue


@triton.jit
def _silu_and_mul_pairs_kernel(
    gu_ptr, ids_ptr, out_ptr, gu_stride, out_stride, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):  # fmt: skip
    """``silu(gate) * up`` of one pair's row, nothing for a pair whose expert id is negative."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    if tl.load(ids_ptr + row) < 0:
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    val = silu_mul_cols(gu_ptr, row, gu_stride, n, cols, mask)
    tl.store(out_ptr + row * out_stride + cols, val.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_pairs_kernel(
    x_ptr,
    ids_ptr,
    out_ptr,
    H,
    stride_x,
    stride_o,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    SKIP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[token] = sum of x[pair]`` over the token's k pairs (with ``SKIP``: those whose expert id
    is not negative), float32 accumulation, rounded once."""
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        end = H
        if SKIP:
            end = tl.where(tl.load(ids_ptr + pair) >= 0, H, 0)  # a skipped pair: every load masked off
        acc += tl.load(x_ptr + pair * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(
    gu_ptr, ids_ptr, q_ptr, s_ptr, n, gu_stride, q_stride, s_stride_m, s_stride_g, WIDTH: tl.constexpr,
    BLOCK: tl.constexpr, SKIP: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """``silu(gate) * up`` of ``WIDTH`` columns of one pair's row, rounded to the activation dtype
    as :func:`silu_and_mul` rounds it, then quantized to FP8 with one scale for those columns, as
    :mod:`fastdeploy.ops.triton_fp8_quant` quantizes them (the same bits, one kernel)."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    if SKIP:
        if tl.load(ids_ptr + row) < 0:  # another rank's expert: nothing to compute
            return
    offs = tl.arange(0, BLOCK)
    cols = group * WIDTH + offs
    mask = (offs < WIDTH) & (cols < n)
    val = silu_mul_cols(gu_ptr, row, gu_stride, n, cols, mask).to(gu_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(val), axis=0), MIN_AMAX_C), FP8_MAX_C)
    q = tl.minimum(tl.maximum(tl.math.div_rn(val, scale), -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * s_stride_m + group * s_stride_g, scale)


SILU_QUANT_MAX_BLOCK = 8192
"""Widest intermediate size the fused SiLU + per-token quantization holds in one program."""


def silu_mul_quant(
    gate_up: torch.Tensor, block_shape: tuple[int, int] | None, ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` of ``gate_up [P, 2I]`` quantized to FP8 for the down GEMM in one kernel:
    ``(act_fp8 [P, I], scale)`` with ``scale [P, ceil(I/bk)]`` (1 x ``bk`` groups of
    ``block_shape``) or ``[P, 1]`` (per token, ``block_shape`` None). The same bits as
    :func:`silu_and_mul` then the activation quantization of :mod:`fastdeploy.ops.fp8_quant`,
    without the activation's round trip through memory. With ``ids [P]`` the rows of pairs whose
    id is negative are skipped (left unwritten)."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    width = n if block_shape is None else block_shape[1]
    groups = triton.cdiv(n, width)
    interpreting = triton_interpreting()  # (the interpreter's e4m3 cast does not round: torch casts)
    q = torch.empty((rows, n), dtype=torch.float32 if interpreting else FP8_DTYPE, device=gate_up.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=gate_up.device)
    if rows:
        block = triton.next_power_of_2(width)
        _silu_mul_quant_kernel[(rows, groups)](
            gate_up, ids if ids is not None else gate_up, q, scale, n, gate_up.stride(0), q.stride(0),
            scale.stride(0), scale.stride(1), WIDTH=width, BLOCK=block, SKIP=ids is not None,
            FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, num_warps=4 if block <= 1024 else 8, **pdl_kwargs(q),
        )  # fmt: skip
    return (q.to(FP8_DTYPE) if interpreting else q), scale


def silu_mul_fp8(
    gate_up: torch.Tensor, block_shape: tuple[int, int] | None, ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 down GEMM's input from ``gate_up [P, 2I]``: :func:`silu_mul_quant` in one kernel where
    it holds the width (block scales, or per token up to :data:`SILU_QUANT_MAX_BLOCK`), else
    SiLU-and-multiply, then the activation quantization (``ids``: as :func:`silu_mul_quant`)."""
    if block_shape is not None or gate_up.shape[1] // 2 <= SILU_QUANT_MAX_BLOCK:
        return silu_mul_quant(gate_up, block_shape, ids)
    act = silu_and_mul_pairs(gate_up, ids) if ids is not None else silu_and_mul(gate_up)
    return quantize_activation_per_token(act)


def silu_and_mul_pairs(gate_up: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of each pair's ``[gate | up]`` row whose expert id (``ids [P]``) is not
    negative; the other rows are left unwritten (no kernel reads them)."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        grid = (rows, triton.cdiv(n, block))
        _silu_and_mul_pairs_kernel[grid](
            gate_up, ids, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, **pdl_kwargs(out)
        )
    return out


def sum_pairs(x: torch.Tensor, ids: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """``[T, H]``: each token's sum of its ``top_k`` pair rows of ``x [T * top_k, H]``, leaving out
    the pairs whose id (``ids [T * top_k]``; None: none left out) is negative (their rows are never read)."""
    tokens, h = x.shape[0] // top_k, x.shape[1]
    out = torch.empty((tokens, h), dtype=x.dtype, device=x.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(h))
        grid = (tokens, triton.cdiv(h, block))
        _sum_pairs_kernel[grid](
            x, ids if ids is not None else x, out, h, x.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
            SKIP=ids is not None, **pdl_kwargs(out),
        )  # fmt: skip
    return out
