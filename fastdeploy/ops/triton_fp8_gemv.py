"""FP8-weight linear for few rows (w8a16): decode steps of FP8 models on a GPU, in one kernel.

At decode sizes a linear layer is a pass over its weight (2 FLOP per weight byte read once
at M = 1), so its time is the weight bytes over the memory bandwidth, and an e4m3 weight
takes half the time of a bf16 one. The w8a8 path spends that gain twice over: a kernel
that quantizes the activation, then a GEMM tiled for tensor-core throughput, each a launch
of its own. This kernel streams the fp8 weight once, dequantizes it in registers with its
scales and multiplies it with the bf16 / fp16 activation as it is: no activation
quantization at all (the activation keeps its precision, so the result is closer to the
unquantized layer than the w8a8 one), one launch per layer, bias in the epilogue. At 1-2
rows two prologues take the small kernels around it too: for down_proj it forms
``silu(gate) * up`` from ``gate_up`` as it loads it (``silu_mul``), and for qkv / gate_up it
runs the residual add + RMSNorm before them (:func:`fp8_norm_small_m_linear`, the prologue of
:mod:`fastdeploy.ops.triton_norm_gemv`; the rotary and cache-write epilogue is not here).

Weights are ``[N, K]`` float8_e4m3fn with float32 dequantization scales (``w ≈ fp8 * scale``),
either per output channel (``scale [N]``) or per ``(GROUP_N, GROUP_K)`` block
(``scale [ceil(N/GROUP_N), ceil(K/GROUP_K)]``, the ``weight_scale_inv`` layout).

Two formulations, as in :mod:`fastdeploy.ops.triton_gemv` (the bf16 small-M kernel), chosen
per shape by the autotuner:

* broadcast (``DOT=False``, up to 4 rows): float32 ``[BLOCK_N, BLOCK_K]`` accumulators, one a
  row, reduced across K after the loop. A block scale is folded into the activation chunk
  (``x * scale[row block, k // GROUP_K]``, ``BLOCK_K`` multiplies a step shared by the
  ``BLOCK_N`` rows; ``BLOCK_N`` divides ``GROUP_N`` so one tile lies in one row block).
* ``tl.dot`` (``DOT=True``, 2 rows and more): the weight tile converted to the activation
  dtype as the MMA's first operand, rows padded to ``BLOCK_M >= 16``; with block scales each
  ``BLOCK_K`` step (``BLOCK_K`` divides ``GROUP_K``) adds its partial product times the tile
  rows' scales.

Per-channel scales multiply the float32 sums once, in the epilogue. Rows enter as
``M_PAD`` (M rounded up to a power of two, the rest masked), so that the autotuner and the
compiler see five row counts up to 16 rather than sixteen.

The autotuner benchmarks its configurations on the first call of each shape; that
synchronizes the device, so it must not happen inside CUDA graph capture:
:func:`is_warmed_up` tells whether a call is free of it (the graph warm-up forward tunes
every captured size first).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from fastdeploy.ops.fp8_quant import FP8_DTYPE
from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_gemv import ACC_ELEMENTS, autotune_bench, gemv_config
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue, pdl_trigger

MAX_M = 256
"""Most rows :func:`fp8_small_m_linear` takes (how many it is used for is the caller's choice,
``FD_FP8_SMALL_M_MAX``); the dot form tiles them by at most :data:`DOT_MAX_BLOCK_M`."""
DOT_MAX_BLOCK_M = 64
"""Most rows one program of the dot form multiplies (its accumulator is ``BLOCK_N x BLOCK_M``)."""
BROADCAST_MAX_M = 4
"""Most (padded) rows of the broadcast form: one float32 accumulator tile per row."""
NORM_FUSE_MAX_M = 2
"""Most rows that take the residual-add + RMSNorm prologue (broadcast form only), for the reason
of :data:`SILU_FUSE_MAX_M` (as :data:`fastdeploy.ops.triton_norm_gemv.NORM_FUSE_MAX_M`)."""
SILU_FUSE_MAX_M = 2
"""Most rows that take the fused SiLU-and-multiply prologue (broadcast form only): every program
recomputes its rows' activations over the whole K, so the extra work grows with M; the bf16
kernel's measurement (:data:`fastdeploy.ops.triton_gemv.SILU_FUSE_MAX_M`) put the break-even
past 2 rows."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Activation (and output) dtypes."""


@triton.jit
def _row_act(x_ptr, row, M, K, cols, k_mask, s_k, BLOCK_SCALED: tl.constexpr, SILU_MUL: tl.constexpr):
    """Row ``row``'s activations at ``cols`` in float32 (zero past M or K): ``x``, or
    ``silu(gate) * up`` rounded as the unfused ops round it; times the block scales."""
    mask = k_mask & ((cols * 0 + row) < M)
    v = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if SILU_MUL:
        dtype = x_ptr.dtype.element_ty
        u = tl.load(x_ptr + K + cols, mask=mask, other=0.0)
        g = v.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        v = (act * u.to(tl.float32)).to(dtype)
    v = v.to(tl.float32)
    if BLOCK_SCALED:
        v = v * s_k
    return v


@triton.jit
def _norm_input(x_row, r_row, r_out_row, cols, k_mask, store_end, HAS_RES: tl.constexpr):
    """``h = x + residual`` at ``cols`` in float32, rounded as the unfused add rounds it, and
    stored (the next residual) where ``cols < store_end``; ``x`` without a residual."""
    x = tl.load(x_row + cols, mask=k_mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_row + cols, mask=k_mask, other=0.0).to(tl.float32)
        h = (x + r).to(r_out_row.dtype.element_ty)
        tl.store(r_out_row + cols, h, mask=k_mask & (cols < store_end))
        x = h.to(tl.float32)
    return x


@triton.jit
def _store_row(out_ptr, row, M, acc, s_n, bias, offs_n, n_mask, PER_CHANNEL: tl.constexpr,
               HAS_BIAS: tl.constexpr, rstd):  # fmt: skip
    total = tl.sum(acc, axis=1) * rstd
    if PER_CHANNEL:
        total = total * s_n
    if HAS_BIAS:
        total = total + bias
    tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask & ((offs_n * 0 + row) < M))


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    r_ptr,
    r_out_ptr,
    nw_ptr,
    eps,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_rm,
    M_PAD: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[:M, tile] = x @ dequant(w[tile])^T (+ bias)``; ``GROUP_K == 0``: per-channel scales.
    ``NORM``: ``x`` is ``rms_norm(x + residual) * nw`` (the sum stored to ``r_out`` by program 0)."""
    PER_CHANNEL: tl.constexpr = GROUP_K == 0
    pdl_prologue(USE_PDL)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # clamped rows: the weight loads need no N mask (the tail's duplicates are not stored)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    s_n = 0.0
    bias = 0.0
    if DOT:
        tl.static_assert(not SILU_MUL and not NORM, "the dot form takes no SiLU or norm prologue")
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        s_rows = s_ptr + (rows // GROUP_N) * stride_sn  # (unused per channel)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs + k0)
                x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
            else:
                k_mask = (k0 + offs_k) < K
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
                x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if DOT_FP32:
                w_op = w.to(tl.float32)
                x_op = tl.trans(x.to(tl.float32))
            else:
                w_op = w.to(x_ptr.dtype.element_ty)
                x_op = tl.trans(x)
            if PER_CHANNEL:
                if DOT_FP32:
                    acc = tl.dot(w_op, x_op, acc, input_precision="ieee")
                else:
                    acc = tl.dot(w_op, x_op, acc)
            else:
                if DOT_FP32:
                    part = tl.dot(w_op, x_op, input_precision="ieee")
                else:
                    part = tl.dot(w_op, x_op)
                acc += part * tl.load(s_rows + k0 // GROUP_K)[:, None]
        pdl_trigger(USE_PDL)
        if PER_CHANNEL:
            acc = acc * tl.load(s_ptr + rows)[:, None]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rows).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])
    else:
        tl.static_assert(M_PAD <= 4, "the broadcast form takes at most 4 rows")
        tl.static_assert(M_PAD <= 2 or not NORM, "the norm prologue takes at most 2 rows")
        store_res = tl.where(pid_n == 0, K, 0)  # program 0 stores the new residual
        ss0 = tl.zeros([BLOCK_K], dtype=tl.float32)
        ss1 = tl.zeros([BLOCK_K], dtype=tl.float32)
        # one tile lies in one row block of the scales (GROUP_N is a multiple of BLOCK_N)
        s_tile = s_ptr + ((pid_n * BLOCK_N) // GROUP_N) * stride_sn  # (unused per channel)
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            cols = k0 + offs_k
            k_mask = cols < K
            if EVEN_K:
                w = tl.load(w_ptrs + k0).to(tl.float32)
            else:
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0).to(tl.float32)
            s_k = 1.0
            if not PER_CHANNEL:
                s_k = tl.load(s_tile + cols // GROUP_K, mask=k_mask, other=0.0)
            if NORM:
                nw = tl.load(nw_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
                if not PER_CHANNEL:
                    nw = nw * s_k
                h0 = _norm_input(x_ptr, r_ptr, r_out_ptr, cols, k_mask, store_res, HAS_RES)
                ss0 += h0 * h0
                acc0 += w * (h0 * nw)[None, :]
                if M_PAD > 1:
                    h1 = _norm_input(
                        x_ptr + stride_xm, r_ptr + stride_rm, r_out_ptr + K, cols, k_mask, store_res, HAS_RES
                    )
                    ss1 += h1 * h1
                    acc1 += w * (h1 * nw)[None, :]
            else:
                x0 = _row_act(x_ptr, 0, M, K, cols, k_mask, s_k, not PER_CHANNEL, SILU_MUL)
                acc0 += w * x0[None, :]
                if M_PAD > 1:
                    x1 = _row_act(x_ptr + stride_xm, 1, M, K, cols, k_mask, s_k, not PER_CHANNEL, SILU_MUL)
                    acc1 += w * x1[None, :]
            if M_PAD > 2:
                x2 = _row_act(x_ptr + 2 * stride_xm, 2, M, K, cols, k_mask, s_k, not PER_CHANNEL, SILU_MUL)
                acc2 += w * x2[None, :]
                x3 = _row_act(x_ptr + 3 * stride_xm, 3, M, K, cols, k_mask, s_k, not PER_CHANNEL, SILU_MUL)
                acc3 += w * x3[None, :]
        pdl_trigger(USE_PDL)
        if PER_CHANNEL:
            s_n = tl.load(s_ptr + rows)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rows).to(tl.float32)
        rstd0 = 1.0
        rstd1 = 1.0
        if NORM:
            rstd0 = tl.rsqrt(tl.sum(ss0, axis=0) / K + eps)
            rstd1 = tl.rsqrt(tl.sum(ss1, axis=0) / K + eps)
        _store_row(out_ptr, 0, M, acc0, s_n, bias, offs_n, n_mask, PER_CHANNEL, HAS_BIAS, rstd0)
        if M_PAD > 1:
            _store_row(
                out_ptr + stride_om, 1, M, acc1, s_n, bias, offs_n, n_mask, PER_CHANNEL, HAS_BIAS, rstd1
            )
        if M_PAD > 2:
            _store_row(
                out_ptr + 2 * stride_om, 2, M, acc2, s_n, bias, offs_n, n_mask, PER_CHANNEL, HAS_BIAS, 1.0
            )
            _store_row(
                out_ptr + 3 * stride_om, 3, M, acc3, s_n, bias, offs_n, n_mask, PER_CHANNEL, HAS_BIAS, 1.0
            )


# Candidates, not yet measured: the bf16 kernel's winners scaled to fp8 (a weight byte per
# element, so twice the columns per step for the same bytes) plus deeper pipelines, since
# each step's loads are smaller. benchmarks/gpubench/fp8_gemm_bench.py prints the winners.
BROADCAST_CONFIGS = [
    gemv_config(8, 256, False, 4, 4),
    gemv_config(8, 512, False, 4, 3),
    gemv_config(8, 512, False, 4, 4),
    gemv_config(16, 256, False, 4, 4),
    gemv_config(16, 512, False, 4, 3),
    gemv_config(16, 128, False, 4, 6),
    gemv_config(32, 256, False, 4, 3),
    gemv_config(32, 128, False, 4, 6),
    # more programs, fewer K steps each (qkv and o at one row: 6.6 µs for 10 MB, eighteenth session)
    gemv_config(4, 1024, False, 4, 3),  # (4 x 2048 spills with the norm prologue at 2 rows)
    # `--sweep gemv` winners at one and two rows (twenty-sixth session): qkv 11.3 -> 7.4 us, o 7.7 -> 7.2
    gemv_config(64, 256, False, 4, 4),
    gemv_config(16, 1024, False, 4, 4),
    gemv_config(16, 512, False, 4, 4),
]
DOT_CONFIGS = [
    gemv_config(16, 128, True, 4, 4),
    gemv_config(32, 128, True, 4, 4),
    gemv_config(32, 128, True, 4, 6),
    gemv_config(64, 128, True, 4, 4),
    gemv_config(64, 128, True, 4, 6),
    gemv_config(128, 128, True, 8, 4),
    gemv_config(32, 64, True, 4, 8),
    gemv_config(64, 256, True, 4, 3),
    gemv_config(32, 256, True, 4, 4),
]
_CONFIGS = BROADCAST_CONFIGS + DOT_CONFIGS


def config_fits(
    kw: dict[str, Any], m_pad: int, group_n: int, group_k: int, silu_mul: bool = False, norm: bool = False
) -> bool:
    """Whether a configuration (its kwargs, and ``num_warps``: 4 if absent) can run ``m_pad`` rows of
    weights in ``(group_n, group_k)`` blocks (``group_k == 0``: per channel), with the SiLU or norm
    prologue or not, without spilling its accumulators."""
    if kw["DOT"]:
        prologue = silu_mul or norm
        return m_pad > 1 and not prologue and (group_k == 0 or group_k % kw["BLOCK_K"] == 0)
    if norm and m_pad > NORM_FUSE_MAX_M:
        return False
    fits_block = group_k == 0 or group_n % kw["BLOCK_N"] == 0
    accumulators = ACC_ELEMENTS * kw.get("num_warps", 4) // 4  # (the registers of more warps hold more)
    return m_pad <= BROADCAST_MAX_M and fits_block and m_pad * kw["BLOCK_N"] * kw["BLOCK_K"] <= accumulators


def _prune(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """The configurations that fit the call (:func:`config_fits`)."""

    def arg(name: str) -> Any:
        return kwargs.get(name, named_args.get(name))

    m_pad, group_n, group_k = arg("M_PAD"), arg("GROUP_N"), arg("GROUP_K")
    silu, norm = arg("SILU_MUL"), arg("NORM")
    kept = [
        c
        for c in configs
        if config_fits({**c.kwargs, "num_warps": c.num_warps}, m_pad, group_n, group_k, silu, norm)
    ]
    return kept or [_fallback_config(m_pad)]


def _fallback_config(m_pad: int) -> triton.Config:
    """A configuration every eligible call fits (blocks of at least 64 x 64, see :func:`supports`)."""
    return gemv_config(8, 64, False, 4, 3) if m_pad <= BROADCAST_MAX_M else gemv_config(32, 64, True, 4, 4)


def _block_m(args: dict[str, Any]) -> int:
    return min(DOT_MAX_BLOCK_M, max(16, args["M_PAD"]))


_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0, "BLOCK_M": _block_m})(
    _fp8_gemv_kernel
)
_tuned_kernel = triton.autotune(
    configs=_CONFIGS,
    key=["N", "K", "M_PAD", "GROUP_N", "GROUP_K", "HAS_BIAS", "SILU_MUL", "NORM", "HAS_RES"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=autotune_bench,
)(_kernel)

_warmed: set[tuple[Any, ...]] = set()


def _m_pad(m: int) -> int:
    return triton.next_power_of_2(m)


def _groups(block: tuple[int, int] | None) -> tuple[int, int]:
    """``(GROUP_N, GROUP_K)`` of a weight block; ``(1, 0)`` per channel."""
    return (1, 0) if block is None else block


def _warm_key(x, weight, block, has_bias: bool, variant: str) -> tuple[Any, ...]:
    n, k = weight.shape
    return (_m_pad(x.shape[0]), n, k, _groups(block), x.dtype, has_bias, variant, x.get_device())


def is_warmed_up(
    x: torch.Tensor,
    weight: torch.Tensor,
    block: tuple[int, int] | None,
    has_bias: bool,
    silu_mul: bool = False,
    norm: str | None = None,
) -> bool:
    """Whether :func:`fp8_small_m_linear` (``norm``: :func:`fp8_norm_small_m_linear`, ``"add"``
    with a residual, ``"plain"`` without) already ran on this shape (rows rounded up to a power of
    two) outside graph capture: only then is a call free of autotuning, and so capturable."""
    return _warm_key(x, weight, block, has_bias, _variant(silu_mul, norm)) in _warmed


def _variant(silu_mul: bool, norm: str | None) -> str:
    return f"norm-{norm}" if norm else ("silu" if silu_mul else "")


def supports(
    x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None, silu_mul: bool = False
) -> bool:
    """Whether the kernel takes these operands (the layout checks of :func:`fp8_small_m_linear`,
    as a yes/no for a caller that has another path): 1 to :data:`MAX_M` rows (with ``silu_mul``
    1 to :data:`SILU_FUSE_MAX_M` rows of ``[gate | up]``, ``2K`` columns) with unit column stride,
    an fp8 weight with contiguous rows, blocks of powers of two of at least 64."""
    max_m = SILU_FUSE_MAX_M if silu_mul else MAX_M
    if x.dim() != 2 or not 0 < x.shape[0] <= max_m or x.dtype not in DTYPES or weight.dtype != FP8_DTYPE:
        return False
    width = (2 if silu_mul else 1) * weight.shape[1]
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.shape[1] != width:
        return False
    if block is not None and not all(b >= 64 and b & (b - 1) == 0 for b in block):
        return False
    return True


def _check(x, weight, scale, block, bias, silu_mul) -> None:
    if not supports(x, weight, block, silu_mul):
        rows = SILU_FUSE_MAX_M if silu_mul else MAX_M
        cols = "2K ([gate | up])" if silu_mul else "K"
        raise ValueError(
            f"fp8_small_m_linear needs x [1..{rows}, {cols}] of {DTYPES} with unit column stride and a "
            f"float8_e4m3fn weight [N, K] with contiguous rows (blocks: powers of two >= 64); got x "
            f"{x.dtype} {tuple(x.shape)} strides {x.stride()}, weight {weight.dtype} {tuple(weight.shape)}, "
            f"block {block}"
        )
    n, k = weight.shape
    want = (n,) if block is None else (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or scale.stride(-1) != 1:
        raise ValueError(
            f"scale must be float32 {want} with unit last stride, got {scale.dtype} {tuple(scale.shape)}"
        )
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")


def launch_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: dict[str, Any] | None = None,
    silu_mul: bool = False,
    norm: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Run the kernel into ``out [M, N]``: autotuned on a GPU when ``config`` is None, else with
    ``config`` (``BLOCK_N``, ``BLOCK_K``, ``DOT``, ``STAGES``, optional ``num_warps``; under
    ``TRITON_INTERPRET=1`` a small default). ``norm``: ``(residual or None, residual_out,
    norm_weight, eps)`` for the norm prologue."""
    m = x.shape[0]
    n, k = weight.shape
    group_n, group_k = _groups(block)
    residual, res_out, norm_weight, eps = norm if norm is not None else (None, x, x, 0.0)
    res = x if residual is None else residual
    args = (x, weight, scale, out if bias is None else bias, out, res, res_out, norm_weight, eps, m, n, k,
            x.stride(0), weight.stride(0), scale.stride(0), out.stride(0), res.stride(0))  # fmt: skip
    interpreting = triton_interpreting()
    const = dict(
        M_PAD=_m_pad(m), GROUP_N=group_n, GROUP_K=group_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        NORM=norm is not None, HAS_RES=residual is not None,
        # float32 dots in IEEE precision; the interpreter's fp8 / bf16 dots are not exact
        DOT_FP32=x.dtype == torch.float32 or interpreting, **pdl_kwargs(x),
    )  # fmt: skip
    if config is None and not interpreting:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))  # noqa: E731
        _tuned_kernel[grid](*args, **const)
        return
    if config is None:
        config = _fallback_config(const["M_PAD"]).kwargs
    meta = dict(config)
    warps = meta.pop("num_warps", 4)
    if not config_fits(meta, const["M_PAD"], group_n, group_k, silu_mul, norm is not None):
        raise ValueError(f"configuration {config} does not fit M_PAD={const['M_PAD']}, block {block}")
    grid = (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, _block_m(const)))
    _kernel[grid](*args, **const, **meta, num_warps=warps, num_stages=1 if interpreting else meta["STAGES"])


def fp8_small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight [N, K])^T + bias`` in ``x``'s dtype for 1 to :data:`MAX_M` rows.

    ``weight`` is float8_e4m3fn with ``scale`` ``[N]`` (``block`` None: per output channel) or
    ``[ceil(N/bn), ceil(K/bk)]`` (``block = (bn, bk)``), float32 dequantization factors; ``x`` is
    bf16 / fp16 / fp32 and is not quantized. With ``silu_mul``, ``x`` is ``[M, 2K]`` =
    ``[gate | up]`` (at most :data:`SILU_FUSE_MAX_M` rows) and the activation is
    ``silu(gate) * up``, formed as the kernel loads it and rounded as the unfused
    :func:`~fastdeploy.ops.layer_ops.silu_and_mul` rounds it. Accumulates in float32 and rounds
    once. The first call of a shape autotunes (and so synchronizes); later calls allocate the
    output and launch one kernel, which CUDA graphs can capture.
    """
    _check(x, weight, scale, block, bias, silu_mul)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    launch_kernel(x, weight, scale, block, bias, out, silu_mul=silu_mul)
    if x.is_cuda and not torch.cuda.is_current_stream_capturing():
        _warmed.add(_warm_key(x, weight, block, bias is not None, _variant(silu_mul, None)))
    return out


def supports_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor, block
) -> bool:
    """Whether :func:`fp8_norm_small_m_linear` takes these operands: :func:`supports`, at most
    :data:`NORM_FUSE_MAX_M` rows, a residual laid out like ``x``, a ``[K]`` norm weight."""
    if not supports(x, weight, block) or x.shape[0] > NORM_FUSE_MAX_M:
        return False
    if tuple(norm_weight.shape) != (x.shape[1],) or norm_weight.stride(0) != 1:
        return False
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1
    ):
        return False
    return True


def fp8_norm_small_m_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x + residual) @ dequant(weight)^T + bias`` and the new residual ``x + residual``
    (``x`` itself without a residual), in one kernel, for 1 to :data:`NORM_FUSE_MAX_M` rows.

    The prologue of :mod:`fastdeploy.ops.triton_norm_gemv` on fp8 weights: each program forms
    ``h = x + residual`` as it streams K (rounded to the dtype as the unfused add rounds it),
    accumulates ``w * h * norm_weight`` and ``h²`` side by side and scales its sums by
    ``rsqrt(mean(h²) + eps)`` at the end; program 0 stores ``h``. The normalized input is not
    rounded to the dtype (the unfused norm rounds it), so results differ from the unfused path
    by that rounding noise.
    """
    if not supports_norm(x, residual, norm_weight, weight, block):
        raise ValueError(
            f"fp8_norm_small_m_linear needs x [1..{NORM_FUSE_MAX_M}, K], a residual like x or None and a "
            f"[K] norm weight; got x {tuple(x.shape)}, residual "
            f"{None if residual is None else tuple(residual.shape)}, norm weight {tuple(norm_weight.shape)}"
        )
    _check(x, weight, scale, block, bias, False)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    launch_kernel(x, weight, scale, block, bias, out, norm=(residual, res_out, norm_weight, float(eps)))
    if x.is_cuda and not torch.cuda.is_current_stream_capturing():
        kind = "add" if residual is not None else "plain"
        _warmed.add(_warm_key(x, weight, block, bias is not None, _variant(False, kind)))
    return out, res_out


def last_tuned_config() -> str | None:
    """The configuration the autotuner ran last (benchmark reports; None before any GPU call)."""
    config = getattr(_tuned_kernel, "best_config", None)
    if config is None:
        return None
    kw = config.kwargs
    form = "dot" if kw["DOT"] else "broadcast"
    return f"{form} N{kw['BLOCK_N']} K{kw['BLOCK_K']} w{config.num_warps} s{config.num_stages}"
