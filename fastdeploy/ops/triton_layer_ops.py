"""Triton kernels for the element-wise ops of the decoder layer on a GPU.

One kernel each for RMSNorm, RMSNorm with the residual add, the rotary embedding
(in place) and SiLU-and-multiply, where the torch fallback launches five to fifteen
small kernels; at batch 1 those launches, not the math, set the step time. Rounding
points are those of the torch fallback in :mod:`fastdeploy.ops.layer_ops`. On a CPU
the kernels run under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, x_stride, r_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * r_stride + cols, summed, mask=mask)
    s = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / n + eps)
    normed = (s * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * x_stride + cols, (normed * w).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    x_stride,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    HEADS_P2: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, HALF_P2)
    d_mask = d < HALF
    dtype = x_ptr.dtype.element_ty
    # cos/sin rounded to the activation dtype first, as the torch fallback does
    c = tl.load(cos_ptr + pos * HALF + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    heads = tl.arange(0, HEADS_P2)
    mask = (heads[:, None] < num_heads) & d_mask[None, :]
    base = x_ptr + token * x_stride + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c[None, :] - x2 * s[None, :]).to(dtype), mask=mask)
    tl.store(base + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, gu_stride, out_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def _row_block(n: int) -> int:
    return triton.next_power_of_2(n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` of a 2-D ``x`` (unit stride in the last dimension)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        n = x.shape[1]
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.stride(0), out.stride(0), n, eps, BLOCK=_row_block(n)
        )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x; x = rms_norm(residual)`` in place; returns ``(x, residual)``."""
    if x.shape[0]:
        n = x.shape[1]
        _fused_add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, x.stride(0), residual.stride(0), n, eps, BLOCK=_row_block(n)
        )
    return x, residual


def rotary_embedding_(
    positions: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
) -> None:
    """Rotate the first ``num_heads`` heads of each row of ``x`` in place (NeoX layout)."""
    if x.shape[0] == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(x.shape[0],)](
        x,
        positions,
        cos,
        sin,
        x.stride(0),
        num_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        HEADS_P2=triton.next_power_of_2(num_heads),
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` of a 2-D tensor."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block
        )
    return out
