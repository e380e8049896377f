"""Linear layer: oneDNN weight prepacking on CPU, the Triton small-M kernel for GPU decode."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from fastdeploy import envs
from fastdeploy.model_executor.layers.weight_loading import ShardId, copy_rows, set_weight_loader
from fastdeploy.ops.layer_ops import silu_and_mul, triton_module

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.quantization.base import QuantizationConfig

_SMALL_M_DTYPES = (torch.bfloat16, torch.float16)
_SMALL_M_MAX = 4
"""``triton_gemv.SMALL_M_MAX``, here so that a prefill or a large batch is turned away
before triton is imported."""


_graph_warm_up = False
"""True inside :func:`small_m_graph_warm_up`."""

CPU_INVARIANT_ROWS = 32
"""With ``FD_CPU_BATCH_INVARIANT``, CPU matmuls take 2 to this many rows a call. oneDNN picks its
kernel by the row count, and a row's bits by that kernel: on the dev CPU (AMX) every count from 2 to
32 gives a row the same bits, one row another kernel and counts above 32 a third, so a request's
logits changed in the last bits with the prompts that shared its step (tests/engine/test_sampling_e2e.py
checks the engine's tokens and logprobs alone and beside chunked prefills and another request). The
price: prefill matmuls in 32-row calls (a CPU prefill ~1.8x slower, docs/benchmarks.md); a single
row computed beside a zero row costs nothing measurable."""


def rows_invariant(x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``matmul(x)`` for ``x [M, K]`` with each row's result independent of the other rows: on a
    CPU with ``FD_CPU_BATCH_INVARIANT``, in calls of 2 to :data:`CPU_INVARIANT_ROWS` rows (a single
    row padded with a zero row); on a GPU, or without the setting, one call."""
    rows = x.shape[0]
    if (
        x.is_cuda
        or x.dim() != 2
        or not envs.FD_CPU_BATCH_INVARIANT
        or 1 < rows <= CPU_INVARIANT_ROWS
        or rows == 0
    ):
        return matmul(x)
    parts = []
    for start in range(0, rows, CPU_INVARIANT_ROWS):
        part = x[start : start + CPU_INVARIANT_ROWS]
        if part.shape[0] == 1:
            parts.append(matmul(torch.cat([part, torch.zeros_like(part)]))[:1])
        else:
            parts.append(matmul(part))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@contextlib.contextmanager
def small_m_graph_warm_up() -> Iterator[None]:
    """Eager calls inside take the small-M kernel (autotuning each new shape): the warm-up
    forward before a CUDA graph capture, so that the capture finds every shape tuned."""
    global _graph_warm_up
    previous, _graph_warm_up = _graph_warm_up, True
    try:
        yield
    finally:
        _graph_warm_up = previous


def load_triton_gemv() -> ModuleType | None:
    """:mod:`fastdeploy.ops.triton_gemv`, or None where triton does not import."""
    return triton_module("triton_gemv")


def load_triton_norm_gemv() -> ModuleType | None:
    """:mod:`fastdeploy.ops.triton_norm_gemv`, or None where triton does not import."""
    return triton_module("triton_norm_gemv")


def _small_m_gate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    max_rows: int,
    is_warm: Callable[[], bool],
    capturing: bool | None,
) -> bool:
    """The checks every small-M kernel shares (see :func:`small_m_eligible`)."""
    if x.dim() != 2 or not 0 < x.shape[0] <= max_rows or bias is not None:
        return False
    if capturing is None:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not (is_warm() if capturing else _graph_warm_up):
        return False  # a cold capture, or an eager call outside the graph warm-up
    if not envs.FD_SMALL_M_GEMV or envs.FD_DISABLE_CUSTOM_OPS:
        return False
    if x.dtype not in _SMALL_M_DTYPES or weight.dtype != x.dtype or weight.dim() != 2:
        return False
    return x.stride(-1) == 1 and weight.stride(-1) == 1


def small_m_eligible(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
    capturing: bool | None = None,
) -> bool:
    """Whether ``x @ weight.T`` (of ``silu_and_mul(x)`` with ``silu_mul``) takes the Triton
    small-M kernel (:mod:`fastdeploy.ops.triton_gemv`).

    Shapes: a 2-D bf16 / fp16 ``x`` of 1 to 4 rows (1 to ``SILU_FUSE_MAX_M`` with
    ``silu_mul``) and unit column stride, a matching weight, no bias; ``FD_SMALL_M_GEMV``
    on, ``FD_DISABLE_CUSTOM_OPS`` off, triton importable. The device is the caller's
    check (``x.is_cuda`` first: CPU tensors never get here).

    When: the kernel pays off inside CUDA graphs only. A launch from Python costs about
    30 µs of host time against cuBLAS's 10 (H200 host, Triton 3.6), and eager batch-1
    decode is host-bound (the 1B model's step grew from 4.8 to 6.1 ms). So eager calls
    keep cuBLAS except inside :func:`small_m_graph_warm_up` (the warm-up forward before
    each graph capture, which autotunes the shapes), and a call being captured takes the
    kernel once its shape is warm (autotuning synchronizes, which capture forbids).
    ``capturing`` None asks torch whether the current stream is capturing.
    """
    if x.dim() != 2 or not 0 < x.shape[0] <= _SMALL_M_MAX:
        return False  # a prefill or a large batch: turned away before triton is imported
    gemv = load_triton_gemv()
    if gemv is None:
        return False
    max_rows = gemv.SILU_FUSE_MAX_M if silu_mul else _SMALL_M_MAX
    if not _small_m_gate(
        x, weight, bias, max_rows, lambda: gemv.is_warmed_up(x, weight, silu_mul), capturing
    ):
        return False
    return x.shape[1] == (2 if silu_mul else 1) * weight.shape[1]


def norm_fusable(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    rotary: object | None = None,
    capturing: bool | None = None,
) -> bool:
    """Whether ``rms_norm(x + residual) @ weight.T`` (with ``rotary``, also the rotary embedding
    and cache write) takes one Triton kernel (:mod:`fastdeploy.ops.triton_norm_gemv`).

    The rules of :func:`small_m_eligible` (graphs only, warmed shapes), for 1 to
    ``NORM_FUSE_MAX_M`` rows and a residual laid out like ``x``; ``FD_SMALL_M_NORM_FUSION``
    turns it off.
    """
    if x.dim() != 2 or not 0 < x.shape[0] <= _SMALL_M_MAX:
        return False
    fused = load_triton_norm_gemv()
    if fused is None:
        return False

    def is_warm() -> bool:
        return fused.is_warmed_up(x, weight, residual is not None, rotary)

    if not _small_m_gate(x, weight, bias, fused.NORM_FUSE_MAX_M, is_warm, capturing):
        return False  # (eager steps outside the graph warm-up stop here, cheaply)
    if not envs.FD_SMALL_M_NORM_FUSION:
        return False
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        return False
    return x.shape[1] == weight.shape[1]


def small_m_context(x: torch.Tensor) -> bool:
    """Whether a small-M kernel may run for ``x`` now: inside :func:`small_m_graph_warm_up` or a
    CUDA graph capture. A cheap first test for callers that build arguments before asking."""
    return _graph_warm_up or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def cpu_prepack_supported(dtype: torch.dtype) -> bool:
    """True when oneDNN can prepack ``dtype`` weights on this CPU (bf16 with AVX512-BF16/AMX)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if dtype != torch.bfloat16 or ops is None or not hasattr(ops, "_reorder_linear_weight"):
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be reordered once into oneDNN's blocked layout.

    Plain ``F.linear`` reorders the weight on every call; prepacking saves that
    (10% at batch 64, 2x at batch 1 on the CI CPU) with bit-identical results.
    The packed copy is read-only: call :meth:`prepack` again after changing
    ``weight``. On a GPU, with ``FD_SMALL_M_GEMV``, decode steps of at most four rows
    run the Triton small-M kernel inside CUDA graphs (:func:`small_m_eligible`).

    With a ``quant_config`` the layer's :attr:`quant_method` owns the weight (its dtype, its
    scales and the matmul; the small-M kernels, bf16 only, are off). ``weight_shapes`` (the
    parallel layers) gives the weight and bias loaders that copy :meth:`weight_region` of each
    full checkpoint tensor, so that quantization scales can be sharded by the same regions.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        weight_shapes: dict[ShardId, tuple[int, int]] | None = None,
        **kwargs,
    ):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.packed_weight: torch.Tensor | None = None
        self.small_m_gemv = envs.FD_SMALL_M_GEMV
        """``FD_SMALL_M_GEMV`` when the layer was built: off, forward pays one attribute read for it."""
        if weight_shapes is not None:
            set_weight_loader(self.weight, self.load_weight, weight_shapes)
            if self.bias is not None:
                shapes = {shard: shape[:1] for shard, shape in weight_shapes.items()}
                set_weight_loader(self.bias, self.load_weight, shapes)
        self.quant_method = None if quant_config is None else quant_config.linear_method()
        if self.quant_method is not None:
            self.small_m_gemv = False
            self.quant_method.create_weights(self)

    def weight_region(self, shard_id: ShardId = None) -> tuple[int, int, int, int]:
        """Where checkpoint tensor ``shard_id`` goes: ``(dim, offset in this rank's weight, size,
        start in the full tensor)`` (dim 0: output rows, dim 1: input columns). Here the whole tensor."""
        return 0, 0, self.out_features, 0

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's :meth:`weight_region` of the full checkpoint tensor into ``param`` (the
        weight, or the bias: its rows, or all of it when the input columns are split)."""
        dim, offset, size, start = self.weight_region(shard_id)
        if param.dim() == 1 and dim == 1:
            param.data.copy_(loaded)
        else:
            copy_rows(param.data.narrow(dim, offset, size), loaded, dim, start)

    def process_weights_after_loading(self) -> None:
        """The quantization method's post-load step (quantize the loaded weight, ...), if any."""
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)

    def prepack(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` on this process's weight (the shard, in a parallel layer)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        if self.small_m_gemv and x.is_cuda and small_m_eligible(x, self.weight, bias):
            return load_triton_gemv().small_m_linear(x, self.weight)
        return rows_invariant(x, lambda rows: self._dense_matmul(rows, bias))

    def _dense_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return nn.functional.linear(x, self.weight, bias)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))`` for ``gate_up = [gate | up]``: one Triton kernel for
        small-M decode on a GPU (the activation formed as the weights stream), else the two ops."""
        return self.matmul_silu_mul(gate_up, self.bias)

    def matmul_silu_mul(self, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """:meth:`matmul` of ``silu_and_mul(gate_up)``, fused where :meth:`forward_silu_mul` says."""
        if self.quant_method is not None:
            return self.quant_method.apply_silu_mul(self, gate_up, bias)
        if self.small_m_gemv and gate_up.is_cuda and small_m_eligible(gate_up, self.weight, bias, True):
            return load_triton_gemv().small_m_linear(gate_up, self.weight, silu_mul=True)
        return self.matmul(silu_and_mul(gate_up), bias)

    def fuses_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: object | None = None
    ) -> bool:
        """Whether :meth:`forward_normed` runs as one kernel here (with ``rotary``: the qkv
        projection's rotary embedding and cache write too); see :func:`norm_fusable`."""
        return self.small_m_gemv and x.is_cuda and norm_fusable(x, self.weight, self.bias, residual, rotary)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, rotary: object | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(norm(x + residual))`` and the new residual (``x`` when ``residual`` is None).

        Small-M decode on a GPU runs the norm inside the linear (one kernel where there
        were two); elsewhere the norm runs first. ``rotary`` (a
        :class:`~fastdeploy.ops.triton_norm_gemv.RotaryCache`) also rotates q and k and writes
        the cache; pass it only when :meth:`fuses_norm` said yes for it.
        """
        if self.quant_method is not None and rotary is None:
            fused = self.quant_method.apply_normed(self, x, residual, norm)
            if fused is not None:
                return fused
        if rotary is not None or self.fuses_norm(x, residual):
            fused = load_triton_norm_gemv()
            return fused.norm_small_m_linear(x, residual, norm.weight, norm.eps, self.weight, rotary)
        if residual is None:
            return self(norm(x)), x
        hidden, residual = norm(x, residual)
        return self(hidden), residual


def prepack_linear_weights(model: nn.Module) -> int:
    """Prepack every :class:`Linear` of a CPU model whose dtype supports it; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu":
            if cpu_prepack_supported(module.weight.dtype):
                module.prepack()
                count += 1
    return count
