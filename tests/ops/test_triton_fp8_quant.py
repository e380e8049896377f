"""The Triton per-token-group FP8 activation quantization against the torch version: identical bits
(scales and fp8 values) on random rows of very different magnitudes, zero rows, a partial last group
(under TRITON_INTERPRET=1 the final float32 -> e4m3 cast is torch's; see the module docstring)."""

from __future__ import annotations

import os

import pytest
import torch

kernel = pytest.importorskip("fastdeploy.ops.triton_fp8_quant")

from fastdeploy.ops import fp8_quant as fq  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,group", [(256, 128), (200, 128), (96, 64)])
def test_identical_to_torch(k, group, dtype):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(6, k + 8, generator=g) * 10.0 ** torch.arange(-4, 2).unsqueeze(1)  # 1e-4 .. 10
    x[2] = 0.0  # a zero row: clamped scale, zero values
    x[4, :group] *= 1e30 if dtype == torch.float32 else 1e20
    x = x.to(dtype).to(DEVICE)[:, :k]  # a row stride wider than K
    q, s = kernel.quantize_activation_per_token_group(x, group)
    q_ref, s_ref = fq.quantize_activation_per_token_group(x.cpu(), group)
    assert s.shape == s_ref.shape and q.dtype == fq.FP8_DTYPE
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [256, 200, 2500])  # 2500: several 1024-column steps and a tail
def test_per_token_identical_to_torch(k, dtype):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(6, k + 8, generator=g) * 10.0 ** torch.arange(-4, 2).unsqueeze(1)
    x[2] = 0.0
    x[4, -20] = 1e30 if dtype == torch.float32 else 1e20  # the row's maximum in its last step
    x = x.to(dtype).to(DEVICE)[:, :k]
    q, s = kernel.quantize_activation_per_token(x)
    q_ref, s_ref = fq.quantize_activation_per_token(x.cpu())
    assert s.shape == (6, 1) and q.dtype == fq.FP8_DTYPE
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def test_column_major_group_scales():
    """The layout torch._scaled_mm's 1 x 128 mode takes: strides (1, M), the same values."""
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q, s = kernel.quantize_activation_per_token_group(x, 128, column_major_scale=True)
    q_ref, s_ref = fq.quantize_activation_per_token_group(x.cpu(), 128)
    assert s.shape == (5, 3) and s.stride() == (1, 5)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no-residual"])
@pytest.mark.parametrize("k", [256, 200])
def test_add_rms_norm_quant_is_the_norm_then_the_quantization(k, with_residual, dtype):
    """``add_rms_norm_quant`` gives the bits of the norm kernel (``fused_add_rms_norm``, or
    ``rms_norm`` without a residual) followed by the per-token quantization, and the same residual."""
    from fastdeploy.ops import triton_layer_ops as lo

    g = torch.Generator().manual_seed(k + with_residual)
    scales = 10.0 ** torch.arange(-3, 3).unsqueeze(1)  # rows of 1e-3 .. 1e2
    x = (torch.randn(6, k, generator=g) * scales).to(dtype).to(DEVICE)
    residual = (torch.randn(6, k, generator=g) * scales).to(dtype).to(DEVICE) if with_residual else None
    weight = (1.0 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    if with_residual:
        normed, ref_residual = lo.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    else:
        normed, ref_residual = lo.rms_norm(x, weight, 1e-6), x
    q_ref, s_ref = kernel.quantize_activation_per_token(normed)
    x_in = x.clone()
    residual_in = residual.clone() if with_residual else None
    q, s, new_residual = kernel.add_rms_norm_quant(x, residual, weight, 1e-6)
    assert torch.equal(s.cpu(), s_ref.cpu()) and torch.isfinite(s).all()
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))
    assert torch.equal(new_residual.cpu(), ref_residual.cpu())
    if with_residual:
        assert new_residual is residual  # updated in place, as fused_add_rms_norm does
    else:
        assert new_residual is x
    # the normalized rows too (a MoE block's router reads them): the norm kernel's bits, same q
    out = torch.full_like(x_in, float("nan"))
    q2, s2, _ = kernel.add_rms_norm_quant(x_in, residual_in, weight, 1e-6, normed=out)
    assert torch.equal(out.cpu(), normed.cpu())
    assert torch.equal(q2.cpu().view(torch.uint8), q.cpu().view(torch.uint8)) and torch.equal(s2, s)


def test_norm_quant_linear_is_the_norm_then_the_fp8_linear():
    """The fused norm + per-channel FP8 linear (``fp8_norm_quant_linear``) against the norm kernel then
    ``fp8_linear``'s quantize + ``_scaled_mm`` path on the same operands: the same output bits."""
    from fastdeploy.ops import fp8_linear as fl
    from fastdeploy.ops import triton_layer_ops as lo

    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(24, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    norm_weight = (1.0 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16).to(DEVICE)
    wq, ws = fq.quantize_weight_per_channel((torch.randn(144, 256, generator=g) * 0.05).to(DEVICE))
    bias = torch.randn(144, generator=g).to(torch.bfloat16).to(DEVICE)
    residual_in = residual.clone()  # (the fused call adds into residual in place)
    normed, ref_residual = lo.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, 1e-6)
    backend = fl.Fp8LinearBackend(small_m_max=16, block_scaled_mm=False)
    ref = fl.fp8_linear_kernels(normed, wq, ws, None, bias, backend)
    out, new_residual = fl.fp8_norm_quant_linear(x, residual, norm_weight, 1e-6, wq, ws, bias, backend)
    assert torch.equal(out.cpu(), ref.cpu()) and torch.equal(new_residual.cpu(), ref_residual.cpu())
    # the Triton per-channel GEMM after the fused norm (FD_FP8_CHANNEL_TRITON_MAX_M): fp8_linear's bits too
    triton_channel = fl.Fp8LinearBackend(16, False, channel_triton_max_m=64)
    ref = fl.fp8_linear_kernels(normed, wq, ws, None, bias, triton_channel)
    out, _ = fl.fp8_norm_quant_linear(x, residual_in.clone(), norm_weight, 1e-6, wq, ws, bias, triton_channel)
    assert torch.equal(out.cpu(), ref.cpu())
    assert fl.fp8_norm_quant_fusable(x, residual, norm_weight, wq, None, triton_channel) == x.is_cuda
    # where it applies: CUDA, per-channel scales, more rows than the GEMV takes, one 16-bit dtype
    assert fl.fp8_norm_quant_fusable(x, residual, norm_weight, wq, None, backend) == x.is_cuda
    assert not fl.fp8_norm_quant_fusable(x, residual, norm_weight, wq, (128, 128), backend)
    assert not fl.fp8_norm_quant_fusable(x[:16], residual[:16], norm_weight, wq, None, backend)
    assert not fl.fp8_norm_quant_fusable(x.float(), residual, norm_weight, wq, None, backend)
