"""FP8 (e4m3) quantization helpers: weights per output channel or in 2-D blocks, activations per
token or per 1 x ``group`` slice of a token, as the FP8 GEMMs and the FP8 fused-MoE kernel take them.

Every scale is a float32 *dequantization* factor: ``real ≈ fp8.float() * scale`` (the layout of
the ``weight_scale_inv`` tensors of DeepSeek / Qwen3-FP8 checkpoints). A scale is the slice's
absolute maximum over :data:`FP8_MAX`, with the maximum clamped to at least :data:`MIN_AMAX`, so
an all-zero or tiny slice gets a finite, non-zero scale; values are divided in float32 and
clamped to ``±FP8_MAX`` before the cast (an out-of-range cast to e4m3fn gives NaN), so huge
inputs saturate instead of overflowing. No result is ever NaN or Inf for finite inputs.

Plain torch: runs on a CPU and on CUDA (the weight helpers run once, at load time).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
"""The FP8 format of weights and activations (4 exponent bits, 3 mantissa bits, no infinities)."""
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""Largest finite e4m3fn magnitude (448)."""
MIN_AMAX = 1e-12
"""Smallest absolute maximum a scale is computed from: keeps zero / tiny slices' scales non-zero."""
DEFAULT_BLOCK = (128, 128)
"""Weight block ``(rows, columns)`` of the block-scaled checkpoints (DeepSeek-V3, Qwen3-FP8)."""


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """float32 dequantization scales of slices whose absolute maxima are ``amax``."""
    return amax.float().clamp(min=MIN_AMAX) / FP8_MAX


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` (broadcast) in float32, saturated to ``±FP8_MAX`` and cast to e4m3."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _triton_quant():
    """The Triton activation quantization (one kernel, identical bits) for CUDA tensors, or None
    (no triton, or ``FD_DISABLE_CUSTOM_OPS=1``)."""
    from fastdeploy import envs
    from fastdeploy.ops.layer_ops import triton_module

    return None if envs.FD_DISABLE_CUSTOM_OPS else triton_module("triton_fp8_quant")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., N, K]`` with one scale per output row.

    Returns ``(w_fp8 [..., N, K] float8_e4m3fn, scale [..., N] float32)`` with
    ``w ≈ w_fp8.float() * scale[..., None]``.
    """
    scale = _scale_of(w.abs().amax(dim=-1))
    return _to_fp8(w, scale.unsqueeze(-1)), scale


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """``x [..., N, K]`` zero-padded to whole blocks and viewed as ``[..., nb, bn, kb, bk]``."""
    bn, bk = block
    n, k = x.shape[-2:]
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = torch.nn.functional.pad(x, (0, kb * bk - k, 0, nb * bn - n))
    return padded.reshape(*x.shape[:-2], nb, bn, kb, bk), n, k


def quantize_weight_block(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., N, K]`` with one scale per ``block = (bn, bk)`` tile.

    Returns ``(w_fp8 [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/bn), ceil(K/bk)] float32)``
    with ``w[n, k] ≈ w_fp8[n, k].float() * scale_inv[n // bn, k // bk]`` (the checkpoints'
    ``weight_scale_inv`` layout; a partial edge block has its own scale). Leading dimensions
    (stacked experts ``[E, N, K]``) are quantized independently.
    """
    if w.dim() < 2:
        raise ValueError(f"w must be at least 2-D [..., N, K], got shape {tuple(w.shape)}")
    tiles, n, k = _blocks(w.float(), block)
    scale_inv = _scale_of(tiles.abs().amax(dim=(-3, -1)))  # [..., nb, kb]
    q = _to_fp8(tiles, scale_inv.unsqueeze(-1).unsqueeze(-3))
    q = q.reshape(*w.shape[:-2], tiles.shape[-4] * block[0], tiles.shape[-2] * block[1])
    return q[..., :n, :k].contiguous(), scale_inv


def dequantize_weight_block(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The real weight ``[..., N, K]`` (in ``dtype``) of a block-quantized ``w_fp8 [..., N, K]``
    with ``scale_inv [..., ceil(N/bn), ceil(K/bk)]``: the inverse of :func:`quantize_weight_block`."""
    bn, bk = block
    n, k = w_fp8.shape[-2:]
    if scale_inv.shape[-2:] != (_cdiv(n, bn), _cdiv(k, bk)):
        raise ValueError(
            f"scale_inv of a {tuple(w_fp8.shape)} weight in {block} blocks must end in "
            f"({_cdiv(n, bn)}, {_cdiv(k, bk)}), got {tuple(scale_inv.shape)}"
        )
    full = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return (w_fp8.float() * full[..., :n, :k]).to(dtype)


def quantize_activation_per_token_group(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` with one dynamic scale per token and ``group`` consecutive columns.

    Returns ``(x_fp8 [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32)`` with
    ``x[m, k] ≈ x_fp8[m, k].float() * scale[m, k // group]`` (the 1 x 128 activation scales
    that pair with 128 x 128 weight blocks). On CUDA one Triton kernel computes the same bits.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.is_cuda and x.stride(-1) == 1 and (kernels := _triton_quant()) is not None:
        return kernels.quantize_activation_per_token_group(x, group)
    m, k = x.shape
    groups = _cdiv(k, group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = _scale_of(padded.abs().amax(dim=-1))
    q = _to_fp8(padded, scale.unsqueeze(-1)).view(m, groups * group)
    return q[:, :k].contiguous(), scale


def dequantize_activation_per_token_group(
    x_fp8: torch.Tensor, scale: torch.Tensor, group: int = 128
) -> torch.Tensor:
    """float32 ``x [M, K]`` of an ``x_fp8 [M, K]`` with ``scale [M, ceil(K/group)]``: the inverse of
    :func:`quantize_activation_per_token_group`."""
    m, k = x_fp8.shape
    if scale.shape != (m, _cdiv(k, group)):
        raise ValueError(
            f"scale of a {(m, k)} activation in groups of {group} must be "
            f"{(m, _cdiv(k, group))}, got {tuple(scale.shape)}"
        )
    return x_fp8.float() * scale.float().repeat_interleave(group, dim=1)[:, :k]


def quantize_activation_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` with one dynamic scale per token (row).

    Returns ``(x_fp8 [M, K] float8_e4m3fn, scale [M, 1] float32)`` with ``x ≈ x_fp8.float() * scale``
    (``[M, 1]`` is the row-wise ``scale_a`` shape of ``torch._scaled_mm``). On CUDA one Triton
    kernel computes the same bits.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.is_cuda and x.stride(-1) == 1 and (kernels := _triton_quant()) is not None:
        return kernels.quantize_activation_per_token(x)
    scale = _scale_of(x.abs().amax(dim=-1, keepdim=True))
    return _to_fp8(x, scale), scale
