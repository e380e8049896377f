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
