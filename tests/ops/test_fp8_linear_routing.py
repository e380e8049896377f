"""Which kernels an FP8 linear runs (:mod:`fastdeploy.ops.fp8_linear`), what each path computes,
and that the GPU path's Python glue stays minimal: no host synchronization, no copies or dtype
conversions of the operands, at most two kernel launches, the output allocated once.

The GPU path runs here on CPU tensors: its Triton kernels in the interpreter
(``TRITON_INTERPRET=1``) and ``torch._scaled_mm`` row-wise on the CPU (the block-wise mode has no
CPU implementation; its routing is checked by :func:`select_path`).

Tolerances: paths that quantize the activation (w8a8) against the torch path on the same
quantized operands, 1e-5 in float32 (summation order only); the w8a16 GEMV against the float64
product with the dequantized weight, 1e-5 (it does not quantize the activation).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastdeploy.ops import fp8_linear as fl
from fastdeploy.ops import fp8_quant as fq

pytest.importorskip("fastdeploy.ops.triton_fp8_gemv")
interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the GPU path on CPU tensors in the Triton interpreter",
)
BACKEND = fl.Fp8LinearBackend(small_m_max=16, block_scaled_mm=False)
VIEW_OPS = {
    "view",
    "t",
    "transpose",
    "reshape",
    "_unsafe_view",
    "as_strided",
    "unsqueeze",
    "expand",
    "detach",
}
SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "allclose"}


def test_select_path_by_rows_layout_and_backend():
    path = fl.select_path
    both = fl.Fp8LinearBackend(small_m_max=16, block_scaled_mm=True)
    for block in (None, (128, 128)):
        assert path(1, 4096, 4096, block, BACKEND, True) is fl.Fp8Path.SMALL_M
        assert path(16, 4096, 4096, block, BACKEND, True) is fl.Fp8Path.SMALL_M
        # not tuned yet inside a graph capture (or the GEMV refuses the operands): the GEMM path
        assert path(1, 4096, 4096, block, BACKEND, False) is not fl.Fp8Path.SMALL_M
        assert path(1, 4096, 4096, block, fl.Fp8LinearBackend(0, False), True) is not fl.Fp8Path.SMALL_M
    assert path(17, 4096, 4096, None, BACKEND, True) is fl.Fp8Path.SCALED_MM_ROWWISE
    triton_channel = fl.Fp8LinearBackend(16, False, channel_triton_max_m=256)
    assert path(16, 4096, 4096, None, triton_channel, True) is fl.Fp8Path.SMALL_M
    assert path(17, 4096, 4096, None, triton_channel, True) is fl.Fp8Path.TRITON_CHANNEL
    assert path(256, 4100, 4096, None, triton_channel, True) is fl.Fp8Path.TRITON_CHANNEL  # any N
    assert path(257, 4096, 4096, None, triton_channel, True) is fl.Fp8Path.SCALED_MM_ROWWISE
    assert path(64, 4096, 4096, (128, 128), triton_channel, True) is fl.Fp8Path.TRITON_BLOCK
    assert path(17, 4100, 4096, None, BACKEND, True) is fl.Fp8Path.TORCH  # N % 16 != 0
    assert path(17, 4096, 4096, (128, 128), BACKEND, True) is fl.Fp8Path.TRITON_BLOCK
    assert path(17, 4096, 4096, (128, 128), both, True) is fl.Fp8Path.SCALED_MM_BLOCK
    assert path(8192, 4096, 4096, (128, 128), both, True) is fl.Fp8Path.SCALED_MM_BLOCK
    assert path(17, 4096, 4096, (128, 64), both, True) is fl.Fp8Path.TRITON_BLOCK  # not 128 x 128
    assert path(17, 4096, 4104, (128, 128), both, True) is fl.Fp8Path.TRITON_BLOCK  # K % 16 != 0
    assert path(17, 4096, 4112, (128, 128), both, True) is fl.Fp8Path.TRITON_BLOCK  # K % 128 != 0
    assert path(17, 4160, 4096, (128, 128), both, True) is fl.Fp8Path.TRITON_BLOCK  # N % 128 != 0


def test_backend_from_environment(monkeypatch):
    monkeypatch.setenv("FD_FP8_SMALL_M_MAX", "8")
    monkeypatch.delenv("FD_FP8_CHANNEL_TRITON_MAX_M", raising=False)
    cpu = torch.device("cpu")
    assert fl.Fp8LinearBackend.for_device(cpu) == fl.Fp8LinearBackend(8, False, 512)  # the default
    monkeypatch.setenv("FD_FP8_CHANNEL_TRITON_MAX_M", "256")
    assert fl.Fp8LinearBackend.for_device(cpu) == fl.Fp8LinearBackend(8, False, 256)
    monkeypatch.setenv("FD_DISABLE_CUSTOM_OPS", "1")
    assert fl.Fp8LinearBackend.for_device(cpu).small_m_max == 0
    assert fl.Fp8LinearBackend.for_device(cpu).channel_triton_max_m == 0
    monkeypatch.setenv("FD_FP8_BLOCK_GEMM", "cutlass")
    with pytest.raises(ValueError, match="FD_FP8_BLOCK_GEMM"):
        fl.Fp8LinearBackend.for_device(cpu)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched outside Triton kernel launches, and the launches."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counter(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    mode = _OpCounter()
    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        mode.launches += 1
        mode.paused = True
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.paused = False

    monkeypatch.setattr(InterpretedFunction, "run", counted_run)
    return mode


def _operands(m, n, k, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    wq, ws = fq.quantize_weight_per_channel(w) if block is None else fq.quantize_weight_block(w, block)
    return x, wq, ws, torch.randn(n, generator=g)


def _dequantized(wq, ws, block):
    if block is None:
        return wq.double() * ws.double().unsqueeze(1)
    return fq.dequantize_weight_block(wq, ws, block, torch.float64)


def _rel(got, ref) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@interpreter
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
def test_small_m_is_one_kernel_and_w8a16(block, counter):
    x, wq, ws, bias = _operands(3, 136, 256, block)
    with counter:
        out = fl.fp8_linear_kernels(x, wq, ws, block, bias, BACKEND)
    assert counter.launches == 1
    others = {op: c for op, c in counter.ops.items() if op not in VIEW_OPS}
    assert others == {"empty": 1}, others  # the output; bias and scales inside the kernel
    ref = x.double() @ _dequantized(wq, ws, block).t() + bias.double()
    assert _rel(out, ref) < 1e-5


@interpreter
@pytest.mark.parametrize(
    "block, expected",
    [
        (None, {"empty": 2, "_scaled_mm": 1}),  # quantized x and its scale; bias fused
        ((128, 128), {"empty": 3}),  # quantized x, its scale, the output; bias in the epilogue
    ],
    ids=["per-channel scaled_mm", "block triton"],
)
def test_larger_m_is_quant_plus_gemm(block, expected, counter):
    x, wq, ws, bias = _operands(19, 144, 256, block, seed=1)
    x = x.to(torch.bfloat16)
    bias = bias.to(torch.bfloat16)
    with counter:
        out = fl.fp8_linear_kernels(x, wq, ws, block, bias, BACKEND)
    assert counter.launches == (1 if block is None else 2)
    others = {op: c for op, c in counter.ops.items() if op not in VIEW_OPS}
    assert not SYNC_OPS & set(others), others
    # the interpreter stores the quantized activation in float32 and torch casts it (see
    # triton_fp8_quant): the one conversion here, absent on a GPU
    assert others.pop("_to_copy", 0) == 1
    assert others == expected, others
    assert out.dtype == torch.bfloat16
    ref = fl.fp8_linear_torch(x.float(), wq, ws, block) + bias.float()
    assert _rel(out.float(), ref) < 1e-2  # bf16 output and bias rounding


@interpreter
@pytest.mark.parametrize("block", [None, (128, 128), (128, 64)], ids=["per-channel", "128x128", "128x64"])
@pytest.mark.parametrize("m", [1, 16, 17, 33])
def test_every_row_count_matches_its_reference(block, m):
    """Rows up to ``small_m_max`` take the GEMV (w8a16: the activation as it is); more rows the
    w8a8 GEMMs, equal to the torch path on the same quantized operands."""
    x, wq, ws, _ = _operands(m, 136 if block else 144, 256, block, seed=m)
    out = fl.fp8_linear_kernels(x, wq, ws, block, None, BACKEND)
    if m <= BACKEND.small_m_max:
        ref = x.double() @ _dequantized(wq, ws, block).t()
    else:
        ref = fl.fp8_linear_torch(x, wq, ws, block)
    assert _rel(out, ref) < 1e-5
