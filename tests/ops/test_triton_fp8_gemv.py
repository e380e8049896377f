"""The w8a16 FP8 GEMV (:mod:`fastdeploy.ops.triton_fp8_gemv`) against a float64 reference on the
dequantized weight, on random inputs: per-channel and block scales, both kernel forms, N and K
tails, a bias, strided rows.

Tolerances (norm-relative over the output; a wrong scale, row or column is O(1)):

* float32 activations: 1e-5. The weight dequantizes exactly (an e4m3 value times a float32
  scale), the activation is not quantized, so only the float32 summation order differs
  (measured ~1e-7).
* bf16 activations and output: 8e-3 on a GPU, 1e-2 in the interpreter. The output is rounded
  once to bf16's 8-bit mantissa (2^-9 relative, ~3e-3 measured); the interpreter truncates
  instead of rounding.

On a CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, as CI runs tests/ops).
"""

from __future__ import annotations

import os

import pytest
import torch

gemv = pytest.importorskip("fastdeploy.ops.triton_fp8_gemv")

from fastdeploy.ops import fp8_quant as fq  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_backend = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)
BROADCAST = {"BLOCK_N": 16, "BLOCK_K": 256, "DOT": False, "STAGES": 2}
"""BLOCK_K spans several 64/128-column scale blocks: the per-column scale gather."""
DOT = {"BLOCK_N": 32, "BLOCK_K": 64, "DOT": True, "STAGES": 2}
BLOCKS = [None, (128, 128), (64, 128), (128, 64)]
BLOCK_IDS = ["per-channel", "128x128", "64x128", "128x64"]


def _tol(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-5
    return 8e-3 if CUDA else 1e-2


def _operands(m, n, k, block, dtype, seed, bias=True, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + row_pad, generator=g)[:, :k].to(dtype)
    # rows of very different magnitudes: a scale applied to the wrong rows or blocks shows
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n).unsqueeze(1)
    wq, ws = fq.quantize_weight_per_channel(w) if block is None else fq.quantize_weight_block(w, block)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(x), to(wq), to(ws), to(b)


def _reference(x, wq, ws, block, bias):
    if block is None:
        w = wq.cpu().double() * ws.cpu().double().unsqueeze(1)
    else:
        w = fq.dequantize_weight_block(wq.cpu(), ws.cpu(), block, torch.float64)
    out = x.cpu().double() @ w.t()
    return out if bias is None else out + bias.cpu().double()


def _rel(got, ref) -> float:
    assert not got.isnan().any(), "unwritten (NaN) outputs"
    return ((got.cpu().double() - ref).norm() / ref.norm()).item()


def _run(x, wq, ws, block, bias, config):
    out = torch.full((x.shape[0], wq.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    gemv.launch_kernel(x, wq, ws, block, bias, out, config)
    return out


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS, ids=BLOCK_IDS)
def test_matches_float64_reference(block, dtype):
    """The default path (autotuned on a GPU) at every padded row count up to 16, with tails."""
    n, k = 136, 320  # partial last blocks in N and K
    for m in (1, 2, 3, 4, 7, 16) if CUDA else (1, 16):  # (the forms at 3 rows: below)
        x, wq, ws, b = _operands(m, n, k, block, dtype, seed=m, bias=m % 2 == 1)
        out = gemv.fp8_small_m_linear(x, wq, ws, block, b)
        assert out.shape == (m, n) and out.dtype == dtype
        err = _rel(out, _reference(x, wq, ws, block, b))
        assert err < _tol(dtype), f"M={m}: relative error {err}"


@needs_backend
@pytest.mark.parametrize("block", BLOCKS, ids=BLOCK_IDS)
@pytest.mark.parametrize("m", [1, 3, 4])
def test_broadcast_form(block, m):
    x, wq, ws, b = _operands(m, 96, 512, block, torch.float32, seed=10 + m, row_pad=24)
    assert x.stride(0) > x.shape[1]
    err = _rel(_run(x, wq, ws, block, b, BROADCAST), _reference(x, wq, ws, block, b))
    assert err < 1e-5, f"relative error {err}"


@needs_backend
@pytest.mark.parametrize("block", BLOCKS, ids=BLOCK_IDS)
@pytest.mark.parametrize("m", [2, 5, 17, 40, 130])
def test_dot_form(block, m):
    """Row tiles of 16, 32 and 64 rows (the padded rows masked); 130 rows: three 64-row programs."""
    x, wq, ws, b = _operands(m, 72, 200, block, torch.float32, seed=20 + m)
    err = _rel(_run(x, wq, ws, block, b, DOT), _reference(x, wq, ws, block, b))
    assert err < 1e-5, f"relative error {err}"


@needs_backend
def test_no_nan_or_inf_for_large_or_tiny_scales():
    for w_scale, x_scale in ((1e4, 1e3), (1e-6, 1e-8)):
        x, wq, ws, _ = _operands(3, 128, 256, (128, 128), torch.float32, seed=5)
        ws = ws * w_scale
        x = x * x_scale
        out = gemv.fp8_small_m_linear(x, wq, ws, (128, 128))
        assert torch.isfinite(out).all()
        assert _rel(out, _reference(x, wq, ws, (128, 128), None)) < 1e-5


def test_configs_that_do_not_fit_are_pruned():
    """The broadcast form only up to 4 rows and with BLOCK_N dividing the scale block's rows; the
    dot form from 2 rows and with BLOCK_K dividing its columns; every call keeps some config."""
    for m_pad in (1, 2, 4, 8, 16, 32, 64):
        for group_n, group_k in ((1, 0), (128, 128), (64, 128), (128, 64)):
            kept = [c for c in gemv._CONFIGS if gemv.config_fits(c.kwargs, m_pad, group_n, group_k)]
            assert kept, (m_pad, group_n, group_k)
            for c in kept:
                kw = c.kwargs
                if kw["DOT"]:
                    assert m_pad > 1 and (group_k == 0 or group_k % kw["BLOCK_K"] == 0)
                else:
                    assert m_pad <= 4 and (group_k == 0 or group_n % kw["BLOCK_N"] == 0)
    assert not gemv.config_fits(BROADCAST, 8, 128, 128)
    assert not gemv.config_fits(DOT, 1, 128, 128)
    assert not gemv.config_fits({"BLOCK_N": 32, "BLOCK_K": 256, "DOT": True}, 4, 128, 128)
    # the broadcast form's accumulators: twice the tile with twice the warps, not past that
    wide = {"BLOCK_N": 16, "BLOCK_K": 2048, "DOT": False}
    assert not gemv.config_fits(wide, 1, 1, 0) and gemv.config_fits({**wide, "num_warps": 8}, 1, 1, 0)
    assert not gemv.config_fits({**wide, "num_warps": 8}, 2, 1, 0)


def test_supports_and_validation():
    x = torch.randn(2, 256)
    wq, ws = fq.quantize_weight_block(torch.randn(128, 256))
    assert gemv.supports(x, wq, (128, 128))
    assert not gemv.supports(torch.randn(gemv.MAX_M + 1, 256), wq, (128, 128))
    assert not gemv.supports(x, wq.float(), (128, 128))  # not fp8
    assert not gemv.supports(x.t().contiguous().t(), wq, (128, 128))  # column stride
    assert not gemv.supports(x, wq, (96, 128))  # not a power of two
    assert not gemv.supports(x, wq, (32, 128))  # under 64
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemv.fp8_small_m_linear(x, wq.float(), ws, (128, 128))
    with pytest.raises(ValueError, match="scale must be float32"):
        gemv.fp8_small_m_linear(x, wq, ws[:, :1], (128, 128))
    with pytest.raises(ValueError, match="bias"):
        gemv.fp8_small_m_linear(x, wq, ws, (128, 128), torch.randn(3))


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "128x128"])
@pytest.mark.parametrize("m", [1, 2])
def test_silu_mul_prologue_equals_unfused(m, block, dtype):
    """down_proj(silu_and_mul(gate_up)) in one kernel: the activation rounded as the unfused ops
    round it (silu to the dtype, the product again), so only the summation order differs."""
    from fastdeploy.ops.layer_ops import silu_and_mul

    k = 320
    gate_up, wq, ws, b = _operands(m, 136, 2 * k, None, dtype, seed=30 + m)
    _, wq, ws, _ = _operands(m, 136, k, block, dtype, seed=40 + m)
    fused = gemv.fp8_small_m_linear(gate_up, wq, ws, block, b, silu_mul=True)
    act = silu_and_mul(gate_up.cpu()).to(DEVICE)
    # bf16: the activation is rounded twice more, which the interpreter truncates (as in
    # test_triton_gemv): 2e-2 there
    tol = _tol(dtype) if dtype == torch.float32 or CUDA else 2e-2
    assert _rel(fused, _reference(act, wq, ws, block, b)) < tol
    unfused = gemv.fp8_small_m_linear(act, wq, ws, block, b)
    assert _rel(fused, unfused.cpu().double()) < tol


def test_silu_mul_limits():
    wq, ws = fq.quantize_weight_block(torch.randn(128, 256))
    assert gemv.supports(torch.randn(2, 512), wq, (128, 128), silu_mul=True)
    assert not gemv.supports(torch.randn(3, 512), wq, (128, 128), silu_mul=True)  # > SILU_FUSE_MAX_M
    assert not gemv.supports(torch.randn(1, 256), wq, (128, 128), silu_mul=True)  # not [gate | up]
    assert not gemv.config_fits({"BLOCK_N": 32, "BLOCK_K": 64, "DOT": True}, 2, 128, 128, silu_mul=True)
    with pytest.raises(ValueError, match=r"2K \(\[gate \| up\]\)"):
        gemv.fp8_small_m_linear(torch.randn(1, 256), wq, ws, (128, 128), silu_mul=True)


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "128x128"])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("has_res", [False, True], ids=["no-residual", "residual"])
def test_norm_prologue_equals_unfused(has_res, m, block, dtype):
    """qkv / gate_up of rms_norm(x + residual) in one kernel against the unfused norm then the
    dequantized product: the new residual exactly (on a GPU; the interpreter truncates the bf16
    sum: one ulp), the output within the tolerance (the fused path does not round the
    normalized input, the unfused one does: bf16 noise)."""
    from fastdeploy.ops.layer_ops import fused_add_rms_norm, rms_norm

    x, wq, ws, b = _operands(m, 136, 320, block, dtype, seed=50 + m)
    g = torch.Generator().manual_seed(60 + m)
    residual = torch.randn(m, 320, generator=g).to(dtype).to(DEVICE) if has_res else None
    norm_w = (1 + 0.3 * torch.randn(320, generator=g)).to(dtype).to(DEVICE)
    out, res_out = gemv.fp8_norm_small_m_linear(x, residual, norm_w, 1e-6, wq, ws, block, b)
    if has_res:
        hidden, res_ref = fused_add_rms_norm(x.cpu().clone(), residual.cpu().clone(), norm_w.cpu(), 1e-6)
    else:
        hidden, res_ref = rms_norm(x.cpu(), norm_w.cpu(), 1e-6), x.cpu()
    if dtype == torch.float32 or CUDA:
        assert torch.equal(res_out.cpu(), res_ref)
    else:
        assert _rel(res_out, res_ref.double()) < 1e-2
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(out, _reference(hidden, wq, ws, block, b)) < tol


def test_norm_limits():
    wq, _ = fq.quantize_weight_block(torch.randn(128, 256))
    x, nw = torch.randn(2, 256), torch.ones(256)
    assert gemv.supports_norm(x, None, nw, wq, (128, 128))
    assert gemv.supports_norm(x, torch.randn(2, 256), nw, wq, (128, 128))
    assert not gemv.supports_norm(torch.randn(3, 256), None, nw, wq, (128, 128))  # > NORM_FUSE_MAX_M
    assert not gemv.supports_norm(x, torch.randn(1, 256), nw, wq, (128, 128))  # residual shape
    assert not gemv.supports_norm(x, None, torch.ones(255), wq, (128, 128))
    assert not gemv.config_fits({"BLOCK_N": 8, "BLOCK_K": 64, "DOT": False}, 4, 128, 128, norm=True)
    assert not gemv.config_fits({"BLOCK_N": 32, "BLOCK_K": 64, "DOT": True}, 2, 128, 128, norm=True)
