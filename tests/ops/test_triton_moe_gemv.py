"""The few-token fused-MoE path (:mod:`fastdeploy.ops.triton_moe_gemv`) against float64 references
on random inputs, and :func:`fused_experts` choosing it up to ``FD_MOE_GEMV_MAX_TOKENS`` tokens.

Tolerances (norm-relative over the output; a wrong expert, row, scale or weight is O(1)):

* float32: 1e-5, accumulation order only.
* bf16: 2e-2, as for the grouped GEMM (gate_up and silu * up rounded to bf16 as the unfused
  path rounds them, the interpreter truncating).
* FP8 weights (w8a16: activations not quantized) against the same math on the dequantized
  weights, float32 activations: 1e-5; against the unquantized weights: 0.08 (three e4m3 weight
  operands, ~0.026 RMS each in quadrature ~0.045; a wrong block scale is O(1)).
"""

from __future__ import annotations

import os

import pytest
import torch

gemv = pytest.importorskip("fastdeploy.ops.triton_moe_gemv")

from test_triton_fused_moe import _drop_pairs, _on, _problem, _reference, _rel_err  # noqa: E402

from fastdeploy.ops import fp8_quant as fq  # noqa: E402
from fastdeploy.ops import triton_fused_moe as moe  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens,hidden,inter", [(1, 64, 96), (4, 80, 48)])  # 80, 48: partial K steps
def test_gemv_matches_float64_reference(tokens, hidden, inter, dtype, tol):
    x, w13, w2, weights, ids = _problem(tokens, hidden, inter, dtype, seed=tokens)
    out = gemv.fused_experts_gemv(*_on(DEVICE, x, w13, w2, weights, ids))
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < tol


def test_gemv_tokens_sharing_experts():
    """Eight tokens over 8 experts at top-2: most experts read for several pairs."""
    x, w13, w2, weights, ids = _problem(8, 64, 32, torch.float32, seed=4)
    ids[:4] = torch.tensor([3, 5])
    out = gemv.fused_experts_gemv(*_on(DEVICE, x, w13, w2, weights, ids))
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_skips_negative_ids(fp8):
    """Expert parallelism: pairs with id -1 add nothing (token 0 has none left: zeros)."""
    x, w13, w2, weights, ids = _problem(4, 128, 128, torch.float32, seed=21)
    ids = _drop_pairs(ids, 3)
    scales = ()
    if fp8:
        (w13, s13), (w2, s2) = fq.quantize_weight_block(w13), fq.quantize_weight_block(w2)
        scales = (s13, s2)
    out = gemv.fused_experts_gemv(*_on(DEVICE, x, w13, w2, weights, ids, *scales), skip_negative_ids=True)
    assert (out[0] == 0).all()
    if fp8:
        w13, w2 = fq.dequantize_weight_block(w13, s13), fq.dequantize_weight_block(w2, s2)
    assert _rel_err(out[1:], _reference(x, w13, w2, weights, ids)[1:]) < 1e-5


@pytest.mark.parametrize("hidden,inter", [(128, 128), (192, 96)])
def test_gemv_fp8_weights(hidden, inter):
    """128 x 128 block-scaled FP8 weights (partial edge blocks when a size is not a multiple)."""
    x, w13, w2, weights, ids = _problem(3, hidden, inter, torch.float32, seed=hidden)
    q13, s13 = fq.quantize_weight_block(w13)
    q2, s2 = fq.quantize_weight_block(w2)
    out = gemv.fused_experts_gemv(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2))
    deq13, deq2 = fq.dequantize_weight_block(q13, s13), fq.dequantize_weight_block(q2, s2)
    assert _rel_err(out, _reference(x, deq13, deq2, weights, ids)) < 1e-5
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 0.08
    xb, wb = x.bfloat16(), weights.bfloat16()
    out = gemv.fused_experts_gemv(*_on(DEVICE, xb, q13, q2, wb, ids, s13, s2))
    assert out.dtype == torch.bfloat16 and _rel_err(out, _reference(x, w13, w2, weights, ids)) < 0.08


@pytest.mark.parametrize(
    "gate_up,down",
    [
        ((16, 256), (32, 512)),  # rows within one scale block: scales on the activations, K tiles > the block
        ((256, 64), (256, 32)),  # rows across scale blocks: per-row scales, K tiles dividing the block
    ],
)
def test_gemv_fp8_scale_paths(gate_up, down):
    """Both ways of applying the block scales give the dequantized weights' result."""
    x, w13, w2, weights, ids = _problem(2, 384, 256, torch.float32, seed=11)
    q13, s13 = fq.quantize_weight_block(w13)
    q2, s2 = fq.quantize_weight_block(w2)
    configs = (gemv.GemvConfig(*gate_up, 4, 1), gemv.GemvConfig(*down, 4, 1))
    out = gemv.fused_experts_gemv(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2), configs=configs)
    deq13, deq2 = fq.dequantize_weight_block(q13, s13), fq.dequantize_weight_block(q2, s2)
    assert _rel_err(out, _reference(x, deq13, deq2, weights, ids)) < 1e-5


@pytest.mark.parametrize("tokens,hidden,inter", [(1, 128, 128), (3, 192, 96)])
def test_gemv_fp8_per_channel_weights(tokens, hidden, inter):
    """Per-channel FP8 weights (scales ``[E, N]``, ``block_shape=None``): the dequantized weights'
    result, and near the unquantized one; pairs with id -1 skipped."""
    x, w13, w2, weights, ids = _problem(tokens, hidden, inter, torch.float32, seed=hidden + tokens)
    (q13, s13), (q2, s2) = fq.quantize_weight_per_channel(w13), fq.quantize_weight_per_channel(w2)
    assert s13.shape == (w13.shape[0], 2 * inter) and s2.shape == (w2.shape[0], hidden)
    out = gemv.fused_experts_gemv(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2), block_shape=None)
    deq13, deq2 = q13.float() * s13[..., None], q2.float() * s2[..., None]
    assert _rel_err(out, _reference(x, deq13, deq2, weights, ids)) < 1e-5
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 0.08
    if tokens == 1:
        return  # (all of token 0's pairs are dropped below)
    dropped = _drop_pairs(ids, 1)
    out = gemv.fused_experts_gemv(
        *_on(DEVICE, x, q13, q2, weights, dropped, s13, s2), block_shape=None, skip_negative_ids=True
    )
    assert _rel_err(out, _reference(x, deq13, deq2, weights, dropped)) < 1e-5


def test_gemv_fp8_rejects_k_tiles_across_blocks_with_per_row_scales():
    x, w13, w2, weights, ids = _problem(1, 256, 256, torch.float32, seed=12)
    q13, s13 = fq.quantize_weight_block(w13)
    q2, s2 = fq.quantize_weight_block(w2)
    configs = (gemv.GemvConfig(256, 256, 4, 1), gemv.GemvConfig(16, 128, 4, 1))
    with pytest.raises(ValueError, match="block_k"):
        gemv.fused_experts_gemv(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2), configs=configs)


def test_fused_experts_takes_the_gemv_path_up_to_the_limit(monkeypatch):
    """Up to FD_MOE_GEMV_MAX_TOKENS tokens fused_experts returns the GEMV result (bit for bit),
    past it the grouped GEMM's (both equal the reference)."""
    monkeypatch.setenv("FD_MOE_GEMV_MAX_TOKENS", "2")
    for tokens in (2, 3):
        x, w13, w2, weights, ids = _on(DEVICE, *_problem(tokens, 64, 32, torch.float32, seed=9))
        out = moe.fused_experts(x, w13, w2, weights, ids)
        assert torch.equal(out, gemv.fused_experts_gemv(x, w13, w2, weights, ids)) == (tokens == 2)
        ref = _reference(*[t.cpu() for t in (x, w13, w2, weights, ids)])
        assert _rel_err(out, ref) < 1e-5
