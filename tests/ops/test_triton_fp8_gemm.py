"""The FP8 linear paths (the Triton block-scaled w8a8 GEMM, the torch path of both weight layouts)
against float32/float64 references on random inputs.

Tolerances (norm-relative over the whole output; a wrong block scale, row or column is O(1)):

* Triton against the torch path on the same quantized operands, float32 output: 1e-5 (the two
  sum the same products in a different order); 5e-4 on a GPU, whose FP8 tensor-core MMAs
  accumulate with fewer mantissa bits than float32 (Hopper keeps about 22: measured 1.2e-4 on
  an H200 at 37 rows).
* either against the unquantized float64 product: 0.08. e4m3 keeps 3 mantissa bits, so each
  weight and activation element is off by at most 2^-4 relative, ~0.026 RMS; the two quantized
  operands add in quadrature over the dot products, ~0.037 (measured 0.03-0.04). Twice that
  is the bound.
* bf16 activations and output, Triton against the torch path: 2e-2 (the output rounds to bf16's
  8-bit mantissa, and the interpreter truncates instead of rounding).

On a CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, as CI runs tests/ops).
"""

from __future__ import annotations

import os

import pytest
import torch

from fastdeploy.ops import fp8_quant as fq
from fastdeploy.ops.fp8_linear import fp8_linear, fp8_linear_torch

gemm = pytest.importorskip("fastdeploy.ops.triton_fp8_gemm")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_backend = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)
QUANT_TOL = 0.08


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().to(DEVICE)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "NaN or Inf in the output"
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def _block_operands(m, n, k, block, seed, x_scale=1.0, w_scale=1.0, dtype=torch.float32):
    x = _rand(m, k, seed=seed, scale=x_scale).to(dtype)
    w = _rand(n, k, seed=seed + 1, scale=w_scale)
    wq, ws = fq.quantize_weight_block(w, block)
    return x, w, wq, ws


@needs_backend
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("block", [(128, 128), (64, 64)], ids=["128x128", "64x64"])
def test_triton_block_gemm_matches_torch_path_and_float64(m, block):
    n, k = 200, 320  # a partial weight block in N and in K (K not a multiple of the tile either)
    x, w, wq, ws = _block_operands(m, n, k, block, seed=m)
    got = gemm.fp8_block_linear(x, wq, ws, block)
    same_math = fp8_linear_torch(x.cpu(), wq.cpu(), ws.cpu(), block)
    assert _rel(got.cpu(), same_math) < (5e-4 if CUDA else 1e-5)
    assert 1e-3 < _rel(got.cpu(), x.cpu().double() @ w.cpu().double().t()) < QUANT_TOL


@needs_backend
def test_triton_block_gemm_bias_in_the_epilogue():
    x, w, wq, ws = _block_operands(7, 200, 256, (128, 128), seed=9)
    bias = _rand(200, seed=10)
    got = gemm.fp8_block_linear(x, wq, ws, (128, 128), bias)
    same_math = fp8_linear_torch(x.cpu(), wq.cpu(), ws.cpu(), (128, 128)) + bias.cpu()
    assert _rel(got.cpu(), same_math) < (5e-4 if CUDA else 1e-5)


@needs_backend
def test_triton_block_gemm_bf16():
    x, w, wq, ws = _block_operands(19, 128, 256, (128, 128), seed=7, dtype=torch.bfloat16)
    got = gemm.fp8_block_linear(x, wq, ws, (128, 128))
    assert got.dtype == torch.bfloat16
    same_math = fp8_linear_torch(x.float().cpu(), wq.cpu(), ws.cpu(), (128, 128))
    assert _rel(got.float().cpu(), same_math) < 2e-2


@needs_backend
@pytest.mark.parametrize(
    "x_scale, w_scale", [(1e3, 1e4), (1e-8, 1e-6), (1e-8, 1e4)], ids=["huge", "tiny", "mixed"]
)
def test_no_nan_or_inf_for_large_or_tiny_scales(x_scale, w_scale):
    x, w, wq, ws = _block_operands(5, 128, 256, (128, 128), seed=3, x_scale=x_scale, w_scale=w_scale)
    got = gemm.fp8_block_linear(x, wq, ws, (128, 128)).cpu()
    ref = x.cpu().double() @ w.cpu().double().t()
    assert _rel(got, ref) < QUANT_TOL  # (also asserts finiteness)


@needs_backend
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_triton_channel_gemm_matches_torch_path_and_float64(m, with_bias):
    """Per-channel weights, per-token activations (``--quantization ptpc_fp8``): both scales after
    the K loop, as row-wise ``_scaled_mm``; against the torch path on the same operands."""
    n, k = 200, 320  # N and K not multiples of the tiles
    x = _rand(m, k, seed=m + 20)
    w = _rand(n, k, seed=m + 21)
    wq, ws = fq.quantize_weight_per_channel(w)
    xq, xs = fq.quantize_activation_per_token(x)
    bias = _rand(n, seed=m + 22) if with_bias else None
    got = gemm.fp8_channel_gemm(xq, xs, wq, ws, torch.float32, bias=bias)
    same_math = fp8_linear_torch(x.cpu(), wq.cpu(), ws.cpu(), None)
    if with_bias:
        same_math = same_math + bias.cpu()
    assert _rel(got.cpu(), same_math) < (5e-4 if CUDA else 1e-5)
    ref = x.cpu().double() @ w.cpu().double().t() + (bias.cpu().double() if with_bias else 0)
    assert 1e-3 < _rel(got.cpu(), ref) < QUANT_TOL
    with pytest.raises(ValueError, match="per-channel scales"):
        gemm.fp8_channel_gemm(xq, xs, wq, ws.view(-1, 1), torch.float32)


def test_gemm_refuses_mismatched_operands():
    wq, ws = fq.quantize_weight_block(_rand(128, 256, seed=0))
    xq, xs = fq.quantize_activation_per_token_group(_rand(4, 256, seed=1))
    with pytest.raises(ValueError, match="scales"):
        gemm.fp8_block_gemm(xq, xs[:, :1], wq, ws, (128, 128), torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemm.fp8_block_gemm(xq.float(), xs, wq, ws, (128, 128), torch.float32)


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
@pytest.mark.parametrize("scale", [1.0, 1e-7, 1e4], ids=["unit", "tiny", "huge"])
def test_torch_path_matches_float64(block, scale):
    x = _rand(3, 7, 160, seed=11, scale=scale).cpu()  # leading dims are kept
    w = _rand(96, 160, seed=12).cpu()
    bias = _rand(96, seed=13).cpu()
    if block is None:
        wq, ws = fq.quantize_weight_per_channel(w)
    else:
        wq, ws = fq.quantize_weight_block(w, block)
    got = fp8_linear(x, wq, ws, block, bias)
    assert got.shape == (3, 7, 96)
    ref = x.double() @ w.double().t() + bias.double()
    assert 1e-3 * (scale >= 1) < _rel(got, ref) < QUANT_TOL
