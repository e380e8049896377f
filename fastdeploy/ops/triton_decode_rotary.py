"""The decode attention kernel's prologue: q / k RMSNorm, rotary embedding and the cache write.

A decode step of a Qwen3-style layer ran a kernel between qkv_proj and attention that
normalized each q and k head, rotated them (NeoX halves) and wrote the keys and values to the
paged cache; at batch 1 it was a launch and a chain of dependent loads for a few KB. Given a
:class:`QKRotary`, :func:`fastdeploy.ops.triton_attention.decode_attention` does that work in
its own programs instead: each program normalizes and rotates its query heads as it loads them
(:func:`normed_rotated`), and the program of the split that attends the token's own key first
writes that key and value to the token's slot (:func:`write_new_kv`), then synchronizes its
threads so that its key tiles read them back. The rounding points are those of the separate
kernel (``triton_layer_ops._qk_norm_rotary_kernel``) and of the torch fallback: normalized →
dtype, times the weight → dtype, rotated in float32 → dtype; cos / sin rounded to the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.ops.qk_rotary import QKRotary


def rotary_kernel_args(
    rotary: QKRotary | None, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, q: torch.Tensor
) -> tuple[list, dict[str, bool]]:
    """The decode kernel's prologue arguments and constexprs; ``new_kv`` = (this step's raw keys,
    values ``[T, kv_heads, head_dim]``, slot mapping ``[T]``). Without ``rotary``, placeholders."""
    if rotary is None:
        return [q, q, q, q, q, q, q, q, 0.0, 0, 0], dict(ROTARY=False, QK_NORM=False)
    if new_kv is None:
        raise ValueError("rotary in the decode kernel needs this step's keys, values and slot mapping")
    keys, values, slots = new_kv
    head_dim = q.shape[-1]
    if not rotary.usable_with(q.dtype, head_dim):
        raise ValueError(
            "rotary needs float32 contiguous cos / sin of head_dim / 2 and both norm weights or none"
        )
    for name, t in (("keys", keys), ("values", values)):
        if t.dtype != q.dtype or t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(
                f"rotary's {name} must be [T, kv_heads, head_dim] of the query dtype, heads contiguous"
            )
    norm = rotary.q_norm_weight is not None
    weights = [rotary.q_norm_weight, rotary.k_norm_weight] if norm else [q, q]
    args = [keys, values, slots, rotary.positions, rotary.cos, rotary.sin, *weights, float(rotary.eps)]
    return [*args, keys.stride(0), values.stride(0)], dict(ROTARY=True, QK_NORM=norm)


@triton.jit
def rotary_cos_sin(pos_ptr, cos_ptr, sin_ptr, token, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """The token's cos / sin over the whole head (column ``d`` takes ``d mod HEAD_DIM / 2``), rounded
    to the activation dtype first as the torch fallback does."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, HEAD_DIM) % HALF
    c = tl.load(cos_ptr + pos * HALF + d).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + d).to(dtype).to(tl.float32)
    return c, s


@triton.jit
def normed_rotated(rows_ptr, row_ok, w_ptr, c, s, eps, QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Heads ``rows_ptr [R, 1] + d`` (rows ``row_ok``; others zero) with ``QK_NORM`` RMS-normalized
    times ``w``, then rotated (NeoX: the first half takes ``x c - x' s``, the second ``x c + x' s``,
    ``x'`` the other half's column), in their dtype ``[R, HEAD_DIM]``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = rows_ptr.dtype.element_ty
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HALF) % HEAD_DIM
    mask = row_ok[:, None]
    x = tl.load(rows_ptr + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(rows_ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + d).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner).to(tl.float32)[None, :]
        x = ((x * inv).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        xp = ((xp * inv).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    c = c[None, :]
    s = s[None, :]
    return tl.where((d < HALF)[None, :], x * c - xp * s, x * c + xp * s).to(dtype)


@triton.jit
def write_new_kv(
    k_row_ptr, v_row_ptr, k_cache_ptr, v_cache_ptr, slot, key_pos, start, end, kv_head, k_w_ptr, c, s, eps,
    block_size,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """When the token's own key (position ``key_pos``) lies in this program's keys ``start:end`` and
    ``slot >= 0``: its key head at ``k_row_ptr`` (normalized, rotated) and its value head into cache
    slot ``slot``; then a barrier of the program's threads, after which they read the slot back with
    the other keys."""
    one = tl.arange(0, 1)
    key = normed_rotated(k_row_ptr + one[:, None], one == 0, k_w_ptr, c, s, eps, QK_NORM, HEAD_DIM)
    d = tl.arange(0, HEAD_DIM)[None, :]
    value = tl.load(v_row_ptr + one[:, None] + d)
    slot = slot.to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    at = one + key_pos  # (tensors: the interpreter refuses masks made with scalar conditions)
    store = ((at >= start) & (at < end) & (one + slot >= 0))[:, None] & (d < HEAD_DIM)
    tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + kv_head * stride_kh + d, key, mask=store)
    tl.store(
        v_cache_ptr + block * stride_vb + offset * stride_vs + kv_head * stride_vh + d, value, mask=store
    )
    tl.debug_barrier()
