"""The one-pass few-token fused MoE (:mod:`fastdeploy.ops.triton_moe_onepass`) against float64
references on random inputs, and :func:`fused_experts` taking it under ``FD_MOE_GEMV_ONE_PASS``.

Tolerances as in ``test_triton_moe_gemv.py`` (norm-relative; a wrong expert, slice, scale or
weight is O(1)): float32 1e-5 (accumulation order only), bf16 2e-2 (gate_up and silu * up rounded
to bf16 as the unfused path rounds them), FP8 weights against the dequantized weights in float32
1e-5, against the unquantized ones 0.08 (three e4m3 weight operands, ~0.045 RMS in quadrature).
"""

from __future__ import annotations

import os

import pytest
import torch

onepass = pytest.importorskip("fastdeploy.ops.triton_moe_onepass")

from test_triton_fused_moe import _drop_pairs, _on, _problem, _reference, _rel_err  # noqa: E402

from fastdeploy.ops import fp8_quant as fq  # noqa: E402
from fastdeploy.ops import triton_fused_moe as moe  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)
SMALL = onepass.OnePassConfig(16, 32, 32, 4, 1, 32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens,hidden,inter", [(1, 64, 96), (3, 80, 40)])  # 80, 40: partial K / H / I steps
def test_one_pass_matches_float64_reference(tokens, hidden, inter, dtype, tol):
    x, w13, w2, weights, ids = _problem(tokens, hidden, inter, dtype, seed=tokens + 40)
    out = onepass.fused_experts_one_pass(*_on(DEVICE, x, w13, w2, weights, ids), config=SMALL)
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < tol


def test_one_pass_is_deterministic_and_shares_experts():
    """Tokens sharing experts; two calls give the same bits (a fixed summation order, no atomics)."""
    x, w13, w2, weights, ids = _on(DEVICE, *_problem(4, 64, 32, torch.float32, seed=44))
    ids[:2] = torch.tensor([3, 5])
    first = onepass.fused_experts_one_pass(x, w13, w2, weights, ids, config=SMALL)
    assert torch.equal(first, onepass.fused_experts_one_pass(x, w13, w2, weights, ids, config=SMALL))
    assert _rel_err(first, _reference(*[t.cpu() for t in (x, w13, w2, weights, ids)])) < 1e-5


@pytest.mark.parametrize("hidden,inter", [(128, 128), (192, 256)])
def test_one_pass_fp8_block_weights(hidden, inter):
    """128 x 128 block-scaled FP8 weights (a partial edge block when hidden is not a multiple)."""
    x, w13, w2, weights, ids = _problem(2, hidden, inter, torch.float32, seed=hidden + 1)
    (q13, s13), (q2, s2) = fq.quantize_weight_block(w13), fq.quantize_weight_block(w2)
    out = onepass.fused_experts_one_pass(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2), config=SMALL)
    deq13, deq2 = fq.dequantize_weight_block(q13, s13), fq.dequantize_weight_block(q2, s2)
    assert _rel_err(out, _reference(x, deq13, deq2, weights, ids)) < 1e-5
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 0.08


@pytest.mark.parametrize("tokens", [1, 3])
def test_one_pass_fp8_per_channel_weights_and_skipped_pairs(tokens):
    """Per-channel FP8 (scales ``[E, N]``, ``block_shape=None``); pairs with id -1 add nothing and a
    token with none left is zeros."""
    x, w13, w2, weights, ids = _problem(tokens, 96, 48, torch.float32, seed=50 + tokens)
    (q13, s13), (q2, s2) = fq.quantize_weight_per_channel(w13), fq.quantize_weight_per_channel(w2)
    deq13, deq2 = q13.float() * s13[..., None], q2.float() * s2[..., None]
    args = _on(DEVICE, x, q13, q2, weights, ids, s13, s2)
    out = onepass.fused_experts_one_pass(*args, block_shape=None, config=SMALL)
    assert _rel_err(out, _reference(x, deq13, deq2, weights, ids)) < 1e-5
    dropped = _drop_pairs(ids, 2)
    args = _on(DEVICE, x, q13, q2, weights, dropped, s13, s2)
    out = onepass.fused_experts_one_pass(*args, block_shape=None, config=SMALL, skip_negative_ids=True)
    assert (out[0] == 0).all()
    if tokens > 1:
        assert _rel_err(out[1:], _reference(x, deq13, deq2, weights, dropped)[1:]) < 1e-5


def test_one_pass_refuses_slices_across_scale_blocks():
    x, w13, w2, weights, ids = _problem(1, 128, 192, torch.float32, seed=60)  # 192: not whole 128-row blocks
    (q13, s13), (q2, s2) = fq.quantize_weight_block(w13), fq.quantize_weight_block(w2)
    assert not onepass.supports(q13, (128, 128), SMALL)
    with pytest.raises(ValueError, match="block_i"):
        onepass.fused_experts_one_pass(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2), config=SMALL)


def test_fused_experts_takes_the_one_pass_path_when_on(monkeypatch):
    """With FD_MOE_GEMV_ONE_PASS=1, fused_experts' few-token calls return the one-pass result (bit
    for bit); a layout it does not take falls back to the two-kernel path."""
    monkeypatch.setenv("FD_MOE_GEMV_MAX_TOKENS", "2")
    x, w13, w2, weights, ids = _on(DEVICE, *_problem(2, 64, 32, torch.float32, seed=61))
    monkeypatch.setenv("FD_MOE_GEMV_ONE_PASS", "1")
    on = moe.fused_experts(x, w13, w2, weights, ids)
    assert torch.equal(on, onepass.fused_experts_one_pass(x, w13, w2, weights, ids))
    monkeypatch.setenv("FD_MOE_GEMV_ONE_PASS", "0")
    off = moe.fused_experts(x, w13, w2, weights, ids)
    assert _rel_err(on, off.cpu().double()) < 1e-5
