"""FusedMoE with FP8 experts: quantization at load, FP8 checkpoints (weights + weight_scale_inv through
the per-expert loaders, also as tensor-parallel shards), the torch path against the Triton kernel.

Tolerances: the FP8 torch path computes what the kernel computes (same quantized operands), so
the two agree to float32 summation order (1e-5); against the unquantized layer the e4m3 rounding
of five operands allows ~0.06 norm-relative error (derivation in tests/ops/test_triton_fused_moe.py),
asserted at 0.12.
"""

from __future__ import annotations

import os

import pytest
import torch

from fastdeploy.model_executor.layers import fused_moe as fm
from fastdeploy.model_executor.layers.fused_moe import FusedMoE, select_experts
from fastdeploy.model_executor.layers.quantization import Fp8Config, PtpcFp8Config
from fastdeploy.ops import fp8_quant as fq

E, K, H, INTER = 8, 2, 128, 256
BLOCK = (128, 128)


def _Fp8(weight_block_size=BLOCK, is_checkpoint_fp8=False):
    return Fp8Config(weight_block_size=weight_block_size, is_checkpoint_fp8=is_checkpoint_fp8)


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _checkpoint(seed=0):
    """Per-expert float32 checkpoint tensors ``{(e, proj): [out, in]}``."""
    tensors = {}
    for e in range(E):
        tensors[(e, "gate_proj")] = _rand(INTER, H, seed=seed + 3 * e, scale=H**-0.5)
        tensors[(e, "up_proj")] = _rand(INTER, H, seed=seed + 3 * e + 1, scale=H**-0.5)
        tensors[(e, "down_proj")] = _rand(H, INTER, seed=seed + 3 * e + 2, scale=INTER**-0.5)
    return tensors


def _load(layer: FusedMoE, tensors: dict, scales: dict | None = None) -> None:
    for (e, proj), w in tensors.items():
        param = layer.down_proj if proj == "down_proj" else layer.gate_up_proj
        param.weight_loader(param, w, f"{e}.{proj}")
        if scales is not None:
            scale = layer.down_proj_scale_inv if proj == "down_proj" else layer.gate_up_proj_scale_inv
            scale.weight_loader(scale, scales[(e, proj)], f"{e}.{proj}")


def _inputs(tokens=11, seed=100):
    x = _rand(tokens, H, seed=seed)
    weights, ids = select_experts(_rand(tokens, E, seed=seed + 1), K, renormalize=True)
    return x, weights, ids


def _rel(a, b):
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_online_quantization_at_load():
    tensors = _checkpoint()
    plain = FusedMoE(E, K, H, INTER, renormalize=True)
    quant = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=_Fp8())
    _load(plain, tensors)
    _load(quant, tensors)
    assert quant.gate_up_proj.dtype == torch.float32  # model dtype until loading is done
    quant.process_weights_after_loading()
    assert quant.gate_up_proj.dtype == quant.down_proj.dtype == fq.FP8_DTYPE
    assert quant.gate_up_proj_scale_inv.shape == (E, 2 * INTER // 128, H // 128)
    assert quant.down_proj_scale_inv.shape == (E, H // 128, INTER // 128)
    assert hasattr(quant.gate_up_proj, "weight_loader")  # loaders survive the replacement
    deq = fq.dequantize_weight_block(quant.gate_up_proj.data, quant.gate_up_proj_scale_inv.data)
    assert _rel(deq, plain.gate_up_proj.data) < 0.05
    x, weights, ids = _inputs()
    assert _rel(quant.compute_experts(x, weights, ids), plain.compute_experts(x, weights, ids)) < 0.12


def _fp8_checkpoint(tensors):
    """The FP8 checkpoint of ``tensors``: each projection quantized on its own, 128 x 128 blocks."""
    weights, scales = {}, {}
    for key, w in tensors.items():
        weights[key], scales[key] = fq.quantize_weight_block(w, BLOCK)
    return weights, scales


def _dequantized(weights, scales):
    return {key: fq.dequantize_weight_block(w, scales[key]) for key, w in weights.items()}


def test_fp8_checkpoint_loads_directly():
    weights, scales = _fp8_checkpoint(_checkpoint(seed=1))
    layer = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=_Fp8(is_checkpoint_fp8=True))
    assert layer.gate_up_proj.dtype == fq.FP8_DTYPE
    assert layer.gate_up_proj_scale_inv.checkpoint_shapes["3.up_proj"] == (INTER // 128, H // 128)
    _load(layer, weights, scales)
    layer.process_weights_after_loading()  # nothing to do: already FP8
    assert torch.equal(
        layer.gate_up_proj.data[3, INTER:].view(torch.uint8), weights[(3, "up_proj")].view(torch.uint8)
    )
    assert torch.equal(layer.gate_up_proj_scale_inv[3, INTER // 128 :], scales[(3, "up_proj")])
    # the same experts, dequantized into an unquantized layer; both run the emulated FP8 math
    plain = FusedMoE(E, K, H, INTER, renormalize=True)
    _load(plain, _dequantized(weights, scales))
    x, w, ids = _inputs(seed=5)
    out = layer.compute_experts(x, w, ids)
    assert _rel(out, plain.compute_experts(x, w, ids)) < 0.12
    # quantizing the dequantized weights at load reproduces the checkpoint exactly
    online = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=_Fp8())
    _load(online, _dequantized(weights, scales))
    online.process_weights_after_loading()
    torch.testing.assert_close(online.compute_experts(x, w, ids), out, rtol=0, atol=0)


def test_fp8_checkpoint_tensor_parallel_shards(monkeypatch):
    """Two simulated TP ranks each load their blocks; their partial outputs sum to the TP=1 output."""
    weights, scales = _fp8_checkpoint(_checkpoint(seed=2))
    config = _Fp8(is_checkpoint_fp8=True)
    whole = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=config)
    _load(whole, weights, scales)
    x, w, ids = _inputs(seed=9)
    partials = []
    for rank in range(2):
        monkeypatch.setattr(fm, "tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(fm, "tp_size", lambda: 2)
        shard = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=config)
        _load(shard, weights, scales)
        assert shard.down_proj_scale_inv.shape == (E, H // 128, 1)
        torch.testing.assert_close(shard.down_proj_scale_inv[:, :, 0], whole.down_proj_scale_inv[:, :, rank])
        partials.append(shard.compute_experts(x, w, ids))
    torch.testing.assert_close(
        partials[0] + partials[1], whole.compute_experts(x, w, ids), rtol=1e-5, atol=1e-5
    )


def test_fp8_checkpoint_shards_must_be_whole_blocks(monkeypatch):
    monkeypatch.setattr(fm, "tp_size", lambda: 4)  # 256 / 4 = 64 features: half a 128-block
    with pytest.raises(ValueError, match="not whole 128x128 blocks"):
        FusedMoE(E, K, H, INTER, renormalize=True, quant_config=_Fp8(is_checkpoint_fp8=True))


def test_per_channel_online_quantization():
    """``--quantization ptpc_fp8``: ``[E, N]`` scales, one per output row of each expert."""
    tensors = _checkpoint(seed=4)
    plain = FusedMoE(E, K, H, INTER, renormalize=True)
    quant = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=PtpcFp8Config())
    _load(plain, tensors)
    _load(quant, tensors)
    quant.process_weights_after_loading()
    assert quant.gate_up_proj.dtype == quant.down_proj.dtype == fq.FP8_DTYPE
    assert quant.gate_up_proj_scale.shape == (E, 2 * INTER) and quant.down_proj_scale.shape == (E, H)
    assert not hasattr(quant, "gate_up_proj_scale_inv")
    deq = quant.gate_up_proj.data.float() * quant.gate_up_proj_scale.data[..., None]
    assert _rel(deq, plain.gate_up_proj.data) < 0.05
    x, weights, ids = _inputs()
    assert _rel(quant.compute_experts(x, weights, ids), plain.compute_experts(x, weights, ids)) < 0.12


@pytest.mark.parametrize("per_row", [False, True])
def test_per_channel_checkpoint_loads(per_row, monkeypatch):
    """An FP8 checkpoint without ``weight_block_size`` (AutoFP8): each projection's ``weight_scale``
    (a scalar, or one per output row) fills its rows of the stacked ``[E, N]`` scales, also as
    tensor-parallel shards whose partial outputs sum to the whole layer's."""
    weights, scales = {}, {}
    for key, w in _checkpoint(seed=6).items():
        if per_row:
            weights[key], scales[key] = fq.quantize_weight_per_channel(w)
        else:  # one scale for the projection (per-tensor)
            scale = w.abs().max() / fq.FP8_MAX
            weights[key], scales[key] = (w / scale).to(fq.FP8_DTYPE), scale.reshape(())
    config = Fp8Config(weight_block_size=None, is_checkpoint_fp8=True)

    def load(layer):
        for (e, proj), w in weights.items():
            param = layer.down_proj if proj == "down_proj" else layer.gate_up_proj
            param.weight_loader(param, w, f"{e}.{proj}")
            scale = layer.down_proj_scale if proj == "down_proj" else layer.gate_up_proj_scale
            scale.weight_loader(scale, scales[(e, proj)], f"{e}.{proj}")

    whole = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=config)
    load(whole)
    whole.process_weights_after_loading()
    expect = scales[(3, "up_proj")].expand(INTER) if not per_row else scales[(3, "up_proj")]
    torch.testing.assert_close(whole.gate_up_proj_scale[3, INTER:], expect)
    plain = FusedMoE(E, K, H, INTER, renormalize=True)
    _load(
        plain,
        {
            key: w.float() * (scales[key].reshape(-1, 1) if per_row else scales[key])
            for key, w in weights.items()
        },
    )
    x, w, ids = _inputs(seed=7)
    out = whole.compute_experts(x, w, ids)
    assert _rel(out, plain.compute_experts(x, w, ids)) < 0.12
    partials = []
    for rank in range(2):
        monkeypatch.setattr(fm, "tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(fm, "tp_size", lambda: 2)
        shard = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=config)
        load(shard)
        torch.testing.assert_close(
            shard.gate_up_proj_scale[:, : INTER // 2],
            whole.gate_up_proj_scale[:, rank * INTER // 2 : (rank + 1) * INTER // 2],
        )
        partials.append(shard.compute_experts(x, w, ids))
    # each shard quantizes its half of silu(gate) * up with its own per-token scale (one e4m3
    # rounding of that operand differs: ~0.026 RMS; a wrong row or scale is O(1))
    assert _rel(partials[0] + partials[1], out) < 0.06


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and the Triton interpreter is off",
)
@pytest.mark.parametrize("fp8", [None, "block", "channel"])
def test_torch_path_matches_the_kernel(fp8):
    """The layer's parameters as the Triton kernel takes them: same result as the torch path."""
    kernel = pytest.importorskip("fastdeploy.ops.triton_fused_moe")
    config = {None: None, "block": _Fp8(), "channel": PtpcFp8Config()}[fp8]
    layer = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=config)
    _load(layer, _checkpoint(seed=3))
    layer.process_weights_after_loading()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer.to(device)
    x, w, ids = (t.to(device) for t in _inputs(tokens=21, seed=13))
    s13, s2 = layer.expert_scales()
    block = None if fp8 == "channel" else BLOCK
    out = kernel.fused_experts(x, layer.gate_up_proj, layer.down_proj, w, ids, s13, s2, block)
    # on a GPU the kernel's float32 dots run in TF32 (10-bit mantissa): ~1e-3 relative
    tol = 2e-3 if device == "cuda" else 1e-5
    torch.testing.assert_close(out, layer.compute_experts_torch(x, w, ids), rtol=tol, atol=tol)


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and the Triton interpreter is off",
)
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "first-layer"])
def test_norm_input_quantizes_for_the_per_channel_experts(with_residual, monkeypatch):
    """Per-channel FP8 experts on a grouped-GEMM step: ``norm_input`` adds, normalizes and quantizes
    in one kernel, the experts take those FP8 rows (their own quantization does not run), and the
    block's output and residual match the separate norm then experts; elsewhere no FP8 rows."""
    from fastdeploy.model_executor.layers.layernorm import RMSNorm
    from fastdeploy.ops import layer_ops
    from fastdeploy.ops import triton_fused_moe as kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(fm, "_triton_kernels", lambda name, x: layer_ops.triton_module(name))
    monkeypatch.setenv("FD_MOE_GEMV_MAX_TOKENS", "0")  # the grouped GEMM at any size
    layer = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=PtpcFp8Config())
    _load(layer, _checkpoint(seed=5))
    layer.process_weights_after_loading()
    layer.to(device)
    norm = RMSNorm(H, 1e-6).to(device=device, dtype=torch.bfloat16)
    norm.weight.data = (1 + 0.1 * _rand(H, seed=8)).to(device=device, dtype=torch.bfloat16)
    x = _rand(12, H, seed=9).to(device=device, dtype=torch.bfloat16)
    residual = _rand(12, H, seed=10).to(device=device, dtype=torch.bfloat16) if with_residual else None
    logits = _rand(12, E, seed=11).to(device=device, dtype=torch.bfloat16)
    plain_residual = residual.clone() if with_residual else None
    plain_hidden, plain_residual = (
        norm(x.clone(), plain_residual) if with_residual else (norm(x.clone()), x.clone())
    )
    expected = layer(plain_hidden, logits)

    quantized_by_the_experts = []
    real_quantize = kernel._quantize_activation
    monkeypatch.setattr(
        kernel, "_quantize_activation", lambda *a: quantized_by_the_experts.append(1) or real_quantize(*a)
    )
    hidden, new_residual, quantized = layer.norm_input(x, residual, norm)
    assert quantized is not None and quantized[0].dtype == fq.FP8_DTYPE and quantized[1].shape == (12, 1)
    # on a GPU the norm kernel's bits; the CPU's norm op rounds its float32 row apart (an ulp or two)
    tol = 0 if device == "cuda" else 2e-2
    torch.testing.assert_close(hidden.float(), plain_hidden.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(new_residual, plain_residual)
    out = layer(hidden, logits, quantized=quantized)
    assert not quantized_by_the_experts
    # the FP8 rows are the experts' own quantization of the normalized rows: the same output bits
    assert torch.equal(out, layer(hidden, logits)) and quantized_by_the_experts
    if device == "cuda":  # (the norm kernel's bits there: the whole block as before)
        assert torch.equal(out, expected)

    monkeypatch.setenv("FD_MOE_GEMV_MAX_TOKENS", "64")  # a GEMV step: bf16 activations, nothing quantized
    assert layer.norm_input(x.clone(), None, norm)[2] is None
    with pytest.raises(ValueError, match="a_quantized"):
        layer(hidden, logits, quantized=quantized)
