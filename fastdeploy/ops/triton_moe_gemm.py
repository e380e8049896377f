"""The fused MoE's grouped GEMM in Triton: one expert's rows of the route-sorted pairs by a tile of
its weight, bf16/fp16/fp32 or FP8 w8a8 (block-scaled or per channel).

``out[pair] = (weight[pair]) * a[pair // a_div] @ w[expert].T`` over the ``BLOCK_M`` blocks of
``sorted_ids`` (:func:`fastdeploy.ops.triton_moe_routing.moe_align_block_size`: each block holds one
expert's pairs, padded). :mod:`fastdeploy.ops.triton_fused_moe` runs it twice per MoE layer
(gate_up, then down with the routing weights).

Two ways to read the operands and walk the tiles, each behind a switch:

* ``FD_MOE_TMA_WEIGHTS``: the weight tiles through a TMA tensor descriptor (``[1, BLOCK_N,
  BLOCK_K]`` boxes of ``[E, N, K]``; zeros past N and K) on Hopper and later; the activation
  rows, gathered by pair, stay pointer loads (Hopper's TMA has no row gather).
* ``FD_MOE_PERSISTENT_MIN_TOKENS``: steps of that many tokens or more run a persistent grid (as
  many programs as the SMs hold at once, each walking tiles ``pid, pid + programs, ...`` up to the padded length read on
  the device) whose tile and K loops are flattened for the software pipeliner, so a tile's loads
  start while the last one's epilogue runs (down's K loop is 6 steps of 128 at K = 768: the
  per-tile pipeline fill is a large share of it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fastdeploy import envs
from fastdeploy.ops.fp8_quant import FP8_DTYPE
from fastdeploy.ops.tile_config import TileConfig, device_shared_memory, shared_memory_bytes
from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_moe_gemv import scale_groups
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue, pdl_trigger


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of ``tile`` in grouped order: GROUP_M row blocks sweep a column block
    before the next one (the weight tile stays in L2 across them)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _gemm_tile(
    pid_m, pid_n, a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
    N, K, num_valid, stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn,
    A_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr, CHANNEL: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_TMA: tl.constexpr,
    TRIGGER: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_M x BLOCK_N`` output tile: its K loop and epilogue (``TRIGGER``: the dependent
    launch may start after the K loop)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    pair_mask = pair < num_valid
    row = (pair // A_DIV).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # clamped columns: the weight loads need no N mask (the tail's duplicates are not stored)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]
    if not B_TMA:
        b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + offs_k[:, None]
    if FP8:
        a_scale_ptrs = a_scale_ptr + row * stride_asm
        b_scale_ptrs = b_scale_ptr + expert * stride_bse + (cols // GROUP_N) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=pair_mask[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
        if B_TMA:
            b = b_ptr.load([expert.to(tl.int32), pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=((k0 + offs_k) < K)[:, None], other=0.0)
        if FP8 and not CHANNEL:
            if DOT_FP32:
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, b)
            a_s = tl.load(a_scale_ptrs + k0 // GROUP_K, mask=pair_mask, other=0.0)
            b_s = tl.load(b_scale_ptrs + k0 // GROUP_K)
            acc += part * a_s[:, None] * b_s[None, :]
        elif DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        if not B_TMA:
            b_ptrs += BLOCK_K
    pdl_trigger(TRIGGER)
    if FP8 and CHANNEL:
        a_s = tl.load(a_scale_ptrs, mask=pair_mask, other=0.0)
        acc = acc * a_s[:, None] * tl.load(b_scale_ptrs)[None, :]
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=pair_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["EM", "num_valid"])  # batch-dependent: no recompile per size class
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, EM, num_valid, stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn,
    A_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr, CHANNEL: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    B_TMA: tl.constexpr, PERSISTENT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``c[pair, n] = (w[pair]) * sum_k a[pair // A_DIV, k] * b[expert, n, k]`` for the pairs of
    ``BLOCK_M`` blocks of ``sorted_ids`` (one expert each) and ``BLOCK_N`` columns (``CHANNEL``: FP8
    with per-token and per-channel scales, applied after the K loop). One tile a program, the
    blocks past the padded length exiting at once; with ``PERSISTENT`` each program walks the
    tiles ``pid, pid + programs, ...`` below the padded length. With ``B_TMA`` ``b_ptr`` is a
    tensor descriptor of the ``[E, N, K]`` weights."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_padded = tl.load(num_padded_ptr)
    if PERSISTENT:
        num_pid_m = tl.cdiv(num_padded, BLOCK_M)
        for tile in tl.range(pid, num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            _gemm_tile(
                pid_m, pid_n, a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, weights_ptr, sorted_ids_ptr,
                expert_ids_ptr, N, K, num_valid, stride_am, stride_be, stride_bn, stride_cm, stride_asm,
                stride_bse, stride_bsn, A_DIV, MUL_WEIGHT, FP8, CHANNEL, GROUP_N, GROUP_K, DOT_FP32, EVEN_K,
                BLOCK_M, BLOCK_N, BLOCK_K, B_TMA, False,
            )  # fmt: skip
        pdl_trigger(USE_PDL)
    else:
        pid_m, pid_n = _tile_coords(pid, tl.cdiv(EM, BLOCK_M), num_pid_n, GROUP_M)
        if pid_m * BLOCK_M < num_padded:  # (the blocks past the padded length do nothing)
            _gemm_tile(
                pid_m, pid_n, a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, weights_ptr, sorted_ids_ptr,
                expert_ids_ptr, N, K, num_valid, stride_am, stride_be, stride_bn, stride_cm, stride_asm,
                stride_bse, stride_bsn, A_DIV, MUL_WEIGHT, FP8, CHANNEL, GROUP_N, GROUP_K, DOT_FP32, EVEN_K,
                BLOCK_M, BLOCK_N, BLOCK_K, B_TMA, USE_PDL,
            )  # fmt: skip


def weights_by_tma(w: torch.Tensor, config: TileConfig) -> bool:
    """Whether the grouped GEMM reads the ``[E, N, K]`` expert weights ``w`` through TMA tensor
    descriptors (``FD_MOE_TMA_WEIGHTS``: ``auto`` for 16-bit weights, ``1`` any, ``0`` none): on
    Hopper or later (or the interpreter), with the descriptor's alignment (16-byte rows and base)
    and box limits (256 elements a side, 16 bytes or more along K)."""
    setting = envs.FD_MOE_TMA_WEIGHTS
    if setting in ("0", "false", "no", "off") or w.dim() != 3 or w.stride(2) != 1:
        return False
    if setting == "auto" and w.dtype == FP8_DTYPE:
        return False
    if not triton_interpreting() and not (w.is_cuda and torch.cuda.get_device_capability(w.device)[0] >= 9):
        return False
    size = w.element_size()
    return (
        w.stride(1) * size % 16 == 0
        and w.stride(0) * size % 16 == 0
        and w.data_ptr() % 16 == 0
        and config.block_k * size >= 16
        and max(config.block_n, config.block_k) <= 256
    )


def _weight_descriptor(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The ``[E, N, K]`` weights' descriptor with ``[1, block_n, block_k]`` boxes, made once per
    weight tensor and box and kept on the tensor (it lives and dies with the weights)."""
    cache = w.__dict__.setdefault("_fd_tma_descriptors", {})
    desc = cache.get((block_n, block_k))
    if desc is None:
        desc = cache[(block_n, block_k)] = TensorDescriptor.from_tensor(w, [1, block_n, block_k])
    return desc


def persistent_programs(tokens: int, device: torch.device, config: TileConfig, element_bytes: int) -> int:
    """Programs of a persistent launch for a step of ``tokens`` tokens from
    ``FD_MOE_PERSISTENT_MIN_TOKENS`` tokens (0: never; else 0, one program a tile): as many as
    run at once, the SMs times the programs one SM holds by its shared memory (the pipeline's
    buffers of ``config``) and warps (64), at most 8. Under the interpreter, two (the tests walk
    several tiles a program)."""
    least = envs.FD_MOE_PERSISTENT_MIN_TOKENS
    if least <= 0 or tokens < least:
        return 0
    if triton_interpreting():
        return 2
    index = device.index if device.index is not None else torch.cuda.current_device()
    per_sm = min(
        device_shared_memory(index) // shared_memory_bytes(config, element_bytes), 64 // config.num_warps, 8
    )
    return torch.cuda.get_device_properties(device).multi_processor_count * max(1, per_sm)


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor | None,
    a_div: int,
    block_shape: tuple[int, int] | None,
    config: TileConfig,
    programs: int = 0,
) -> None:
    """One grouped GEMM: ``out [P, N] = a[pair // a_div] @ w[expert].T`` (times ``topk_weights``);
    ``programs`` > 0: a persistent grid of that many programs (:func:`persistent_programs`)."""
    sorted_ids, expert_ids, num_padded = routing
    n, k = w.shape[1], w.shape[2]
    fp8 = w.dtype == FP8_DTYPE
    group_n, group_k = scale_groups(block_shape)
    interpreting = triton_interpreting()
    dot_fp32 = a.dtype == torch.float32 or interpreting  # the interpreter's low-precision dot is wrong
    tiles = triton.cdiv(sorted_ids.numel(), config.block_m) * triton.cdiv(n, config.block_n)
    b_tma = weights_by_tma(w, config)
    _moe_gemm_kernel[(min(programs, tiles) if programs else tiles,)](
        a, _weight_descriptor(w, config.block_n, config.block_k) if b_tma else w, out,
        a_scale if fp8 else a, w_scale if fp8 else w, topk_weights if topk_weights is not None else a,
        sorted_ids, expert_ids, num_padded, n, k, sorted_ids.numel(), out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        a_scale.stride(0) if fp8 else 0, w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0,
        A_DIV=a_div, MUL_WEIGHT=topk_weights is not None, FP8=fp8, CHANNEL=block_shape is None,
        GROUP_N=group_n, GROUP_K=group_k, DOT_FP32=dot_fp32, EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        B_TMA=b_tma, PERSISTENT=bool(programs), num_warps=config.num_warps,
        num_stages=1 if interpreting else config.num_stages, **pdl_kwargs(out),
    )  # fmt: skip
