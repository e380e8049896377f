"""Per-token-group FP8 activation quantization in one Triton kernel (the CUDA path of
:func:`fastdeploy.ops.fp8_quant.quantize_activation_per_token_group`).

The torch implementation is about eight kernels (pad, abs, amax, clamp, divide, clamp, cast,
slice); a batch-1 decode step of an FP8 MoE model quantizes two activations per layer, so
those launches add up. Here one program quantizes one ``group``-column slice of one row,
computing exactly what the torch version computes: the same float32 scale
(``max(amax, MIN_AMAX) / FP8_MAX``), a correctly rounded division, saturation to
``±FP8_MAX`` and a round-to-nearest-even cast, so both give identical bits.

Under ``TRITON_INTERPRET=1`` the kernel stores the saturated float32 quotients and torch casts
them: the interpreter's float32 → e4m3 conversion does not round to nearest (the GPU's
``cvt.rn.satfinite`` does), so the CPU tests check everything but that one hardware cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.ops.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_AMAX
from fastdeploy.ops.triton_env import triton_interpreting


@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr, BLOCK: tl.constexpr,
    FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr,
):  # fmt: skip
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
    tl.store(s_ptr + row * stride_sm + group, scale)


def quantize_activation_per_token_group(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32)`` of a 2-D ``x`` with unit
    column stride, bit-identical to the torch version (see the module docstring)."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    interpreting = triton_interpreting()
    q = torch.empty((m, k), dtype=torch.float32 if interpreting else FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    _group_quant_kernel[(m, groups)](
        x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
        GROUP=group, BLOCK=triton.next_power_of_2(group), FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX,
    )  # fmt: skip
    return (q.to(FP8_DTYPE) if interpreting else q), scale
