"""FP8 (w8a8) GEMMs in Triton: ``out [M, N] = dequant(a [M, K]) @ dequant(b [N, K])^T``.

Operands are float8_e4m3fn with float32 dequantization scales, in one of two layouts:

* **block-scaled** (:func:`fp8_block_gemm`): ``a_scale [M, ceil(K/gk)]`` (one per token and ``gk``
  columns, dynamic) and ``b_scale [ceil(N/gn), ceil(K/gk)]`` (one per ``gn × gk`` weight block:
  the ``weight_scale_inv`` of DeepSeek / Qwen3-FP8 checkpoints and of ``--quantization fp8``).
  Each ``BLOCK_K`` step (``BLOCK_K`` divides ``gk``) multiplies the fp8 tiles on the tensor cores
  into float32 and adds them times their row and column scales. :func:`fp8_block_linear`
  quantizes the activation (1 × ``gk`` groups) and launches it.
* **per channel** (:func:`fp8_channel_gemm`, ``--quantization ptpc_fp8``): ``a_scale [M, 1]`` (per
  token) and ``b_scale [N]`` (per output channel). The K loop is plain fp8 dots into one
  accumulator and both scales multiply the tile once after it: the GEMM row-wise
  ``torch._scaled_mm`` computes, for the row counts where a tile table of our own beats cuBLAS's
  choice (``FD_FP8_CHANNEL_TRITON_MAX_M``, :mod:`fastdeploy.ops.fp8_linear`).

The output is cast once; the configurations come from small tables by M (:data:`CONFIGS`,
:data:`CHANNEL_CONFIGS`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from fastdeploy.ops.fp8_quant import FP8_DTYPE
from fastdeploy.ops.tile_config import TileConfig, table_config
from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_fp8_quant import quantize_activation_per_token_group
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue, pdl_trigger

Fp8GemmConfig = TileConfig
"""Triton meta-parameters of one FP8 GEMM launch."""


# (largest M, config): the winners of `benchmarks/gpubench/fp8_gemm_bench.py --sweep gemm` on an
# H200 for Qwen3-30B-A3B's qkv (5120 x 2048) and o (2048 x 4096) projections (docs/benchmarks.md):
# M = 64: 12.2 -> 8.4 us (qkv), M = 256: 19.9 -> 14.3 (o), M = 1024: 48.1 -> 37.6 (qkv), M = 4096:
# 157.3 -> 136.1 (qkv), 119.0 -> 99.2 (o).
CONFIGS: tuple[tuple[int, Fp8GemmConfig], ...] = (
    (16, Fp8GemmConfig(16, 64, 128, 1, 4, 5)),
    (256, Fp8GemmConfig(64, 64, 128, 8, 4, 5)),
    (1 << 62, Fp8GemmConfig(64, 128, 128, 8, 4, 3)),
)
# Per-channel weights (no per-step rescale, so deeper K steps pay off): the winners of `--sweep
# gemm-channel` on an H200 for the same two projections (twenty-sixth session; docs/benchmarks.md):
# M = 32: 11.9 -> 8.3 us (qkv), M = 64-256: 9.2-9.4 -> 8.4-8.6 (o), M = 512: 16.0 -> 10.6 (o).
CHANNEL_CONFIGS: tuple[tuple[int, Fp8GemmConfig], ...] = (
    (16, Fp8GemmConfig(16, 64, 128, 1, 4, 5)),
    (32, Fp8GemmConfig(32, 64, 128, 1, 4, 5)),
    (256, Fp8GemmConfig(64, 64, 256, 8, 4, 4)),
    (512, Fp8GemmConfig(64, 128, 256, 8, 4, 4)),
    (1 << 62, Fp8GemmConfig(64, 128, 128, 8, 4, 3)),
)
INTERPRETER_CONFIG = Fp8GemmConfig(16, 32, 64, 1, 4, 1)
"""The configuration under ``TRITON_INTERPRET=1`` (CPU tests): small tiles, quick."""


def default_config(m: int, per_channel: bool = False) -> Fp8GemmConfig:
    """The table's configuration for ``m`` rows (the interpreter's under ``TRITON_INTERPRET=1``)."""
    if triton_interpreting():
        return INTERPRETER_CONFIG
    return table_config(CHANNEL_CONFIGS if per_channel else CONFIGS, m)


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_ask,
    stride_bsn,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One ``BLOCK_M × BLOCK_N`` tile of ``c = sum_k (a_k * a_scale) (b_k * b_scale)^T (+ bias)``
    (``CHANNEL``: one scale per row of ``a`` and of ``b``, applied after the K loop)."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    # clamped rows and columns: loads need no M/N mask (the duplicates are not stored)
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None]
    a_scale_ptrs = a_scale_ptr + rows * stride_asm
    b_scale_ptrs = b_scale_ptr + (cols // GROUP_N) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if CHANNEL:
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        else:
            if DOT_FP32:
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, b)
            a_s = tl.load(a_scale_ptrs + (k0 // GROUP_K) * stride_ask)
            b_s = tl.load(b_scale_ptrs + k0 // GROUP_K)
            acc += part * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_trigger(USE_PDL)
    if CHANNEL:
        acc = acc * tl.load(a_scale_ptrs)[:, None] * tl.load(b_scale_ptrs)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    config: Fp8GemmConfig | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` from fp8 ``a [M, K]`` / ``a_scale [M, ceil(K/gk)]`` (any strides)
    and fp8 ``b [N, K]`` / ``b_scale [ceil(N/gn), ceil(K/gk)]``, ``block = (gn, gk)``, plus an
    optional ``bias [N]`` added in the epilogue (see the module)."""
    m, k = _check_operands(a, b, bias)
    n = b.shape[0]
    gn, gk = block
    if a_scale.shape != (m, triton.cdiv(k, gk)) or b_scale.shape != (triton.cdiv(n, gn), triton.cdiv(k, gk)):
        raise ValueError(
            f"scales {tuple(a_scale.shape)} / {tuple(b_scale.shape)} do not fit {(m, n, k)} in blocks {block}"
        )
    if b_scale.stride(1) != 1:
        raise ValueError("b_scale needs unit stride along K")
    config = config or default_config(m)
    if gk % config.block_k:
        config = dataclasses.replace(config, block_k=gk)  # one scale per K step: BLOCK_K must divide gk
    return _launch(a, a_scale, b, b_scale, (a_scale.stride(0), a_scale.stride(1), b_scale.stride(0)),
                   block, False, out_dtype, config, bias)  # fmt: skip


def fp8_channel_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` from fp8 ``a [M, K]`` / ``a_scale [M, 1]`` (per token) and fp8
    ``b [N, K]`` / ``b_scale [N]`` (per output channel), plus an optional ``bias [N]``: what
    row-wise ``torch._scaled_mm`` computes (see the module)."""
    m, _ = _check_operands(a, b, bias)
    n = b.shape[0]
    if a_scale.shape != (m, 1) or b_scale.shape != (n,) or b_scale.stride(0) != 1:
        raise ValueError(f"per-channel scales must be [M, 1] and a contiguous [N], got "
                         f"{tuple(a_scale.shape)} / {tuple(b_scale.shape)} for {(m, n)}")  # fmt: skip
    config = config or default_config(m, per_channel=True)
    return _launch(a, a_scale, b, b_scale, (a_scale.stride(0), 0, 1), (1, 1), True, out_dtype, config, bias)


def _check_operands(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
    """``(M, K)`` of fp8 ``a [M, K]`` against ``b [N, K]`` (unit K strides) and an optional ``bias [N]``."""
    m, k = a.shape
    n = b.shape[0]
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE or b.shape[1] != k:
        raise ValueError(
            f"need float8_e4m3fn a [M, K] and b [N, K], got {a.dtype} {tuple(a.shape)}, "
            f"{b.dtype} {tuple(b.shape)}"
        )
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b need unit stride along K")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    return m, k


def _launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    scale_strides: tuple[int, int, int],
    groups: tuple[int, int],
    channel: bool,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """One launch of the kernel; ``scale_strides`` = (a_scale's row and group strides, b_scale's row stride)."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    interpreting = triton_interpreting()
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _fp8_block_gemm_kernel[grid](
        a, b, out, a_scale, b_scale, out if bias is None else bias, m, n, k,
        a.stride(0), b.stride(0), out.stride(0), *scale_strides,
        GROUP_N=groups[0],
        GROUP_K=groups[1],
        CHANNEL=channel,
        HAS_BIAS=bias is not None,
        DOT_FP32=interpreting,  # the interpreter's fp8 dot is not exact; float32 is
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=1 if interpreting else config.num_stages,
        **pdl_kwargs(out),
    )  # fmt: skip
    return out


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight)^T + bias`` in ``x``'s dtype, two kernels: ``x`` quantized per
    token and ``block[1]`` columns, then :func:`fp8_block_gemm`."""
    xq, xs = quantize_activation_per_token_group(x, block[1])
    return fp8_block_gemm(xq, xs, weight, weight_scale, block, x.dtype, config, bias)
