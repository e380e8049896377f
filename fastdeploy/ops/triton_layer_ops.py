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


@triton.jit
def _rotary_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    key_cache_ptr,
    value_cache_ptr,
    row_stride,
    num_q_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
    QH_P2: tl.constexpr,
    KH_P2: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, HALF_P2)
    d_mask = d < HALF
    dtype = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * HALF + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    # queries: rotated in place
    qh = tl.arange(0, QH_P2)
    q_mask = (qh[:, None] < num_q_heads) & d_mask[None, :]
    q_base = q_ptr + token * row_stride + qh[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(q_base, mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(q_base + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_base, (x1 * c[None, :] - x2 * s[None, :]).to(dtype), mask=q_mask)
    tl.store(q_base + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(dtype), mask=q_mask)
    # keys: rotated in place and, with the values, written to the token's cache slot
    kh = tl.arange(0, KH_P2)
    k_mask = (kh[:, None] < num_kv_heads) & d_mask[None, :]
    k_base = k_ptr + token * row_stride + kh[:, None] * HEAD_DIM + d[None, :]
    y1 = tl.load(k_base, mask=k_mask, other=0.0).to(tl.float32)
    y2 = tl.load(k_base + HALF, mask=k_mask, other=0.0).to(tl.float32)
    r1 = (y1 * c[None, :] - y2 * s[None, :]).to(dtype)
    r2 = (y2 * c[None, :] + y1 * s[None, :]).to(dtype)
    tl.store(k_base, r1, mask=k_mask)
    tl.store(k_base + HALF, r2, mask=k_mask)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        row = slot * num_kv_heads * HEAD_DIM + kh[:, None] * HEAD_DIM
        tl.store(key_cache_ptr + row + d[None, :], r1, mask=k_mask)
        tl.store(key_cache_ptr + row + HALF + d[None, :], r2, mask=k_mask)
        full = tl.arange(0, DIM_P2)
        v_mask = (kh[:, None] < num_kv_heads) & (full[None, :] < HEAD_DIM)
        v = tl.load(
            v_ptr + token * row_stride + kh[:, None] * HEAD_DIM + full[None, :], mask=v_mask, other=0.0
        )
        tl.store(value_cache_ptr + row + full[None, :], v, mask=v_mask)


def rotary_and_cache_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotary on ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` in place, then ``k`` and ``v`` into the
    NHD caches at ``slot_mapping`` (negative: skip): the rotary and cache-write kernels in one.

    ``q``, ``k`` and ``v`` are views of one qkv row buffer (same row stride, unit head stride);
    the caches have the activations' dtype (no fp8).
    """
    tokens, num_q_heads, head_dim = q.shape
    if tokens == 0:
        return
    half = head_dim // 2
    _rotary_cache_kernel[(tokens,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        slot_mapping,
        key_cache,
        value_cache,
        q.stride(0),
        num_q_heads,
        k.shape[1],
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        DIM_P2=triton.next_power_of_2(head_dim),
        QH_P2=triton.next_power_of_2(num_q_heads),
        KH_P2=triton.next_power_of_2(k.shape[1]),
    )
