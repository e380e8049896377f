"""``x @ W^T + b`` for FP8 (e4m3) weights: one entry, the kernels chosen by the number of rows.

On a GPU (:func:`fp8_linear_kernels`, at most two kernel launches, no host synchronization,
no copies of the operands; the scales are used in the layout they were loaded in):

- **few rows** (decode, ``M <= small_m_max``): the w8a16 GEMV of
  :mod:`fastdeploy.ops.triton_fp8_gemv`, one kernel: the fp8 weight is dequantized in
  registers and multiplied with the activation as it is (not quantized), bias in the epilogue.
  Inside CUDA graph capture only for shapes it already ran on (its autotuning synchronizes).
- **per-channel** weights (``block = None``, scale ``[N]``): the activation quantized per token
  (one Triton kernel), then ``torch._scaled_mm`` with row-wise scales and the bias fused, or, up
  to ``FD_FP8_CHANNEL_TRITON_MAX_M`` rows, the Triton per-channel GEMM of
  :mod:`fastdeploy.ops.triton_fp8_gemm` (the same product, bias in the epilogue).
- **block-scaled** weights (``block = (bn, bk)``, scale ``[ceil(N/bn), ceil(K/bk)]``): the
  activation quantized per token and ``bk`` columns (one Triton kernel), then either
  ``torch._scaled_mm`` with 1 x 128 / 128 x 128 block-wise scales (cuBLASLt, CUDA >= 12.9 on
  sm_90, N and K in whole 128 blocks; the quantization writes its scales column-major, as that mode takes them, and the
  weight scale's transpose is a view) or the Triton w8a8 block GEMM of
  :mod:`fastdeploy.ops.triton_fp8_gemm` (any block, bias in the epilogue).

Which of these runs is an :class:`Fp8LinearBackend`, decided once per device
(``FD_FP8_SMALL_M_MAX``, ``FD_FP8_CHANNEL_TRITON_MAX_M``, ``FD_FP8_BLOCK_GEMM`` and a probe of
the block-wise ``_scaled_mm``).

The **torch** path (a CPU, or zero rows) dequantizes the same quantized operands to float32 and
multiplies there, so it computes what the w8a8 kernels compute (the activation is rounded to
fp8 too) up to the float32 summation order. It is the reference the kernels are tested against,
and what CI runs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from enum import Enum

import torch

from fastdeploy import envs
from fastdeploy.ops.fp8_quant import (
    dequantize_activation_per_token_group,
    dequantize_weight_block,
    quantize_activation_per_token,
    quantize_activation_per_token_group,
    quantize_weight_block,
)
from fastdeploy.ops.layer_ops import triton_module

logger = logging.getLogger(__name__)

SCALED_MM_BLOCK = (128, 128)
"""The only weight block ``torch._scaled_mm``'s block-wise mode takes."""
BLOCK_GEMMS = ("auto", "triton", "scaled_mm")
"""Values of ``FD_FP8_BLOCK_GEMM``."""


class Fp8Path(str, Enum):
    """The kernels one FP8 linear call runs (see the module docstring)."""

    TORCH = "torch"
    SMALL_M = "w8a16 gemv"
    SCALED_MM_ROWWISE = "quant + scaled_mm rowwise"
    TRITON_CHANNEL = "quant + triton channel gemm"
    SCALED_MM_BLOCK = "quant + scaled_mm blockwise"
    TRITON_BLOCK = "quant + triton block gemm"


@dataclass(frozen=True)
class Fp8LinearBackend:
    """How the FP8 linears of one device run, decided once (at load, not per call)."""

    small_m_max: int = 16
    """Rows up to which the w8a16 GEMV runs (0: never)."""
    block_scaled_mm: bool = False
    """Block-scaled (128 x 128) weights above ``small_m_max`` take ``torch._scaled_mm``'s
    block-wise mode (else the Triton block GEMM)."""
    channel_triton_max_m: int = 0
    """Per-channel weights above ``small_m_max`` rows and up to this many take the Triton
    per-channel GEMM (else row-wise ``_scaled_mm``)."""

    @staticmethod
    def for_device(device: torch.device) -> Fp8LinearBackend:
        """The backend of ``device`` from ``FD_FP8_SMALL_M_MAX`` / ``FD_FP8_BLOCK_GEMM`` (``auto``:
        block-wise ``_scaled_mm`` where :func:`blockwise_scaled_mm_works` says it runs here)."""
        choice = envs.FD_FP8_BLOCK_GEMM
        if choice not in BLOCK_GEMMS:
            raise ValueError(f"FD_FP8_BLOCK_GEMM must be one of {', '.join(BLOCK_GEMMS)}, got {choice!r}")
        custom = not envs.FD_DISABLE_CUSTOM_OPS and triton_module("triton_fp8_gemv") is not None
        small_m_max = max(0, envs.FD_FP8_SMALL_M_MAX) if custom else 0
        gemm = not envs.FD_DISABLE_CUSTOM_OPS and triton_module("triton_fp8_gemm") is not None
        channel_triton_max_m = max(0, envs.FD_FP8_CHANNEL_TRITON_MAX_M) if gemm else 0
        block_scaled_mm = False
        if device.type == "cuda" and choice != "triton":
            block_scaled_mm = blockwise_scaled_mm_works(device)
            if choice == "scaled_mm" and not block_scaled_mm:
                logger.warning(
                    "FD_FP8_BLOCK_GEMM=scaled_mm: block-wise torch._scaled_mm does not run here; using Triton"
                )
        return Fp8LinearBackend(small_m_max, block_scaled_mm, channel_triton_max_m)


@functools.cache
def _probe(device: torch.device) -> bool:
    try:
        return _probe_once(device)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        logger.info("block-wise torch._scaled_mm unavailable: %s", str(exc).splitlines()[0][:200])
        return False


def _probe_once(device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(256, 384, device=device, generator=g)  # 2 x 3 blocks (the path takes whole blocks)
    wq, ws = quantize_weight_block(w, SCALED_MM_BLOCK)
    for m in (1, 5, 33):
        x = torch.randn(m, 384, device=device, generator=g).to(torch.bfloat16)
        got = _scaled_mm_block(x, wq, ws, None).float()
        ref = fp8_linear_torch(x.float(), wq, ws, SCALED_MM_BLOCK)
        if not torch.isfinite(got).all() or (got - ref).norm() > 2e-2 * ref.norm():
            return False
    return True


def blockwise_scaled_mm_works(device: torch.device) -> bool:
    """Whether this torch build runs ``torch._scaled_mm`` with 1 x 128 activation and 128 x 128
    weight scales on ``device`` and gets the torch path's result (run once per device: a few
    small products of whole blocks, odd row counts included)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _probe(torch.device(device.type, index))


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    backend: Fp8LinearBackend | None = None,
) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K])^T + bias`` in ``x``'s dtype (see the module docstring).

    ``backend`` None: the device's (:meth:`Fp8LinearBackend.for_device`, cached)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.is_cuda and x2.shape[0] > 0:
        out = fp8_linear_kernels(x2, weight, weight_scale, block, bias, backend or _device_backend(x2.device))
    else:
        out = fp8_linear_torch(x2, weight, weight_scale, block)
        if bias is not None:
            out = out + bias
    return out.reshape(*lead, weight.shape[0])


@functools.cache
def _device_backend(device: torch.device) -> Fp8LinearBackend:
    return Fp8LinearBackend.for_device(device)


def fp8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """The torch path: quantize ``x [M, K]`` as the w8a8 kernels do, dequantize both operands to
    float32, multiply, and return ``[M, N]`` in ``x``'s dtype."""
    if block is None:
        xq, xs = quantize_activation_per_token(x)
        acc = (xq.float() @ weight.float().t()) * xs * weight_scale.float().view(1, -1)
        return acc.to(x.dtype)
    xq, xs = quantize_activation_per_token_group(x, block[1])
    x_real = dequantize_activation_per_token_group(xq, xs, block[1])
    w_real = dequantize_weight_block(weight, weight_scale, block)
    return (x_real @ w_real.t()).to(x.dtype)


def select_path(
    m: int,
    n: int,
    k: int,
    block: tuple[int, int] | None,
    backend: Fp8LinearBackend,
    small_m_ready: bool,
) -> Fp8Path:
    """The kernels for ``M`` rows of an ``[N, K]`` weight: the GEMV up to ``backend.small_m_max``
    rows when ``small_m_ready`` (it takes the operands and, under graph capture, is tuned),
    else activation quantization and the GEMM the weight layout calls for."""
    if m <= backend.small_m_max and small_m_ready:
        return Fp8Path.SMALL_M
    scaled_mm_shape = k % 16 == 0 and n % 16 == 0
    if block is None:
        if m <= backend.channel_triton_max_m:
            return Fp8Path.TRITON_CHANNEL
        return Fp8Path.SCALED_MM_ROWWISE if scaled_mm_shape else Fp8Path.TORCH
    whole_blocks = n % SCALED_MM_BLOCK[0] == 0 and k % SCALED_MM_BLOCK[1] == 0
    if backend.block_scaled_mm and whole_blocks and tuple(block) == SCALED_MM_BLOCK:
        return Fp8Path.SCALED_MM_BLOCK
    return Fp8Path.TRITON_BLOCK


def _small_m_ready(
    x: torch.Tensor,
    weight: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
) -> bool:
    gemv = triton_module("triton_fp8_gemv")
    if gemv is None or not gemv.supports(x, weight, block, silu_mul):
        return False
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return gemv.is_warmed_up(x, weight, block, bias is not None, silu_mul)
    return True


def fp8_norm_fusable(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    backend: Fp8LinearBackend | None = None,
) -> bool:
    """Whether :func:`fastdeploy.ops.triton_fp8_gemv.fp8_norm_small_m_linear` runs
    ``rms_norm(x + residual)`` and this linear as one kernel now: CUDA, rows within the GEMV's
    range and its norm prologue's (1-2), operands it takes, and under graph capture a tuned shape."""
    if (
        not x.is_cuda
        or x.dim() != 2
        or not 0 < x.shape[0] <= (backend or _device_backend(x.device)).small_m_max
    ):
        return False
    gemv = triton_module("triton_fp8_gemv")
    if gemv is None or not gemv.supports_norm(x, residual, norm_weight, weight, block):
        return False
    if torch.cuda.is_current_stream_capturing():
        kind = "plain" if residual is None else "add"
        return gemv.is_warmed_up(x, weight, block, bias is not None, norm=kind)
    return True


def fp8_linear_silu_mul(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    backend: Fp8LinearBackend | None = None,
) -> torch.Tensor:
    """:func:`fp8_linear` of ``silu_and_mul(gate_up)`` (``gate_up [..., 2K] = [gate | up]``): one
    kernel on a GPU for rows the GEMV fuses the activation into (decode of 1-2 rows, see
    :data:`fastdeploy.ops.triton_fp8_gemv.SILU_FUSE_MAX_M`), else the two ops."""
    from fastdeploy.ops.layer_ops import silu_and_mul

    m = gate_up.numel() // max(1, gate_up.shape[-1])
    if gate_up.is_cuda and gate_up.dim() == 2 and m > 0:
        backend = backend or _device_backend(gate_up.device)
        if m <= backend.small_m_max and _small_m_ready(gate_up, weight, block, bias, silu_mul=True):
            gemv = triton_module("triton_fp8_gemv")
            return gemv.fp8_small_m_linear(gate_up, weight, weight_scale, block, bias, silu_mul=True)
    return fp8_linear(silu_and_mul(gate_up), weight, weight_scale, block, bias, backend)


def fp8_linear_kernels(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    backend: Fp8LinearBackend,
) -> torch.Tensor:
    """The GPU path for a 2-D ``x [M, K]`` with ``M > 0`` (:func:`select_path`). It also runs on
    CPU tensors under ``TRITON_INTERPRET=1`` (how CI checks it), except the block-wise
    ``_scaled_mm``, which CPUs lack."""
    m, k = x.shape
    n = weight.shape[0]
    ready = m <= backend.small_m_max and _small_m_ready(x, weight, block, bias)
    path = select_path(m, n, k, block, backend, ready)
    if path is Fp8Path.SMALL_M:
        return triton_module("triton_fp8_gemv").fp8_small_m_linear(x, weight, weight_scale, block, bias)
    if path in (Fp8Path.SCALED_MM_ROWWISE, Fp8Path.TRITON_CHANNEL):
        xq, xs = _quant_kernels().quantize_activation_per_token(x)
        return channel_gemm(path, xq, xs, weight, weight_scale, bias, x.dtype)
    if path is Fp8Path.SCALED_MM_BLOCK:
        return _scaled_mm_block(x, weight, weight_scale, bias)
    if path is Fp8Path.TRITON_BLOCK:
        return triton_module("triton_fp8_gemm").fp8_block_linear(x, weight, weight_scale, block, bias)
    out = fp8_linear_torch(x, weight, weight_scale, block)
    return out if bias is None else out.add_(bias)


def channel_gemm(
    path: Fp8Path,
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The per-channel product of a per-token quantized activation along ``path``: row-wise
    ``_scaled_mm`` or the Triton per-channel GEMM."""
    if path is Fp8Path.TRITON_CHANNEL:
        gemm = triton_module("triton_fp8_gemm")
        return gemm.fp8_channel_gemm(xq, xs, weight, weight_scale.reshape(-1), out_dtype, bias=bias)
    return scaled_mm_rowwise(xq, xs, weight, weight_scale, bias, out_dtype)


def scaled_mm_rowwise(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_mm`` of a per-token quantized activation (``xq``, scales ``xs [M, 1]``) and a
    per-channel weight (scales ``[N]``), the bias fused where its dtype allows."""
    fuse_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1),
        bias=bias if fuse_bias else None, out_dtype=out_dtype,
    )  # fmt: skip
    return out.add_(bias) if bias is not None and not fuse_bias else out


def fp8_norm_quant_fusable(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    block: tuple[int, int] | None,
    backend: Fp8LinearBackend | None = None,
) -> bool:
    """Whether :func:`fp8_norm_quant_linear` runs ``rms_norm(x + residual)`` and this linear now: a
    per-channel weight whose rows take a quantize-then-GEMM path (more rows than the GEMV's), on
    CUDA, the activations, residual and norm weight in one 16-bit dtype."""
    if block is not None or not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
        return False
    backend = backend or _device_backend(x.device)
    m, k = x.shape
    path = select_path(m, weight.shape[0], k, None, backend, False)
    if m <= backend.small_m_max or path not in (Fp8Path.SCALED_MM_ROWWISE, Fp8Path.TRITON_CHANNEL):
        return False
    dtypes = {x.dtype, norm_weight.dtype} | ({residual.dtype} if residual is not None else set())
    if dtypes != {torch.bfloat16} and dtypes != {torch.float16}:
        return False
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        return False
    return not envs.FD_DISABLE_CUSTOM_OPS and triton_module("triton_fp8_quant") is not None


def fp8_norm_quant_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    backend: Fp8LinearBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual)), the new residual)`` for a per-channel FP8 weight: the
    residual add, the norm and the per-token quantization in one kernel
    (:func:`~fastdeploy.ops.triton_fp8_quant.add_rms_norm_quant`), then the GEMM :func:`fp8_linear`
    would run; the same bits as the norm kernel, then :func:`fp8_linear`. ``residual`` is updated in
    place (None: ``x`` is the new residual)."""
    backend = backend or _device_backend(x.device)
    path = select_path(x.shape[0], weight.shape[0], x.shape[1], None, backend, False)
    xq, xs, residual = triton_module("triton_fp8_quant").add_rms_norm_quant(x, residual, norm_weight, eps)
    return channel_gemm(path, xq, xs, weight, weight_scale, bias, x.dtype), residual


def _quant_kernels():
    """:mod:`fastdeploy.ops.triton_fp8_quant`, or :mod:`fastdeploy.ops.fp8_quant` (the torch
    versions, same results) where triton does not import or custom ops are off."""
    kernels = None if envs.FD_DISABLE_CUSTOM_OPS else triton_module("triton_fp8_quant")
    if kernels is None:
        from fastdeploy.ops import fp8_quant as kernels
    return kernels


def _scaled_mm_block(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``torch._scaled_mm`` in its block-wise mode: the 1 x 128 activation scales column-major
    (written so by the quantization kernel), the 128 x 128 weight scales' transpose (a view)."""
    kernels = triton_module("triton_fp8_quant")
    if kernels is not None and x.is_cuda:
        xq, xs = kernels.quantize_activation_per_token_group(x, 128, column_major_scale=True)
    else:  # (the probe without triton)
        xq, xs = quantize_activation_per_token_group(x, 128)
        xs = xs.t().contiguous().t()
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.t(), out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)
