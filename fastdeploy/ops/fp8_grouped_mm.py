"""Per-channel FP8 MoE experts on ``torch._scaled_grouped_mm`` (CUTLASS grouped GEMM, Hopper): an
alternative to the Triton grouped GEMM for large steps (``FD_MOE_GROUPED_MM_MIN_TOKENS``).

At prefill sizes the Triton FP8 grouped GEMM reaches ~364 TFLOP/s on an H200 against 423 in bf16
(docs/benchmarks.md, tenth session): its gathered activation rows keep it from Hopper's bulk copies.
Here the (token, slot) pairs are sorted by expert once, their FP8 activation rows gathered into
one contiguous matrix, and each of the two GEMMs is one grouped GEMM over the experts' row ranges
with per-row activation and per-column weight scales (``--quantization ptpc_fp8``'s layout):

    gate_up = grouped_mm(x_fp8[rows], w13)      silu-and-multiply, quantized per pair
    down    = grouped_mm(act_fp8, w2)           times the routing weights, back in pair order, summed

Only per-channel FP8 weights, all experts on this rank, on a GPU of compute capability 9.0 or 10.0.
"""

from __future__ import annotations

import torch

from fastdeploy import envs
from fastdeploy.ops.fp8_quant import FP8_DTYPE, quantize_activation_per_token
from fastdeploy.ops.triton_moe_act import silu_mul_fp8

_ALIGN = 16
"""``torch._scaled_grouped_mm`` wants every GEMM dimension but the grouped one a multiple of 16."""


def grouped_mm_applies(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, block_shape: tuple[int, int] | None
) -> bool:
    """Whether a step of ``hidden``'s tokens takes :func:`grouped_mm_experts`: at least
    ``FD_MOE_GROUPED_MM_MIN_TOKENS`` tokens (0: never), per-channel FP8 weights whose dimensions
    are multiples of 16, on a GPU with the grouped FP8 GEMM (sm_90 / sm_100)."""
    least = envs.FD_MOE_GROUPED_MM_MIN_TOKENS
    if least <= 0 or hidden.shape[0] < least or not hidden.is_cuda or block_shape is not None:
        return False
    if w13.dtype != FP8_DTYPE or hidden.dtype != torch.bfloat16 or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if any(d % _ALIGN for d in (w13.shape[1], w13.shape[2], w2.shape[1], w2.shape[2])):
        return False
    return torch.cuda.get_device_capability(hidden.device)[0] in (9, 10)


def grouped_mm_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
) -> torch.Tensor:
    """What :func:`fastdeploy.ops.triton_fused_moe.fused_experts` computes for per-channel FP8
    weights (``w13 [E, 2I, H]``, ``w2 [E, H, I]`` float8_e4m3fn, ``w13_scale [E, 2I]``, ``w2_scale
    [E, H]``) with two grouped GEMMs; ``hidden [T, H]`` bfloat16 → ``[T, H]``."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # the pairs grouped by expert, in pair order within one
    ends = torch.cumsum(torch.bincount(flat_ids, minlength=num_experts), 0).to(torch.int32)
    rows = order // top_k  # each sorted pair's token
    x_fp8, x_scale = quantize_activation_per_token(hidden)
    a = x_fp8.view(torch.uint8).index_select(0, rows).view(FP8_DTYPE)
    a_scale = x_scale.reshape(-1).index_select(0, rows)
    gate_up = torch._scaled_grouped_mm(
        a, w13.transpose(1, 2), a_scale, w13_scale.float(), ends, out_dtype=hidden.dtype, use_fast_accum=True
    )
    act, act_scale = silu_mul_fp8(gate_up, None)
    down = torch._scaled_grouped_mm(
        act,
        w2.transpose(1, 2),
        act_scale.reshape(-1),
        w2_scale.float(),
        ends,
        out_dtype=hidden.dtype,
        use_fast_accum=True,
    )
    down.mul_(topk_weights.reshape(-1).index_select(0, order).to(down.dtype)[:, None])
    pairs = torch.empty_like(down).index_copy_(0, order, down)  # back in (token, slot) order
    return pairs.view(num_tokens, top_k, -1).sum(dim=1)
