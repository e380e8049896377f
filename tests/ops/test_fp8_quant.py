"""FP8 quantization helpers against float32 math on random inputs, tiny and huge magnitudes included.

Error bound per element (what e4m3 allows): a normal e4m3 value has 3 mantissa bits, so rounding
to nearest is off by at most 2^-4 of the value; below 2^-6 (e4m3's smallest normal, in units of the
scale) the spacing is a fixed 2^-9, so the absolute error is at most 2^-10 * scale there. Hence
``|x - dequant(x)| <= 2^-4 |x| + 2^-10 scale`` (plus float32 noise), asserted element-wise.
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy.ops import fp8_quant as fq


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # per-row magnitudes spread over several decades, so scales differ from row to row
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    mags = 10.0 ** torch.empty(shape[:-1] + (1,), dtype=torch.float64).uniform_(-3, 3, generator=g)
    return (x * mags).to(dtype)


def _assert_within_e4m3(x: torch.Tensor, deq: torch.Tensor, scale_full: torch.Tensor) -> None:
    x, deq, scale_full = x.double(), deq.double(), scale_full.double()
    assert torch.isfinite(deq).all() and torch.isfinite(scale_full).all()
    bound = 2**-4 * x.abs() + 2**-10 * scale_full + 1e-6 * x.abs().amax()
    excess = (x - deq).abs() - bound
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3g}"


def test_constants():
    assert fq.FP8_DTYPE == torch.float8_e4m3fn and fq.FP8_MAX == 448.0


def test_per_channel():
    w = _rand(96, 200, seed=1)
    q, scale = fq.quantize_weight_per_channel(w)
    assert q.dtype == fq.FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (96,)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / fq.FP8_MAX)
    deq = q.float() * scale[:, None]
    _assert_within_e4m3(w, deq, scale[:, None].expand_as(w))
    # each row's largest element maps onto FP8_MAX, so it round-trips exactly
    rows = torch.arange(96)
    cols = w.abs().argmax(dim=1)
    assert (q.float()[rows, cols].abs() == fq.FP8_MAX).all()


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 130, 129)])
def test_block(shape):
    w = _rand(*shape, seed=2)
    q, scale_inv = fq.quantize_weight_block(w, (128, 128))
    n, k = shape[-2:]
    nb, kb = -(-n // 128), -(-k // 128)
    assert q.shape == w.shape and q.dtype == fq.FP8_DTYPE
    assert scale_inv.shape == shape[:-2] + (nb, kb) and scale_inv.dtype == torch.float32
    # float32 reference: each block's own amax / 448, broadcast back element-wise
    full = torch.empty(w.shape, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            tile = w[..., i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = tile.abs().amax(dim=(-2, -1)) / fq.FP8_MAX
            torch.testing.assert_close(scale_inv[..., i, j], s)
            full[..., i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = s[..., None, None]
    deq = fq.dequantize_weight_block(q, scale_inv, (128, 128))
    torch.testing.assert_close(deq, q.float() * full, rtol=0, atol=0)
    _assert_within_e4m3(w, deq, full)


def test_block_other_sizes_and_dtype():
    w = _rand(70, 90, seed=3, dtype=torch.bfloat16)
    q, s = fq.quantize_weight_block(w, (32, 64))
    assert s.shape == (3, 2)
    deq = fq.dequantize_weight_block(q, s, (32, 64), dtype=torch.bfloat16)
    assert deq.dtype == torch.bfloat16
    full = s.repeat_interleave(32, 0).repeat_interleave(64, 1)[:70, :90]
    _assert_within_e4m3(w.float(), fq.dequantize_weight_block(q, s, (32, 64)), full)
    with pytest.raises(ValueError, match="scale_inv"):
        fq.dequantize_weight_block(q, s[:, :1], (32, 64))


@pytest.mark.parametrize("k,group", [(256, 128), (200, 128), (96, 32)])
def test_activation_per_token_group(k, group):
    x = _rand(7, k, seed=4, dtype=torch.bfloat16)
    q, scale = fq.quantize_activation_per_token_group(x, group)
    groups = -(-k // group)
    assert q.shape == x.shape and scale.shape == (7, groups) and scale.dtype == torch.float32
    for g in range(groups):
        ref = x[:, g * group : (g + 1) * group].float().abs().amax(dim=1) / fq.FP8_MAX
        torch.testing.assert_close(scale[:, g], ref)
    deq = fq.dequantize_activation_per_token_group(q, scale, group)
    full = scale.repeat_interleave(group, dim=1)[:, :k]
    _assert_within_e4m3(x.float(), deq, full)


def test_activation_per_token():
    x = _rand(9, 300, seed=5)
    q, scale = fq.quantize_activation_per_token(x)
    assert scale.shape == (9, 1)
    torch.testing.assert_close(scale[:, 0], x.abs().amax(dim=1) / fq.FP8_MAX)
    _assert_within_e4m3(x, q.float() * scale, scale.expand_as(x))


def _all_quantizers(x: torch.Tensor):
    q, s = fq.quantize_weight_per_channel(x)
    yield q.float() * s[:, None], s
    q, s = fq.quantize_weight_block(x, (128, 128))
    yield fq.dequantize_weight_block(q, s), s
    q, s = fq.quantize_activation_per_token_group(x, 128)
    yield fq.dequantize_activation_per_token_group(q, s, 128), s
    q, s = fq.quantize_activation_per_token(x)
    yield q.float() * s, s


@pytest.mark.parametrize("magnitude", [0.0, 1e-30, 1e-8, 1e30, 3e38])
def test_no_nan_or_inf_at_extreme_magnitudes(magnitude):
    x = _rand(4, 256, seed=6) / 1e3  # rows within [1e-6, 1] times N(0, 1)
    x = (x / x.abs().amax() * magnitude).float()  # largest |x| is `magnitude` (< float32 max)
    assert torch.isfinite(x).all()
    for deq, scale in _all_quantizers(x):
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert torch.isfinite(deq).all()
        if magnitude == 0.0:
            assert (deq == 0).all()
        elif magnitude >= 1e-8:  # above the clamp (MIN_AMAX): the e4m3 bound holds
            assert ((x - deq).abs() <= 2**-4 * x.abs() + 2**-10 * x.abs().amax()).all()
        else:  # below it everything underflows towards 0, never away
            assert (deq.abs() <= x.abs() * (1 + 2**-4) + 1e-30).all()


def test_bf16_huge_values_saturate_without_nan():
    x = torch.tensor([[3.0e38, -3.0e38, 1.0, 0.0]], dtype=torch.bfloat16)
    q, s = fq.quantize_activation_per_token(x)
    assert not q.float().isnan().any()
    assert q.float()[0, 0] == fq.FP8_MAX and q.float()[0, 1] == -fq.FP8_MAX
    assert torch.isfinite(s).all()
