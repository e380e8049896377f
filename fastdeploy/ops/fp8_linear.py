"""``x @ W^T + b`` for FP8 (e4m3) weights with dynamic activation scales: one entry, three paths.

- **block-scaled** weights (``block = (bn, bk)``, scale ``[ceil(N/bn), ceil(K/bk)]``): the
  activation is quantized per token and ``bk`` columns, then on CUDA the Triton w8a8 block GEMM
  (:mod:`fastdeploy.ops.triton_fp8_gemm`) multiplies the fp8 operands with both scales applied
  per K block.
- **per-channel** weights (``block = None``, scale ``[N]``): the activation is quantized per
  token, then on CUDA ``torch._scaled_mm`` with row-wise scales (cuBLASLt / CUTLASS on Hopper).
- **torch** (a CPU, or a shape the GPU kernels refuse): the same quantized operands dequantized
  to float32 and multiplied there, so that it computes what the GPU kernels compute (the
  activation is rounded to fp8 too) up to the float32 summation order. It is the reference
  the kernels are tested against, and what CI runs.
"""

from __future__ import annotations

import torch

from fastdeploy.ops.fp8_quant import (
    dequantize_activation_per_token_group,
    dequantize_weight_block,
    quantize_activation_per_token,
    quantize_activation_per_token_group,
)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K])^T + bias`` in ``x``'s dtype (see the module docstring)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.is_cuda and x2.shape[0] > 0:
        out = _fp8_linear_cuda(x2, weight, weight_scale, block)
    else:
        out = fp8_linear_torch(x2, weight, weight_scale, block)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def fp8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """The torch path: quantize ``x [M, K]`` as the GPU kernels do, dequantize both operands to
    float32, multiply, and return ``[M, N]`` in ``x``'s dtype."""
    if block is None:
        xq, xs = quantize_activation_per_token(x)
        acc = (xq.float() @ weight.float().t()) * xs * weight_scale.float().view(1, -1)
        return acc.to(x.dtype)
    xq, xs = quantize_activation_per_token_group(x, block[1])
    x_real = dequantize_activation_per_token_group(xq, xs, block[1])
    w_real = dequantize_weight_block(weight, weight_scale, block)
    return (x_real @ w_real.t()).to(x.dtype)


def _fp8_linear_cuda(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """The GPU kernels for ``x [M, K]``; the torch path for shapes they refuse."""
    n, k = weight.shape
    if block is None:
        if k % 16 == 0 and n % 16 == 0:
            xq, xs = quantize_activation_per_token(x)
            return torch._scaled_mm(
                xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype
            )
        return fp8_linear_torch(x, weight, weight_scale, block)
    from fastdeploy.ops.layer_ops import triton_module

    gemm = triton_module("triton_fp8_gemm")
    if gemm is None:
        return fp8_linear_torch(x, weight, weight_scale, block)
    return gemm.fp8_block_linear(x, weight, weight_scale, block)
