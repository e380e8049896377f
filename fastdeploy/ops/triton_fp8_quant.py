"""FP8 activation quantization in one Triton kernel each: per token and ``group`` columns (the CUDA
path of :func:`fastdeploy.ops.fp8_quant.quantize_activation_per_token_group`), per token (of
:func:`fastdeploy.ops.fp8_quant.quantize_activation_per_token`), and per token after the residual
add and RMSNorm (:func:`add_rms_norm_quant`: the norm before an FP8 linear, in the same kernel).

The torch implementations are about eight kernels (pad, abs, amax, clamp, divide, clamp, cast,
slice); every FP8 linear and each FP8 MoE GEMM quantizes its activation, so those launches add
up. Here one kernel computes exactly what the torch version computes: the same float32 scale
(``max(amax, MIN_AMAX) / FP8_MAX``), a correctly rounded division, saturation to ``±FP8_MAX``
and a round-to-nearest-even cast, so both give identical bits.

The group kernel can write its scales column-major (``[M, groups]`` with strides ``(1, M)``):
the "outer-dim-major" 1 x 128 ``scale_a`` layout of ``torch._scaled_mm``'s block-wise mode,
written in place instead of transposed by a copy.

Under ``TRITON_INTERPRET=1`` the kernels store the saturated float32 quotients and torch casts
them: the interpreter's float32 → e4m3 conversion does not round to nearest (the GPU's
``cvt.rn.satfinite`` does), so the CPU tests check everything but that one hardware cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.ops.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_AMAX
from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_layer_ops import normalized_row
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue

TOKEN_BLOCK = 1024
"""Columns one step of the per-token kernel loads (it loops over K twice: amax, then quantize)."""


@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, stride_sg, GROUP: tl.constexpr,
    BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX_C)
    scale = tl.math.div_rn(amax, FP8_MAX_C)
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group * stride_sg, scale)


@triton.jit
def _token_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr,
    MIN_AMAX_C: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX_C), FP8_MAX_C)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _add_rms_norm_quant_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, y_ptr, n, eps, stride_xm, stride_rm, stride_qm, stride_ym,
    HAS_RESIDUAL: tl.constexpr, STORE_NORMED: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr,
    MIN_AMAX_C: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One row: ``h = x + residual`` (stored into ``residual``), ``y = weight * h / rms(h)`` rounded
    as :func:`fastdeploy.ops.triton_layer_ops.fused_add_rms_norm` rounds it (stored into ``y`` with
    ``STORE_NORMED``), then ``y`` quantized per token as :func:`_token_quant_kernel` quantizes it:
    the two kernels' bits."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = w_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (h + r).to(dtype)
        tl.store(r_ptr + row * stride_rm + cols, summed, mask=mask)
        h = summed.to(tl.float32)
    y = normalized_row(h, w_ptr, cols, mask, n, eps, dtype)
    if STORE_NORMED:
        tl.store(y_ptr + row * stride_ym + cols, y, mask=mask)
    y = y.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX_C), FP8_MAX_C)
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def add_rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    normed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y_fp8 [M, K], scale [M, 1] float32, new residual)`` with ``y = rms_norm(x + residual)``
    quantized per token, in one kernel: the bits of :func:`~fastdeploy.ops.layer_ops.fused_add_rms_norm`
    then :func:`quantize_activation_per_token`. ``y`` itself is written only into ``normed`` (``[M, K]``
    in ``x``'s dtype) when given: a mixture-of-experts block's router reads it beside the quantized
    rows. The residual sum goes into ``residual`` in place (as ``fused_add_rms_norm``); with
    ``residual`` None the new residual is ``x`` itself. ``x``, ``residual`` and ``weight`` share one
    16-bit dtype."""
    m, k = x.shape
    interpreting = triton_interpreting()
    q = torch.empty((m, k), dtype=torch.float32 if interpreting else FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _add_rms_norm_quant_kernel[(m,)](
            x, residual if residual is not None else x, weight, q, scale, normed if normed is not None else x,
            k, eps, x.stride(0), residual.stride(0) if residual is not None else 0, q.stride(0),
            normed.stride(0) if normed is not None else 0, HAS_RESIDUAL=residual is not None,
            STORE_NORMED=normed is not None, BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX,
            num_warps=4 if block <= 2048 else 8, **pdl_kwargs(x),
        )  # fmt: skip
    return (q.to(FP8_DTYPE) if interpreting else q), scale, (residual if residual is not None else x)


def quantize_activation_per_token_group(
    x: torch.Tensor, group: int = 128, column_major_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32)`` of a 2-D ``x`` with unit
    column stride, bit-identical to the torch version (see the module docstring).
    ``column_major_scale``: the scale tensor has strides ``(1, M)`` (``torch._scaled_mm``'s 1 x 128)."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    interpreting = triton_interpreting()
    q = torch.empty((m, k), dtype=torch.float32 if interpreting else FP8_DTYPE, device=x.device)
    if column_major_scale:
        scale = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q.to(FP8_DTYPE), scale
    _group_quant_kernel[(m, groups)](
        x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
        GROUP=group, BLOCK=triton.next_power_of_2(group), FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX,
        **pdl_kwargs(x),
    )  # fmt: skip
    return (q.to(FP8_DTYPE) if interpreting else q), scale


def quantize_activation_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [M, K] float8_e4m3fn, scale [M, 1] float32)`` of a 2-D ``x`` with unit column
    stride, bit-identical to :func:`fastdeploy.ops.fp8_quant.quantize_activation_per_token`."""
    m, k = x.shape
    interpreting = triton_interpreting()
    q = torch.empty((m, k), dtype=torch.float32 if interpreting else FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q.to(FP8_DTYPE), scale
    block = min(TOKEN_BLOCK, triton.next_power_of_2(k))
    _token_quant_kernel[(m,)](
        x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX,
        num_warps=4 if block <= 1024 else 8, **pdl_kwargs(x),
    )  # fmt: skip
    return (q.to(FP8_DTYPE) if interpreting else q), scale
