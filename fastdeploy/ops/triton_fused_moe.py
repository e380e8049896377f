"""Fused mixture-of-experts on a GPU: a route-sorted grouped GEMM in Triton, bf16/fp16 or FP8 w8a8.

The T*k (token, slot) pairs of a batch are sorted by expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (:func:`fastdeploy.ops.triton_moe_routing.moe_align_block_size`, one or three
kernels), so that every ``BLOCK_M`` block of the sorted
list belongs to one expert. Then:

1. ``gate_up[pair] = hidden[token] @ w13[e].T`` (:func:`fastdeploy.ops.triton_moe_gemm.grouped_gemm`, ``[T*k, 2I]``),
2. ``act = silu(gate) * up`` (:func:`fastdeploy.ops.layer_ops.silu_and_mul`, ``[T*k, I]``; FP8:
   quantized in the same kernel, :mod:`fastdeploy.ops.triton_moe_act`),
3. ``out[pair] = weight[pair] * act[pair] @ w2[e].T`` (the same GEMM, ``[T*k, H]``),
4. ``out[token] = sum over its k slots`` (float32 accumulation, :func:`~fastdeploy.ops.triton_moe_act.sum_pairs`).

Each program computes a ``BLOCK_M x BLOCK_N`` tile of one expert's rows; the blocks past the
padded end (the grid is sized from shapes only, so nothing syncs the host) exit at once. A
tile's weight columns are read once for all its rows, so at decode sizes the kernel is a pass
over the touched experts' weights and at prefill sizes a tensor-core GEMM per expert.

FP8 (``w13``/``w2`` in ``float8_e4m3fn``), two scale layouts:

* block-scaled (``block_shape = (bn, bk)``, default 128 x 128): weights carry
  ``[E, ceil(N/bn), ceil(K/bk)]`` scales (``weight_scale_inv``), the activations are quantized
  per token and ``bk`` columns (dynamic 1 x 128 scales, :mod:`fastdeploy.ops.fp8_quant`) before
  each GEMM; each ``BLOCK_K`` step's fp8 dot is scaled by its row and column scales into a
  float32 accumulator, so ``BLOCK_K`` must divide ``bk``.
* per channel (``block_shape = None``, ``--quantization ptpc_fp8``): weights carry ``[E, N]``
  scales, the activations one dynamic scale per token. The K loop is then plain fp8 dots into
  one accumulator (pipelined tensor-core MMAs, as in a bf16 GEMM) and both scales multiply the
  tile once, after it: at prefill sizes the block-scaled loop's per-step rescale is what keeps
  its FP8 GEMM below bf16's rate.

Meta-parameters come from a small table keyed on the token count (:func:`default_config`:
latency configurations for decode batches, throughput ones for prefill); any call can pass its
own :class:`MoEKernelConfig` (tuning, benchmarks).
"""

from __future__ import annotations

import torch
import triton

from fastdeploy import envs
from fastdeploy.ops.fp8_grouped_mm import grouped_mm_applies, grouped_mm_experts
from fastdeploy.ops.fp8_quant import (
    FP8_DTYPE,
    quantize_activation_per_token,
    quantize_activation_per_token_group,
)
from fastdeploy.ops.layer_ops import silu_and_mul
from fastdeploy.ops.tile_config import TileConfig, device_shared_memory, fit_shared_memory, table_config
from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_moe_act import silu_and_mul_pairs, silu_mul_fp8, sum_pairs
from fastdeploy.ops.triton_moe_align_atomic import PairRanks, new_pair_ranks
from fastdeploy.ops.triton_moe_gemm import grouped_gemm, persistent_programs
from fastdeploy.ops.triton_moe_gemv import fused_experts_gemv, small_batch_max_tokens
from fastdeploy.ops.triton_moe_routing import ALIGN_SINGLE_MAX, moe_align_block_size, padded_length

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Activation dtypes the kernels take (weights in the same dtype, or FP8)."""


MoEKernelConfig = TileConfig
"""Triton meta-parameters of one grouped GEMM launch; ``block_m`` is also the padding unit of
each expert's rows."""


# (most tokens, config). Decode sizes (few rows per expert): 16-row tiles, many column blocks so
# that the touched experts' weights stream through enough programs; prefill sizes: bigger tiles
# for tensor-core throughput. Starting points in line with published H100/H200 tunings of these
# shapes; docs/benchmarks.md has what was measured.
BF16_CONFIGS: tuple[tuple[int, MoEKernelConfig], ...] = (
    (32, MoEKernelConfig(16, 64, 128, 1, 4, 4)),
    (128, MoEKernelConfig(16, 128, 128, 1, 4, 3)),
    (512, MoEKernelConfig(64, 128, 64, 8, 4, 3)),
    (1 << 62, MoEKernelConfig(128, 256, 64, 16, 8, 4)),
)
FP8_CONFIGS: tuple[tuple[int, MoEKernelConfig], ...] = (
    (128, MoEKernelConfig(16, 128, 128, 1, 4, 4)),
    (1 << 62, MoEKernelConfig(64, 128, 128, 16, 4, 4)),
)
FP8_CHANNEL_CONFIGS: tuple[tuple[int, MoEKernelConfig], ...] = (
    (128, MoEKernelConfig(16, 128, 128, 1, 4, 4)),
    (512, MoEKernelConfig(64, 128, 128, 16, 4, 3)),  # H200 sweeps (23rd, 24th sessions): 1.7% faster at 256
    (1 << 62, MoEKernelConfig(128, 256, 128, 16, 8, 4)),  # H200 sweep: 4 stages 4% faster at 2,048
)
INTERPRETER_CONFIG = MoEKernelConfig(16, 64, 64, 1, 4, 1)
"""The configuration under ``TRITON_INTERPRET=1`` (CPU tests): small tiles, quick."""


def default_config(num_tokens: int, fp8: bool, per_channel: bool = False) -> MoEKernelConfig:
    """The table's configuration for a batch of ``num_tokens`` tokens (``per_channel``: FP8 with
    per-channel scales; the interpreter's under ``TRITON_INTERPRET=1``)."""
    if triton_interpreting():
        return INTERPRETER_CONFIG
    if fp8:
        return table_config(FP8_CHANNEL_CONFIGS if per_channel else FP8_CONFIGS, num_tokens)
    return table_config(BF16_CONFIGS, num_tokens)


def align_block_size_torch(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`fastdeploy.ops.triton_moe_routing.moe_align_block_size` (the
    layout the kernels read; the tests' oracle): the ``P = T*k`` (token, slot) pairs of
    ``topk_ids [T, k]`` sorted stably by expert, each expert's run padded to a multiple of
    ``block_m``.

    Returns ``(sorted_ids [L] int32, expert_ids [L / block_m] int32, num_padded [1] int32)``:
    ``sorted_ids`` holds pair indices ``token * k + slot``, the value ``P`` marking padding (here
    also past ``num_padded``); block ``b`` belongs to expert ``expert_ids[b]``; ``num_padded`` is
    the padded length actually used; ``L = padded_length(P, block_m, num_experts)``.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    keep = torch.nonzero(flat >= 0).squeeze(1)  # negative ids: experts another rank holds
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat[keep], torch.ones_like(keep))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    count_start = torch.cumsum(counts, 0) - counts
    order = keep[torch.argsort(flat[keep], stable=True)]
    expert_of = flat[order]
    rank = torch.arange(len(order), device=device) - count_start[expert_of]
    dest = padded_end[expert_of] - padded[expert_of] + rank
    length = padded_length(pairs, block_m, num_experts)
    sorted_ids = torch.full((length,), pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(0, length, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


def _check(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block_shape: tuple[int, int] | None,
    configs: tuple[MoEKernelConfig, ...],
) -> None:
    if hidden.dim() != 2 or hidden.dtype not in DTYPES:
        raise ValueError(f"hidden must be 2-D in one of {DTYPES}, got {tuple(hidden.shape)} {hidden.dtype}")
    e, two_i, h = w13.shape
    if w2.shape != (e, h, two_i // 2) or two_i % 2 or hidden.shape[1] != h:
        raise ValueError(
            f"expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights must both be [T, k]")
    fp8 = w13.dtype == FP8_DTYPE
    if fp8:
        if w2.dtype != FP8_DTYPE or w13_scale is None or w2_scale is None:
            raise ValueError("FP8 experts need both weights in float8_e4m3fn and both scales")
        for name, w, s in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
            if block_shape is None:  # per output channel
                want = (e, w.shape[1])
            else:
                want = (e, triton.cdiv(w.shape[1], block_shape[0]), triton.cdiv(w.shape[2], block_shape[1]))
            if s.shape != want or s.dtype != torch.float32 or s.stride(-1) != 1:
                raise ValueError(
                    f"{name}_scale must be float32 {want} with unit last stride, got {s.dtype} {tuple(s.shape)}"
                )
        for config in configs:
            if block_shape is not None and block_shape[1] % config.block_k:
                raise ValueError(
                    f"block_k ({config.block_k}) must divide the scale block's columns ({block_shape[1]})"
                )
    elif w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(
            f"weights ({w13.dtype}, {w2.dtype}) must be FP8 or share hidden's dtype {hidden.dtype}"
        )
    for name, t in (("w13", w13), ("w2", w2), ("hidden", hidden)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, got {t.stride()}")


def _quantize_activation(
    x: torch.Tensor, block_shape: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 ``x`` and its dynamic scales: per token and ``bk`` columns for block-scaled weights,
    per token (``[M, 1]``) for per-channel ones."""
    if block_shape is None:
        return quantize_activation_per_token(x)
    return quantize_activation_per_token_group(x, block_shape[1])


def quantizes_per_token(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, block_shape: tuple[int, int] | None
) -> bool:
    """Whether :func:`fused_experts` (the tables' configuration) quantizes ``hidden`` per token for
    its grouped GEMM: per-channel FP8 experts on a step that neither the GEMV path nor torch's
    grouped mm takes. A caller that has those FP8 rows already (the norm before the experts,
    :func:`~fastdeploy.ops.triton_fp8_quant.add_rms_norm_quant`) passes them as ``a_quantized``."""
    return (
        w13.dtype == FP8_DTYPE
        and block_shape is None
        and hidden.shape[0] > small_batch_max_tokens()
        and not grouped_mm_applies(hidden, w13, w2, block_shape)
    )


def router_takes_ranks(pairs: int) -> bool:
    """Whether the routing kernel ranks a step's ``pairs`` (token, expert) pairs for the expert sort:
    ``FD_MOE_RANKS_IN_ROUTER`` and more pairs than the one-program sort takes (it ranks none)."""
    return envs.FD_MOE_RANKS_IN_ROUTER and pairs > ALIGN_SINGLE_MAX


def pair_ranks_for(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, block_shape: tuple[int, int] | None, top_k: int
) -> PairRanks | None:
    """With ``FD_MOE_RANKS_IN_ROUTER``: buffers for the routing kernel to rank the pairs by expert
    (:func:`~fastdeploy.ops.triton_moe_routing.topk_softmax`'s ``ranked``) where :func:`fused_experts`
    (the tables' configuration, no expert parallelism) sorts them by atomic counters; else None."""
    tokens = hidden.shape[0]
    if (
        not router_takes_ranks(tokens * top_k)
        or tokens <= small_batch_max_tokens()
        or grouped_mm_applies(hidden, w13, w2, block_shape)
    ):
        return None
    return new_pair_ranks(tokens * top_k, w13.shape[0], hidden.device)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = (128, 128),
    config: MoEKernelConfig | None = None,
    skip_negative_ids: bool = False,
    down_config: MoEKernelConfig | None = None,
    a_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ranked: PairRanks | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, j]``.

    ``skip_negative_ids`` (expert parallelism): an id below 0 marks an expert another rank holds;
    its pair adds nothing and reads no weights.

    ``hidden [T, H]``; ``w13 [E, 2I, H]`` (each expert's ``[gate | up]``) and ``w2 [E, H, I]`` in
    ``hidden.dtype``, or both in ``float8_e4m3fn`` with ``w13_scale [E, ceil(2I/bn), ceil(H/bk)]``
    and ``w2_scale [E, ceil(H/bn), ceil(I/bk)]`` float32 block scales (``block_shape = (bn, bk)``),
    in which case the activations are quantized per token and ``bk`` columns, or with
    ``block_shape = None`` per-channel scales ``w13_scale [E, 2I]`` and ``w2_scale [E, H]`` and
    activations quantized per token. Returns ``[T, H]``
    in ``hidden.dtype``; float32 accumulation, intermediates rounded to ``hidden.dtype`` as the
    unfused torch path rounds them. ``config`` overrides the table's meta-parameters (of both GEMMs;
    ``down_config``, with the same ``block_m``, of the down GEMM alone). ``a_quantized``: ``hidden``
    already quantized per token (``(fp8 [T, H], scale [T, 1])``), only where
    :func:`quantizes_per_token` holds (ValueError elsewhere). ``ranked``: the pairs' ranks the
    routing kernel took (:func:`pair_ranks_for`), for the expert sort.

    Up to :func:`~fastdeploy.ops.triton_moe_gemv.small_batch_max_tokens` tokens (and with no
    ``config``) the two GEMV-like kernels of :mod:`fastdeploy.ops.triton_moe_gemv` run instead
    (FP8 weights against unquantized activations there); per-channel FP8 steps of at least
    ``FD_MOE_GROUPED_MM_MIN_TOKENS`` tokens on Hopper take :mod:`fastdeploy.ops.fp8_grouped_mm`.
    """
    explicit_config = config
    if config is None:
        config = default_config(hidden.shape[0], w13.dtype == FP8_DTYPE, block_shape is None)
        if hidden.is_cuda and w13.dtype != FP8_DTYPE:  # (float32 activations: twice the tiles' bytes)
            limit = device_shared_memory(hidden.device.index)
            config = fit_shared_memory(config, hidden.element_size(), limit)
    down_config = down_config or config
    if down_config.block_m != config.block_m:
        raise ValueError(
            f"down_config.block_m ({down_config.block_m}) must equal config's ({config.block_m})"
        )
    _check(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape, (config, down_config))
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return hidden.new_zeros(hidden.shape)
    fp8 = w13.dtype == FP8_DTYPE
    grouped_per_token = fp8 and block_shape is None and explicit_config is not None
    if a_quantized is not None and not (
        grouped_per_token or quantizes_per_token(hidden, w13, w2, block_shape)
    ):
        raise ValueError("a_quantized is for the per-channel FP8 grouped GEMM's steps (quantizes_per_token)")
    if explicit_config is None and num_tokens <= small_batch_max_tokens():
        return fused_experts_gemv(
            hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape,
            skip_negative_ids=skip_negative_ids,
        )  # fmt: skip
    if explicit_config is None and not skip_negative_ids and grouped_mm_applies(hidden, w13, w2, block_shape):
        return grouped_mm_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    routing = moe_align_block_size(topk_ids, config.block_m, w13.shape[0], ranked)
    pairs = num_tokens * top_k
    if a_quantized is not None:
        a, a_scale = a_quantized
    else:
        a, a_scale = _quantize_activation(hidden, block_shape) if fp8 else (hidden, None)
    gate_up = torch.empty((pairs, w13.shape[1]), dtype=hidden.dtype, device=hidden.device)
    element_bytes = w13.element_size()
    grouped_gemm(
        a, a_scale, w13, w13_scale, gate_up, routing, None, top_k, block_shape, config,
        persistent_programs(num_tokens, hidden.device, config, element_bytes),
    )  # fmt: skip
    # skipped pairs (another rank's experts: about (n-1)/n of them when the tokens of n
    # data-parallel ranks are gathered) get no activation and are left out of the sum
    ids = topk_ids.reshape(-1).contiguous() if skip_negative_ids else None
    if fp8:
        a, a_scale = silu_mul_fp8(gate_up, block_shape, ids)
    else:
        a, a_scale = (silu_and_mul_pairs(gate_up, ids) if skip_negative_ids else silu_and_mul(gate_up)), None
    out = torch.empty((pairs, w2.shape[1]), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    grouped_gemm(
        a, a_scale, w2, w2_scale, out, routing, weights, 1, block_shape, down_config,
        persistent_programs(num_tokens, hidden.device, down_config, element_bytes),
    )  # fmt: skip
    if skip_negative_ids or envs.FD_MOE_TRITON_SUM:
        return sum_pairs(out, ids, top_k)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
