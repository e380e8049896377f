"""Triton linear layer for at most four rows: batch-1 (to 4) decode on a GPU.

At M <= 4 a linear layer is a pass over its weight: 2 FLOP per weight element read
once, so its time is the weight bytes over the memory bandwidth. cuBLAS launches
split-K GEMMs with a separate reduce kernel for some of these shapes, and the MLP runs
a separate SiLU-and-multiply kernel between gate_up_proj and down_proj. This kernel
reads each weight element exactly once (the grid covers N only: one program per
``BLOCK_N`` output columns, all rows, the whole K), and it can form ``silu(gate) * up``
from ``gate_up`` as it loads it, so that ``down_proj(silu_and_mul(gate_up))`` is one
kernel.

Two formulations, chosen per shape by the autotuner (measured on an H200, Triton 3.6,
bf16, rotating weights bigger than L2; copy bandwidth 4.28 TB/s read + written):

* broadcast (``DOT=False``): each row's products ``w * x[None, :]`` are summed into a
  float32 ``[BLOCK_N, BLOCK_K]`` accumulator and reduced across K once, after the loop
  (a reduction per K step costs warp shuffles in the loop). The K loop is a
  ``tl.range(num_stages=...)``, which has Triton pipeline the weight loads through
  shared memory. With 8-16 columns per program even N = 2048 gives 128-256 programs.
  Best at M = 1 everywhere (e.g. 8B down_proj 28.8 µs against cuBLAS's 32.0, 95% of the
  copy-rate floor; 1B down_proj 10.3 against 13.9) and up to M = 4 when N is small.
* ``tl.dot`` (``DOT=True``): rows padded to 16 (masked), weights as the MMA's first
  operand (``acc[BLOCK_N, 16] = w @ x.T``) so that BLOCK_N can be 64; Triton's matmul
  pipeliner streams both operands. Its 16x padding costs nothing at this intensity
  but the broadcast form's register accumulators grow with M: at M = 3-4 and large N
  the dot form wins (8B gate_up at M = 4: 56.4 µs against 66.9, cuBLAS 56.8). Never
  faster at M = 1, so not tried there, and never used with ``silu_mul`` (the
  activation would feed the dot through registers, which Triton does not pipeline:
  six times slower).

Rounding follows the unfused path: ``silu(gate)`` is rounded to the input dtype, the
product with ``up`` is rounded again (as :func:`fastdeploy.ops.layer_ops.silu_and_mul`),
the matmul accumulates in float32 and the output is rounded once.

The autotuner benchmarks its configurations on the first call of each
``(N, K, M, silu_mul, dtype)``; that call synchronizes the device, so it must not happen
inside CUDA graph capture: warm up with the same shapes first (the model runner's
capture does). :func:`is_warmed_up` tells whether a call would be free of it.

End to end (H200, dummy bf16 weights, decode CUDA graphs, ``FD_SMALL_M_GEMV=1``): the
batch-1 decode step of Llama-3.2-1B went from 1.146 to 1.031 ms, of Llama-3.1-8B from
4.709 to 4.227 ms; :func:`fastdeploy.model_executor.layers.linear.small_m_eligible`
keeps eager launches (about 30 µs of host time each) on cuBLAS.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue, pdl_trigger

SMALL_M_MAX = 4
"""Most rows :func:`small_m_linear` takes (decode batches of up to four requests)."""
SILU_FUSE_MAX_M = 2
"""Most rows for which the fused SiLU-and-multiply prologue beats a separate kernel.

Each program recomputes the activation of its rows over the whole K, so the recomputed
work grows with M: on an H200 the fused 8B down_proj takes 29.3 / 30.8 / 51 / 62 µs at
M = 1 / 2 / 3 / 4, against about 3 µs of ``silu_and_mul`` plus 29-31 µs unfused.
"""

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The activation and weight dtypes the small-M kernels take."""
ACC_ELEMENTS = 16384
"""Largest ``M * BLOCK_N * BLOCK_K`` of the broadcast form: its float32 accumulators take
``M * BLOCK_N * BLOCK_K / (32 * num_warps)`` registers a thread (128 at 4 warps)."""


@triton.jit
def _act_row(row_ptr, cols, k_mask, K, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """One row's activations at ``cols`` in float32: ``x``, or ``silu(gate) * up`` rounded as unfused."""
    if EVEN_K:
        v = tl.load(row_ptr + cols)
    else:
        v = tl.load(row_ptr + cols, mask=k_mask, other=0.0)
    if SILU_MUL:
        dtype = row_ptr.dtype.element_ty
        if EVEN_K:
            u = tl.load(row_ptr + K + cols)
        else:
            u = tl.load(row_ptr + K + cols, mask=k_mask, other=0.0)
        g = v.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (act * u.to(tl.float32)).to(dtype).to(tl.float32)
    return v.to(tl.float32)


@triton.jit
def _store_row(out_ptr, acc, offs_n, n_mask):
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _small_m_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    M: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # clamped rows: the weight loads need no N mask (the tail's duplicates are not stored)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if DOT:
        tl.static_assert(not SILU_MUL, "the dot form takes no SiLU prologue")
        offs_m = tl.arange(0, 16)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs + k0)
                x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
            else:
                k_mask = (k0 + offs_k) < K
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
                x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if DOT_FP32:
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        pdl_trigger(USE_PDL)
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])
    else:
        # one [BLOCK_N, BLOCK_K] accumulator per row (unused ones are never touched)
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
            acc0 += w * _act_row(x_ptr, cols, k_mask, K, SILU_MUL, EVEN_K)[None, :]
            if M > 1:
                acc1 += w * _act_row(x_ptr + stride_xm, cols, k_mask, K, SILU_MUL, EVEN_K)[None, :]
            if M > 2:
                acc2 += w * _act_row(x_ptr + 2 * stride_xm, cols, k_mask, K, SILU_MUL, EVEN_K)[None, :]
            if M > 3:
                acc3 += w * _act_row(x_ptr + 3 * stride_xm, cols, k_mask, K, SILU_MUL, EVEN_K)[None, :]
        pdl_trigger(USE_PDL)
        _store_row(out_ptr, tl.sum(acc0, axis=1), offs_n, n_mask)
        if M > 1:
            _store_row(out_ptr + stride_om, tl.sum(acc1, axis=1), offs_n, n_mask)
        if M > 2:
            _store_row(out_ptr + 2 * stride_om, tl.sum(acc2, axis=1), offs_n, n_mask)
        if M > 3:
            _store_row(out_ptr + 3 * stride_om, tl.sum(acc3, axis=1), offs_n, n_mask)


def gemv_config(block_n: int, block_k: int, dot: bool, num_warps: int, stages: int) -> triton.Config:
    """One autotune candidate of a GEMV kernel (this one's and the FP8 GEMV's): ``BLOCK_N`` output
    columns a program, ``BLOCK_K`` a step, the broadcast or the ``tl.dot`` form, ``STAGES`` deep."""
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, "DOT": dot, "STAGES": stages},
        num_warps=num_warps,
        num_stages=stages,
    )


# The winners of a sweep over BLOCK_N 8-64, BLOCK_K 128-1024, 4/8 warps and 2-4 stages of
# both forms on the Llama-3.1-8B and 3.2-1B shapes at M = 1-4 (H200); each is the best or
# within 2% of the best for at least one of them.
BROADCAST_CONFIGS = [
    gemv_config(8, 256, False, 4, 3),
    gemv_config(8, 256, False, 4, 4),
    gemv_config(8, 512, False, 4, 3),
    gemv_config(8, 1024, False, 4, 3),
    gemv_config(16, 256, False, 4, 4),
    gemv_config(16, 512, False, 4, 4),
    gemv_config(32, 256, False, 4, 3),
    # not yet measured: a few rows of the whole K per program, for small latency-bound weights
    # (a MoE router's 128 x 2048: 5.2 µs a call with 16 programs of 8 rows, eighteenth session)
    gemv_config(4, 1024, False, 4, 3),
    gemv_config(4, 2048, False, 4, 2),
    gemv_config(2, 2048, False, 4, 2),
]
_CONFIGS = BROADCAST_CONFIGS + [
    gemv_config(64, 128, True, 4, 4),
    gemv_config(64, 256, True, 4, 4),
    gemv_config(32, 512, True, 4, 3),
    gemv_config(32, 512, True, 4, 4),
]
_INTERPRETER_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 128, "DOT": False, "STAGES": 1}
"""The one configuration under ``TRITON_INTERPRET=1`` (CPU tests): small and quick."""


def _prune(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Drop the configurations that cannot win: the dot form at M = 1 or with the SiLU prologue,
    broadcast tiles whose accumulators would spill."""
    m = kwargs.get("M", named_args.get("M"))
    silu = kwargs.get("SILU_MUL", named_args.get("SILU_MUL"))
    kept = []
    for c in configs:
        kw = c.kwargs
        if kw["DOT"]:
            if m > 1 and not silu:
                kept.append(c)
        elif m * kw["BLOCK_N"] * kw["BLOCK_K"] <= ACC_ELEMENTS:
            kept.append(c)
    return kept or configs[:1]


def autotune_bench(fn: Any, quantiles: Any = None) -> Any:
    """The autotuner's timer: Triton's (L2 flushed before each run), on a shorter budget."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_small_m_linear_kernel)
_tuned_kernel = triton.autotune(
    configs=_CONFIGS,
    key=["N", "K", "M", "SILU_MUL"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=autotune_bench,
)(_kernel)

_warmed: set[tuple[Any, ...]] = set()


def _warm_key(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> tuple[Any, ...]:
    return (x.shape[0], weight.shape[0], weight.shape[1], x.dtype, bool(silu_mul), x.get_device())


def is_warmed_up(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    """Whether :func:`small_m_linear` already ran on these shapes outside graph capture.

    Only then is a call free of autotuning and compilation, and so safe to capture in a
    CUDA graph; callers that may be capturing fall back to another path otherwise.
    """
    return _warm_key(x, weight, silu_mul) in _warmed


def _check(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and weight must share a dtype of {DTYPES}, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if not 1 <= m <= SMALL_M_MAX:
        raise ValueError(f"x must have 1 to {SMALL_M_MAX} rows, got {m}")
    if n == 0 or k == 0:
        raise ValueError(f"weight must not be empty, got {tuple(weight.shape)}")
    width = 2 * k if silu_mul else k
    if x.shape[1] != width:
        what = "2 * in_features ([gate | up])" if silu_mul else "in_features"
        raise ValueError(f"x must have {what} = {width} columns, got {x.shape[1]}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"x must have unit stride in its last dimension, got strides {x.stride()}")
    if weight.stride(1) != 1 and k > 1:
        raise ValueError(f"weight rows must be contiguous, got strides {weight.stride()}")


def _launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, silu_mul: bool, config: dict[str, Any] | None
) -> None:
    """Run the kernel, autotuned (``config`` None on a GPU) or with the given meta-parameters."""
    n, k = weight.shape
    args = (x, weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0))
    # float32 dots in IEEE precision (not TF32); the interpreter's bf16 / fp16 dot is wrong
    dot_fp32 = x.dtype == torch.float32 or triton_interpreting()
    const = dict(M=x.shape[0], SILU_MUL=silu_mul, DOT_FP32=dot_fp32, **pdl_kwargs(x))
    launch(_tuned_kernel, _kernel, n, args, const, config, _INTERPRETER_CONFIG)


def launch(
    tuned: Any,
    kernel: Any,
    n: int,
    args: tuple,
    const: dict[str, Any],
    config: dict[str, Any] | None,
    interpreter_config: dict[str, Any],
) -> None:
    """Run a kernel over ``cdiv(n, BLOCK_N)`` programs: autotuned (``tuned``) on a GPU when
    ``config`` is None, else ``kernel`` with ``config`` (``interpreter_config`` under
    ``TRITON_INTERPRET=1``, where nothing is tuned); ``STAGES`` doubles as ``num_stages``."""
    if config is None and not triton_interpreting():
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **const)
        return
    meta = dict(interpreter_config if config is None else config)
    warps = meta.pop("num_warps", 4)
    grid = (triton.cdiv(n, meta["BLOCK_N"]),)
    kernel[grid](*args, **const, **meta, num_warps=warps, num_stages=meta["STAGES"])


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of 1 to :data:`SMALL_M_MAX` rows, in one memory-bound kernel.

    ``weight`` is ``[N, K]`` (``nn.Linear`` layout) with contiguous rows; ``x`` is ``[M, K]``
    with unit column stride (any row stride), or with ``silu_mul`` ``[M, 2K]`` = ``[gate | up]``,
    in which case the result is ``(silu(gate) * up) @ weight.T`` with the activation formed
    as the kernel loads it (rounded as the unfused :func:`~fastdeploy.ops.layer_ops.silu_and_mul`).
    Accumulates in float32 and returns ``[M, N]`` in ``x.dtype``; no bias.

    Why: batch-1 decode reads every weight once per step, and this reads each weight
    element exactly once with one kernel per layer (no split-K reduce, no separate
    activation kernel). The first call of each shape autotunes and so synchronizes the
    device; later calls only allocate the output with ``torch.empty`` and launch, which
    CUDA graphs can capture.
    """
    _check(x, weight, silu_mul)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, weight, out, silu_mul, None)
    if x.is_cuda and not torch.cuda.is_current_stream_capturing():
        _warmed.add(_warm_key(x, weight, silu_mul))
    return out


def last_tuned_config() -> str | None:
    """The configuration the autotuner ran last (benchmark reports; None before any GPU call)."""
    config = getattr(_tuned_kernel, "best_config", None)
    if config is None:
        return None
    kw = config.kwargs
    form = "dot" if kw["DOT"] else "broadcast"
    return f"{form} N{kw['BLOCK_N']} K{kw['BLOCK_K']} w{config.num_warps} s{config.num_stages}"
