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

from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue


@triton.jit
def normalized_row(x, w_ptr, cols, mask, n, eps, dtype: tl.constexpr):
    """``weight * x / rms(x)`` of one float32 row, rounded to ``dtype`` after the normalization and
    again after the weight (the torch fallback's points; every kernel that normalizes uses these)."""
    return scaled_by_rms(x, inverse_rms(x, n, eps), w_ptr, cols, mask, dtype)


@triton.jit
def inverse_rms(x, n, eps):
    """``1 / rms`` of one float32 row of ``n`` values (masked columns zero)."""
    return tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)


@triton.jit
def scaled_by_rms(x, inv, w_ptr, cols, mask, dtype: tl.constexpr):
    """The columns ``cols`` of a row (``x``, float32) normalized by its :func:`inverse_rms` and
    weighted, at :func:`normalized_row`'s rounding points (for a kernel holding only some columns)."""
    normed = (x * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (normed * w).to(dtype)


@triton.jit
def _store_normalized(out_row_ptr, x, w_ptr, cols, mask, n, eps):
    """:func:`normalized_row` of one float32 row into ``out_row_ptr``, in its dtype."""
    y = normalized_row(x, w_ptr, cols, mask, n, eps, out_row_ptr.dtype.element_ty)
    tl.store(out_row_ptr + cols, y, mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, x_stride, out_stride, n, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    _store_normalized(out_ptr + row * out_stride, x, w_ptr, cols, mask, n, eps)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, x_stride, r_stride, n, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * r_stride + cols, summed, mask=mask)
    _store_normalized(x_ptr + row * x_stride, summed.to(tl.float32), w_ptr, cols, mask, n, eps)


@triton.jit
def load_cos_sin(pos_ptr, cos_ptr, sin_ptr, token, d, HALF: tl.constexpr, dtype: tl.constexpr):
    """The token's cos/sin rows, rounded to the activation dtype first as the torch fallback does."""
    pos = tl.load(pos_ptr + token)
    d_mask = d < HALF
    c = tl.load(cos_ptr + pos * HALF + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    return c, s


@triton.jit
def _rotate_heads(
    row_ptr, num_heads, c, s, d, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEADS_P2: tl.constexpr
):
    """Rotate the first ``num_heads`` heads of one row in place (NeoX halves); returns the halves."""
    heads = tl.arange(0, HEADS_P2)
    mask = (heads[:, None] < num_heads) & (d < HALF)[None, :]
    base = row_ptr + heads[:, None] * HEAD_DIM + d[None, :]
    dtype = row_ptr.dtype.element_ty
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * c[None, :] - x2 * s[None, :]).to(dtype)
    r2 = (x2 * c[None, :] + x1 * s[None, :]).to(dtype)
    tl.store(base, r1, mask=mask)
    tl.store(base + HALF, r2, mask=mask)
    return r1, r2


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
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0)
    d = tl.arange(0, HALF_P2)
    c, s = load_cos_sin(pos_ptr, cos_ptr, sin_ptr, token, d, HALF, x_ptr.dtype.element_ty)
    _rotate_heads(x_ptr + token * x_stride, num_heads, c, s, d, HEAD_DIM, HALF, HEADS_P2)


@triton.jit
def _qk_norm_rotary_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_w_ptr,
    k_w_ptr,
    slot_ptr,
    key_cache_ptr,
    value_cache_ptr,
    qkv_stride,
    num_heads,
    num_kv_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token's q heads (program axis 1 = 0) or k heads (= 1): per-head RMSNorm with the
    q / k weight, then the NeoX rotary embedding, in place in the qkv row; with ``WRITE_CACHE``
    the k program also writes the token's keys and values to its cache slot (negative: none)."""
    pdl_prologue(USE_PDL)
    token = tl.program_id(0)
    is_k = tl.program_id(1)
    heads_here = tl.where(is_k == 1, num_kv_heads, num_heads)
    row_ptr = qkv_ptr + token * qkv_stride + is_k * num_heads * HEAD_DIM
    w_ptr = tl.where(is_k == 1, k_w_ptr, q_w_ptr)
    d = tl.arange(0, HALF_P2)
    dtype = qkv_ptr.dtype.element_ty
    c, s = load_cos_sin(pos_ptr, cos_ptr, sin_ptr, token, d, HALF, dtype)
    heads = tl.arange(0, HEADS_P2)
    d_mask = d < HALF
    mask = (heads[:, None] < heads_here) & d_mask[None, :]
    base = row_ptr + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
    w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    # rounding points of the torch fallback: normalized → dtype, times the weight → dtype
    n1 = ((x1 * inv[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
    n2 = ((x2 * inv[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    r1 = (n1 * c[None, :] - n2 * s[None, :]).to(dtype)
    r2 = (n2 * c[None, :] + n1 * s[None, :]).to(dtype)
    tl.store(base, r1, mask=mask)
    tl.store(base + HALF, r2, mask=mask)
    if WRITE_CACHE:
        if is_k == 1:
            slot = tl.load(slot_ptr + token)
            if slot >= 0:  # (the values follow the keys in the row)
                _store_kv_slot(
                    key_cache_ptr, value_cache_ptr, row_ptr + num_kv_heads * HEAD_DIM, slot, heads,
                    num_kv_heads, r1, r2, d, mask, HEAD_DIM, HALF, DIM_P2,
                )  # fmt: skip


@triton.jit
def silu_mul_cols(gu_ptr, row, gu_stride, n, cols, mask):
    """``silu(gate) * up`` in float32 of the columns ``cols`` of row ``row`` of ``gu = [gate | up]``
    (``n`` columns each), ``silu(gate)`` rounded to the row's dtype first, as the unfused torch
    path rounds it (callers round the product)."""
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(gu_ptr.dtype.element_ty).to(tl.float32) * u


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr, out_ptr, gu_stride, out_stride, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    val = silu_mul_cols(gu_ptr, row, gu_stride, n, cols, mask)
    tl.store(out_ptr + row * out_stride + cols, val.to(out_ptr.dtype.element_ty), mask=mask)


def _row_block(n: int) -> int:
    return triton.next_power_of_2(n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` of a 2-D ``x`` (unit stride in the last dimension)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        n = x.shape[1]
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.stride(0), out.stride(0), n, eps, BLOCK=_row_block(n), **pdl_kwargs(x)
        )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x; x = rms_norm(residual)`` in place; returns ``(x, residual)``."""
    if x.shape[0]:
        n = x.shape[1]
        _fused_add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, x.stride(0), residual.stride(0), n, eps, BLOCK=_row_block(n), **pdl_kwargs(x)
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
        **pdl_kwargs(x),
    )


def qk_norm_rotary_(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Per-head RMSNorm of the q and k heads of each ``qkv`` row, then their rotary embedding
    (NeoX layout), in place: one launch where the torch fallback takes ~20. With ``cache`` =
    (key cache, value cache, slot mapping), NHD caches of ``qkv``'s dtype, the same launch writes
    each token's keys and values to its slot (negative: skipped), as the cache-write op would."""
    if qkv.shape[0] == 0:
        return
    half = head_dim // 2
    key_cache, value_cache, slots = cache if cache is not None else (qkv, qkv, positions)
    _qk_norm_rotary_kernel[(qkv.shape[0], 2)](
        qkv,
        positions,
        cos,
        sin,
        q_weight,
        k_weight,
        slots,
        key_cache,
        value_cache,
        qkv.stride(0),
        num_heads,
        num_kv_heads,
        eps,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        HEADS_P2=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        DIM_P2=triton.next_power_of_2(head_dim),
        WRITE_CACHE=cache is not None,
        **pdl_kwargs(qkv),
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` of a 2-D tensor."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, **pdl_kwargs(gate_up)
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
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0)
    d = tl.arange(0, HALF_P2)
    c, s = load_cos_sin(pos_ptr, cos_ptr, sin_ptr, token, d, HALF, q_ptr.dtype.element_ty)
    _rotate_heads(q_ptr + token * row_stride, num_q_heads, c, s, d, HEAD_DIM, HALF, QH_P2)
    # keys: rotated in place and, with the values, written to the token's cache slot
    r1, r2 = _rotate_heads(k_ptr + token * row_stride, num_kv_heads, c, s, d, HEAD_DIM, HALF, KH_P2)
    kh = tl.arange(0, KH_P2)
    k_mask = (kh[:, None] < num_kv_heads) & (d < HALF)[None, :]
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        _store_kv_slot(
            key_cache_ptr, value_cache_ptr, v_ptr + token * row_stride, slot, kh, num_kv_heads, r1, r2, d,
            k_mask, HEAD_DIM, HALF, DIM_P2,
        )  # fmt: skip


@triton.jit
def _store_kv_slot(
    key_cache_ptr, value_cache_ptr, v_row_ptr, slot, heads, num_kv_heads, r1, r2, d, k_mask,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, DIM_P2: tl.constexpr,
):  # fmt: skip
    """One token's keys (rotated halves ``r1``, ``r2`` of each head) and values (its heads at
    ``v_row_ptr``) into cache slot ``slot`` of the NHD caches."""
    row = slot * num_kv_heads * HEAD_DIM + heads[:, None] * HEAD_DIM
    tl.store(key_cache_ptr + row + d[None, :], r1, mask=k_mask)
    tl.store(key_cache_ptr + row + HALF + d[None, :], r2, mask=k_mask)
    full = tl.arange(0, DIM_P2)
    v_mask = (heads[:, None] < num_kv_heads) & (full[None, :] < HEAD_DIM)
    v = tl.load(v_row_ptr + heads[:, None] * HEAD_DIM + full[None, :], mask=v_mask, other=0.0)
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
        **pdl_kwargs(q),
    )
