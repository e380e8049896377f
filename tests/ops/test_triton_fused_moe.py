"""The Triton fused-MoE kernels (bf16 / float32 and FP8 w8a8, the sorted grouped GEMM) against float64
torch references on random inputs: 8 experts, top-2, token counts 1 and ones not divisible by the block.

Tolerances (norm-relative over the whole output; a wrong expert, row, scale or weight is O(1)):

* float32: 1e-5, accumulation order only.
* bf16: 2e-2. The output and both intermediates (gate_up, silu * up) are rounded to bf16's 8-bit
  mantissa (2^-9 relative each) as the unfused path rounds them, and the interpreter truncates
  instead of rounding (about twice the error, biased).
* FP8 against the same math on the kernel's own quantization (weights dequantized, activations
  quantized per 1 x 128 group as :mod:`fastdeploy.ops.fp8_quant` does), float32 activations:
  1e-5, accumulation order only (with bf16 activations the interpreter's truncated bf16
  intermediates flip some e4m3 roundings, so that comparison is made in float32).
* FP8 against the unquantized float64 reference: 0.12. e4m3 keeps 3 mantissa bits: an element is
  off by at most 2^-4 relative, by 2^-4 / sqrt(3) * E[1/mantissa] ~ 0.026 RMS; the five quantized
  operands (x, gate and up rows of w13, silu * up, w2) add in quadrature over the dot products,
  ~0.06; measured 0.05-0.07. 0.12 is twice the estimate (a wrong block scale is O(1)).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

moe = pytest.importorskip("fastdeploy.ops.triton_fused_moe")

from fastdeploy.ops import fp8_quant as fq  # noqa: E402
from fastdeploy.ops import triton_moe_act as act_kernels  # noqa: E402
from fastdeploy.ops import triton_moe_gemm as gemm  # noqa: E402
from fastdeploy.ops import triton_moe_routing as routing  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_backend = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)
EXPERTS, TOP_K = 8, 2


@pytest.fixture(autouse=True)
def grouped_gemm_only(monkeypatch):
    """Every size through the sorted grouped GEMM (the few-token GEMV path has its own tests,
    tests/ops/test_triton_moe_gemv.py)."""
    monkeypatch.setenv("FD_MOE_GEMV_MAX_TOKENS", "0")


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _problem(tokens, hidden, inter, dtype, seed=0, experts=EXPERTS):
    """Random hidden states, experts and routing (softmax top-k weights, renormalised)."""
    x = _rand(tokens, hidden, seed=seed).to(dtype)
    w13 = _rand(experts, 2 * inter, hidden, seed=seed + 1, scale=hidden**-0.5).to(dtype)
    w2 = _rand(experts, hidden, inter, seed=seed + 2, scale=inter**-0.5).to(dtype)
    logits = _rand(tokens, experts, seed=seed + 3)
    weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    return x, w13, w2, weights, ids


def _reference(x, w13, w2, weights, ids, act_quant=None):
    """float64 ``sum_j w_j * down(silu(gate) * up)``. With ``act_quant`` (the FP8 path's
    per-group activation quantization) the GEMM inputs are quantized and the intermediates
    rounded to ``x.dtype`` first, as the kernel path rounds them (else fp8 roundings flip)."""
    dtype = x.dtype

    def prepare(t):
        return act_quant(t.to(dtype)) if act_quant else t

    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:  # another expert-parallel rank's expert
                continue
            gate_up = prepare(x[t : t + 1]) @ w13[e].T
            if act_quant:
                gate_up = gate_up.to(dtype).double()
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            act = F.silu(gate) * up if not act_quant else (F.silu(gate).to(dtype).double() * up)
            out[t] += weights[t, j] * (prepare(act) @ w2[e].T)[0]
    return out


def _rel_err(out, ref):
    assert not out.isnan().any() and torch.isfinite(out).all()
    return ((out.cpu().double() - ref).norm() / ref.norm()).item()


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


@needs_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_matches_float64_reference(tokens, dtype, tol):
    x, w13, w2, weights, ids = _problem(tokens, 64, 96, dtype, seed=tokens)
    out = moe.fused_experts(*_on(DEVICE, x, w13, w2, weights, ids))
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < tol


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sum_equals_torchs_sum(dtype, monkeypatch):
    """``FD_MOE_TRITON_SUM=1`` (the default): the combine in Triton (``sum_pairs``, float32 accumulation, one
    rounding) against torch's sum of the same expert outputs: float32 to 1e-6, bf16 within one
    rounding of the output."""
    x, w13, w2, weights, ids = _problem(21, 64, 96, dtype, seed=3)
    inputs = _on(DEVICE, x, w13, w2, weights, ids)
    monkeypatch.setenv("FD_MOE_TRITON_SUM", "0")
    torch_sum = moe.fused_experts(*inputs)
    monkeypatch.setenv("FD_MOE_TRITON_SUM", "1")
    triton_sum = moe.fused_experts(*inputs)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(triton_sum.float(), torch_sum.float(), rtol=tol, atol=tol)
    assert _rel_err(triton_sum, _reference(x, w13, w2, weights, ids)) < (
        1e-5 if dtype == torch.float32 else 2e-2
    )


@needs_backend
def test_matches_fused_moe_torch_path():
    """Same weights through FusedMoE.compute_experts_torch (the CPU path) and the kernel, float32."""
    from fastdeploy.model_executor.layers.fused_moe import FusedMoE

    x, w13, w2, weights, ids = _problem(19, 128, 64, torch.float32, seed=7)
    layer = FusedMoE(EXPERTS, TOP_K, 128, 64, renormalize=True)
    layer.gate_up_proj.data.copy_(w13)
    layer.down_proj.data.copy_(w2)
    ref = layer.compute_experts_torch(x, weights, ids)
    out = moe.fused_experts(*_on(DEVICE, x, w13, w2, weights, ids))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


def _drop_pairs(ids, seed):
    """About half the pairs, and all of token 0's, marked -1 (experts another rank holds)."""
    g = torch.Generator().manual_seed(seed)
    ids = ids.clone()
    ids[torch.rand(ids.shape, generator=g) < 0.5] = -1
    ids[0] = -1
    return ids


@needs_backend
@pytest.mark.parametrize("tokens", [1, 9, 33])
def test_negative_ids_are_skipped(tokens):
    """Expert parallelism: pairs with id -1 add nothing (float32 and FP8, and the torch path)."""
    from fastdeploy.model_executor.layers.fused_moe import FusedMoE

    x, w13, w2, weights, ids = _problem(tokens, 128, 64, torch.float32, seed=30 + tokens)
    ids = _drop_pairs(ids, tokens)
    ref = _reference(x, w13, w2, weights, ids)
    out = moe.fused_experts(*_on(DEVICE, x, w13, w2, weights, ids), skip_negative_ids=True)
    assert (out[0] == 0).all()
    if tokens > 1:
        assert _rel_err(out, ref) < 1e-5
    layer = FusedMoE(EXPERTS, TOP_K, 128, 64, renormalize=True)
    layer.gate_up_proj.data.copy_(w13)
    layer.down_proj.data.copy_(w2)
    torch.testing.assert_close(layer.compute_experts_torch(x, weights, ids), out.cpu(), rtol=1e-5, atol=1e-5)
    q13, s13 = fq.quantize_weight_block(w13)
    q2, s2 = fq.quantize_weight_block(w2)
    fp8_out = moe.fused_experts(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2), skip_negative_ids=True)
    assert (fp8_out[0] == 0).all() and torch.isfinite(fp8_out).all()
    if tokens > 1:
        assert _rel_err(fp8_out, ref) < 0.12


def _fp8_problem(tokens, hidden, inter, seed):
    x, w13, w2, weights, ids = _problem(tokens, hidden, inter, torch.bfloat16, seed=seed)
    q13, s13 = fq.quantize_weight_block(w13.float())
    q2, s2 = fq.quantize_weight_block(w2.float())
    return (x, w13, w2, weights, ids), (q13, s13, q2, s2)


def _group_quant(t):
    q, s = fq.quantize_activation_per_token_group(t.float(), 128)
    return fq.dequantize_activation_per_token_group(q, s, 128).double()


@needs_backend
@pytest.mark.parametrize("tokens", [1, 6, 21])
@pytest.mark.parametrize("hidden,inter", [(128, 128), (192, 96)])
def test_fp8_matches_references(tokens, hidden, inter):
    """FP8 w8a8 with 128 x 128 weight blocks (partial edge blocks when a size is not a multiple)."""
    (x, w13, w2, weights, ids), (q13, s13, q2, s2) = _fp8_problem(tokens, hidden, inter, seed=tokens)
    out = moe.fused_experts(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2))
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 0.12
    # float32 activations: exactly the emulated quantization, up to accumulation order
    xf, wf = x.float(), weights.float()
    out = moe.fused_experts(*_on(DEVICE, xf, q13, q2, wf, ids, s13, s2))
    deq13, deq2 = fq.dequantize_weight_block(q13, s13), fq.dequantize_weight_block(q2, s2)
    emulated = _reference(xf, deq13, deq2, wf, ids, act_quant=_group_quant)
    assert _rel_err(out, emulated) < 1e-5


def _token_quant(t):
    q, s = fq.quantize_activation_per_token(t.float())
    return (q.float() * s).double()


@needs_backend
@pytest.mark.parametrize("tokens", [1, 6, 21])
@pytest.mark.parametrize("hidden,inter", [(128, 128), (192, 96)])
def test_fp8_per_channel_matches_references(tokens, hidden, inter):
    """FP8 w8a8 with per-channel weight scales ``[E, N]`` and per-token activation scales
    (``block_shape=None``, ``--quantization ptpc_fp8``): the scales multiply once after the K loop."""
    x, w13, w2, weights, ids = _problem(tokens, hidden, inter, torch.bfloat16, seed=tokens + 50)
    (q13, s13), (q2, s2) = (
        fq.quantize_weight_per_channel(w13.float()),
        fq.quantize_weight_per_channel(w2.float()),
    )
    out = moe.fused_experts(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2), block_shape=None)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 0.12
    xf, wf = x.float(), weights.float()
    out = moe.fused_experts(*_on(DEVICE, xf, q13, q2, wf, ids, s13, s2), block_shape=None)
    deq13, deq2 = q13.float() * s13[..., None], q2.float() * s2[..., None]
    emulated = _reference(xf, deq13, deq2, wf, ids, act_quant=_token_quant)
    assert _rel_err(out, emulated) < 1e-5
    if tokens == 1:
        return  # (all of token 0's pairs are dropped below)
    dropped = _drop_pairs(ids, 2)
    out = moe.fused_experts(
        *_on(DEVICE, xf, q13, q2, wf, dropped, s13, s2), block_shape=None, skip_negative_ids=True
    )
    assert _rel_err(out, _reference(xf, deq13, deq2, wf, dropped, act_quant=_token_quant)) < 1e-5


@needs_backend
@pytest.mark.parametrize("block_shape", [(128, 128), None], ids=["1x128-groups", "per-token"])
@pytest.mark.parametrize("inter", [256, 96])  # 96: a partial group
def test_silu_mul_quant_equals_the_two_kernels(block_shape, inter):
    """The fused SiLU-and-multiply + FP8 activation quantization: the same bits as the activation
    of silu_and_mul quantized by fp8_quant (bf16 rows, large and tiny values, a zero row), and
    skipped rows left out."""
    from fastdeploy.ops.triton_layer_ops import silu_and_mul  # the GPU path's kernel (also on a CPU here)

    gate_up = (_rand(9, 2 * inter, seed=inter) * 3).bfloat16()
    gate_up[2] *= 1e-4
    gate_up[5] = 0
    gate_up = gate_up.to(DEVICE)
    q, scale = act_kernels.silu_mul_quant(gate_up, block_shape)
    act = silu_and_mul(gate_up)
    if block_shape is None:
        want_q, want_scale = fq.quantize_activation_per_token(act)
    else:
        want_q, want_scale = fq.quantize_activation_per_token_group(act, block_shape[1])
    assert q.dtype == fq.FP8_DTYPE and scale.shape == want_scale.shape
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    ids = torch.tensor([0, -1, 3, -1, 2, 1, -1, 0, 5], device=DEVICE)
    q_skip, scale_skip = act_kernels.silu_mul_quant(gate_up, block_shape, ids)
    kept = ids >= 0
    assert torch.equal(q_skip[kept].view(torch.uint8), want_q[kept].view(torch.uint8))
    assert torch.equal(scale_skip[kept], want_scale[kept])


@needs_backend
def test_fp8_extreme_scales_stay_finite():
    """Weights of 1e-6 and 1e4 magnitude and a token of zeros: finite output, right relative size."""
    (x, w13, w2, weights, ids), _ = _fp8_problem(4, 128, 128, seed=3)
    x[1] = 0
    w13[:4] *= 1e-6
    w2[4:] *= 1e4
    q13, s13 = fq.quantize_weight_block(w13.float())
    q2, s2 = fq.quantize_weight_block(w2.float())
    out = moe.fused_experts(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2))
    assert torch.isfinite(out.float()).all() and (out[1] == 0).all()
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 0.12


@needs_backend
def test_config_override_and_non_even_k():
    """A caller's configuration (block_k not dividing K) gives the same result."""
    x, w13, w2, weights, ids = _problem(9, 80, 48, torch.float32, seed=11)
    ref = _reference(x, w13, w2, weights, ids)
    config = moe.MoEKernelConfig(block_m=16, block_n=32, block_k=32, group_m=2)
    out = moe.fused_experts(*_on(DEVICE, x, w13, w2, weights, ids), config=config)
    assert _rel_err(out, ref) < 1e-5


def _variant(quant, tokens, seed):
    """``(args, kwargs, config)`` of a ``fused_experts`` call: ``fp32-odd-k`` (float32, tiles that
    overhang K and N), ``bf16``, ``fp8-block`` (128 x 128 block scales), ``fp8-channel`` (per-channel
    weight scales), ``fp8-channel-skipped`` (the same with some pairs on another rank's experts)."""
    if quant == "fp32-odd-k":
        config = moe.MoEKernelConfig(block_m=16, block_n=32, block_k=32, group_m=2)
        return _problem(9, 80, 48, torch.float32, seed=seed), {}, config
    if quant == "bf16":
        return _problem(tokens, 128, 96, torch.bfloat16, seed=seed), {}, None
    if quant == "fp8-block":
        (x, _, _, weights, ids), (q13, s13, q2, s2) = _fp8_problem(tokens, 192, 96, seed=seed)
        return (x, q13, q2, weights, ids, s13, s2), {}, None
    x, w13, w2, weights, ids = _problem(tokens, 192, 96, torch.bfloat16, seed=seed)
    (q13, s13), (q2, s2) = (
        fq.quantize_weight_per_channel(w13.float()),
        fq.quantize_weight_per_channel(w2.float()),
    )
    if quant == "fp8-channel-skipped":
        return (
            (x, q13, q2, weights, _drop_pairs(ids, 3), s13, s2),
            {"block_shape": None, "skip_negative_ids": True},
            None,
        )
    return (x, q13, q2, weights, ids, s13, s2), {"block_shape": None}, None


@needs_backend
@pytest.mark.parametrize("quant", ["bf16", "fp32-odd-k", "fp8-block", "fp8-channel"])
def test_weights_through_tma_descriptors(quant, monkeypatch):
    """``FD_MOE_TMA_WEIGHTS=1`` (the weights' tiles loaded through tensor descriptors, zeros past N
    and K) computes what the pointer loads compute, also where a tile overhangs K (80 = 2.5 tiles
    of 32, 48 = 1.5) and N (80 columns in 32-wide tiles), with FP8 block and per-channel scales.
    Up to accumulation order (the interpreter's dot of a transposed tile sums in another order):
    1e-5 in float32; in bf16 an output may round one ulp (2^-8) the other way, so 4e-3 of the
    norm there (a wrong tile, expert or scale is O(1))."""
    args, kwargs, config = _variant(quant, 21, seed=13)
    tensors = _on(DEVICE, *args)
    monkeypatch.setenv("FD_MOE_TMA_WEIGHTS", "0")
    pointers = moe.fused_experts(*tensors, config=config, **kwargs)
    monkeypatch.setenv("FD_MOE_TMA_WEIGHTS", "1")
    assert gemm.weights_by_tma(tensors[1], config or moe.default_config(21, False))
    tma = moe.fused_experts(*tensors, config=config, **kwargs)
    assert _rel_err(tma, pointers.cpu().double()) < (1e-5 if quant == "fp32-odd-k" else 4e-3)


@needs_backend
@pytest.mark.parametrize("quant", ["bf16", "fp32-odd-k", "fp8-block", "fp8-channel-skipped"])
def test_persistent_grid_gives_the_same_bits(quant, monkeypatch):
    """A persistent grid (2 or 3 programs here, each walking every 2nd / 3rd tile up to the padded
    length read on the device) computes every tile as one program a tile does: the same bits,
    with and without TMA weights, and with another rank's pairs skipped."""
    args, kwargs, config = _variant(quant, 21, seed=22)
    tensors = _on(DEVICE, *args)
    for tma in "01":
        monkeypatch.setenv("FD_MOE_TMA_WEIGHTS", tma)
        monkeypatch.setattr(moe, "persistent_programs", lambda *args: 0)
        one_a_tile = moe.fused_experts(*tensors, config=config, **kwargs)
        for programs in (2, 3):
            monkeypatch.setattr(moe, "persistent_programs", lambda *args, n=programs: n)
            assert torch.equal(moe.fused_experts(*tensors, config=config, **kwargs), one_a_tile)


@needs_backend
@pytest.mark.parametrize("quant", ["bf16", "fp8-channel"])
def test_atomic_expert_sort_gives_the_same_bits(quant, monkeypatch):
    """The expert sort by atomic counters (beyond ``ALIGN_SINGLE_MAX`` pairs) may order an expert's
    pairs differently from the one-program sort; each pair's row is computed on its own, so the
    output is the same bits."""
    args, kwargs, _ = _variant(quant, 140, seed=31)  # 280 pairs: past the one-program sort
    tensors = _on(DEVICE, *args)
    monkeypatch.setattr(routing, "ALIGN_SINGLE_MAX", 1 << 30)
    one_program = moe.fused_experts(*tensors, **kwargs)
    monkeypatch.setattr(routing, "ALIGN_SINGLE_MAX", 0)
    assert torch.equal(moe.fused_experts(*tensors, **kwargs), one_program)


@needs_backend
@pytest.mark.parametrize("quant", ["bf16", "fp8-channel"])
def test_ranks_from_the_routing_kernel_give_the_same_bits(quant, monkeypatch):
    """``FD_MOE_RANKS_IN_ROUTER``: the routing kernel ranks the pairs (``pair_ranks_for``) and the
    sort skips its rank kernel; the MoE's output is the bits of the sort that ranks them itself.
    On by default, and never for steps the one-program sort, the GEMV kernels or a few tokens take."""
    from fastdeploy.ops import triton_moe_routing as routing_ops

    args, kwargs, _ = _variant(quant, 140, seed=41)
    hidden, w13, w2, weights, ids, *scales = _on(DEVICE, *args)
    block = kwargs.get("block_shape", (128, 128))
    monkeypatch.setenv("FD_MOE_RANKS_IN_ROUTER", "0")
    assert moe.pair_ranks_for(hidden, w13, w2, block, ids.shape[1]) is None
    monkeypatch.delenv("FD_MOE_RANKS_IN_ROUTER", raising=False)
    assert moe.pair_ranks_for(hidden[:4], w13, w2, block, ids.shape[1]) is None
    ranked = moe.pair_ranks_for(hidden, w13, w2, block, ids.shape[1])
    assert ranked is not None and ranked.ranks.numel() == ids.numel()
    logits = torch.randn(hidden.shape[0], w13.shape[0], generator=torch.Generator().manual_seed(3)).to(DEVICE)
    weights, ids = routing_ops.topk_softmax(logits, ids.shape[1], True, ranked=ranked)
    weights = weights.to(hidden.dtype)
    expected = moe.fused_experts(hidden, w13, w2, weights, ids, *scales, **kwargs)
    assert torch.equal(
        moe.fused_experts(hidden, w13, w2, weights, ids, *scales, ranked=ranked, **kwargs), expected
    )


def test_persistent_programs_setting(monkeypatch):
    """``FD_MOE_PERSISTENT_MIN_TOKENS``: steps of at least that many tokens (4,096 by default) get a
    persistent grid (one program per SM; two under the interpreter), smaller ones and 0 none."""
    monkeypatch.setattr(gemm, "triton_interpreting", lambda: True)
    monkeypatch.delenv("FD_MOE_PERSISTENT_MIN_TOKENS", raising=False)
    config, cpu = moe.MoEKernelConfig(128, 256, 128, 16, 8, 4), torch.device("cpu")
    assert gemm.persistent_programs(4095, cpu, config, 1) == 0
    assert gemm.persistent_programs(8192, cpu, config, 1) == 2
    monkeypatch.setenv("FD_MOE_PERSISTENT_MIN_TOKENS", "0")
    assert gemm.persistent_programs(8192, cpu, config, 1) == 0
    monkeypatch.setenv("FD_MOE_PERSISTENT_MIN_TOKENS", "1024")
    assert gemm.persistent_programs(1023, cpu, config, 1) == 0
    assert gemm.persistent_programs(1024, cpu, config, 1) == 2


def test_tma_weights_setting(monkeypatch):
    """``FD_MOE_TMA_WEIGHTS``: ``auto`` (the default) takes descriptors for 16-bit weights only, ``1``
    for FP8 too, ``0`` never; a layout TMA cannot address (a K row of 8 bytes) never."""
    monkeypatch.setattr(gemm, "triton_interpreting", lambda: True)  # (as on a Hopper GPU)
    config = moe.MoEKernelConfig(16, 32, 32, 1)
    bf16 = torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    fp8 = torch.zeros(4, 64, 64, dtype=fq.FP8_DTYPE)
    monkeypatch.delenv("FD_MOE_TMA_WEIGHTS", raising=False)
    assert gemm.weights_by_tma(bf16, config) and not gemm.weights_by_tma(fp8, config)
    monkeypatch.setenv("FD_MOE_TMA_WEIGHTS", "1")
    assert gemm.weights_by_tma(bf16, config) and gemm.weights_by_tma(fp8, config)
    assert not gemm.weights_by_tma(torch.zeros(4, 64, 4, dtype=torch.bfloat16), config)
    monkeypatch.setenv("FD_MOE_TMA_WEIGHTS", "0")
    assert not gemm.weights_by_tma(bf16, config) and not gemm.weights_by_tma(fp8, config)


@needs_backend
def test_down_config_of_its_own():
    """The down GEMM with its own tiles (same ``block_m``) gives the same result; another
    ``block_m`` than gate_up's (one sorted layout for both) is refused."""
    x, w13, w2, weights, ids = _problem(9, 80, 48, torch.float32, seed=12)
    ref = _reference(x, w13, w2, weights, ids)
    config = moe.MoEKernelConfig(block_m=16, block_n=32, block_k=32, group_m=2)
    down = moe.MoEKernelConfig(block_m=16, block_n=64, block_k=16, group_m=1)
    out = moe.fused_experts(*_on(DEVICE, x, w13, w2, weights, ids), config=config, down_config=down)
    assert _rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="down_config.block_m"):
        moe.fused_experts(
            *_on(DEVICE, x, w13, w2, weights, ids),
            config=config,
            down_config=moe.MoEKernelConfig(32, 64, 16, 1),
        )


def test_align_block_size():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, EXPERTS, (13, TOP_K), generator=g)
    ids[0] = torch.tensor([5, 3])
    block = 4
    sorted_ids, expert_ids, num_padded = moe.align_block_size_torch(ids, block, EXPERTS)
    pairs = ids.numel()
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    padded = (counts + block - 1) // block * block
    assert int(num_padded) == int(padded.sum())
    assert sorted_ids.numel() % block == 0 and sorted_ids.numel() >= int(num_padded)
    used = sorted_ids[: int(num_padded)]
    valid = used[used < pairs]
    assert sorted(valid.tolist()) == list(range(pairs))  # every pair exactly once
    assert (sorted_ids[int(num_padded) :] == pairs).all()
    for b in range(int(num_padded) // block):
        members = sorted_ids[b * block : (b + 1) * block]
        members = members[members < pairs]
        assert (ids.reshape(-1)[members.long()] == expert_ids[b]).all()
        assert members.tolist() == sorted(members.tolist())  # stable within an expert


def test_default_config_table(monkeypatch):
    monkeypatch.setattr(moe, "triton_interpreting", lambda: False)
    small, large = moe.default_config(1, fp8=False), moe.default_config(8192, fp8=False)
    assert small.block_m == 16 and large.block_m >= 64
    for tokens in (1, 64, 100000):
        assert 128 % moe.default_config(tokens, fp8=True).block_k == 0


def test_rejects_bad_inputs():
    x, w13, w2, weights, ids = _problem(3, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="w13 \\[E, 2I, H\\]"):
        moe.fused_experts(x, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(ValueError, match="both scales"):
        moe.fused_experts(x, w13.to(fq.FP8_DTYPE), w2.to(fq.FP8_DTYPE), weights, ids)
    q13, s13 = fq.quantize_weight_block(w13.float())
    q2, s2 = fq.quantize_weight_block(w2.float())
    with pytest.raises(
        ValueError, match="w13_scale must be float32 \\(8, 64\\)"
    ):  # block scales, per-channel call
        moe.fused_experts(x, q13, q2, weights, ids, s13, s2, block_shape=None)
    with pytest.raises(ValueError, match="share hidden's dtype"):
        moe.fused_experts(x, w13.bfloat16(), w2.bfloat16(), weights, ids)


def test_float32_tiles_are_cut_to_the_shared_memory_of_the_gpu():
    """The prefill tiles of the table are tuned for 2-byte activations; in float32 they would ask
    for more shared memory than an H100/H200 has (Triton's OutOfResources on the first large
    step): fewer stages, then a shorter K step, until they fit; 2-byte tiles stay as tuned."""
    from fastdeploy.ops.tile_config import fit_shared_memory, shared_memory_bytes
    from fastdeploy.ops.triton_fused_moe import BF16_CONFIGS

    hopper, ampere = 232_448, 166_912
    for _, config in BF16_CONFIGS:
        assert fit_shared_memory(config, 2, hopper) == config
        for limit in (hopper, ampere):
            fitted = fit_shared_memory(config, 4, limit)
            assert shared_memory_bytes(fitted, 4) <= limit
            assert (fitted.block_m, fitted.block_n) == (config.block_m, config.block_n)
    large = BF16_CONFIGS[-1][1]
    assert shared_memory_bytes(large, 4) > hopper  # the case that failed on the H200
    assert fit_shared_memory(large, 4, hopper).num_stages == 2


def _grouped_mm_emulated(a, b, scale_a, scale_b, offs, out_dtype=None, use_fast_accum=False):
    """``torch._scaled_grouped_mm`` (2-D x 3-D, row-wise scales) in torch, with its layout checks:
    ``a [M, K]`` row-major, ``b [G, K, N]`` column-major, ``scale_a [M]``, ``scale_b [G, N]``,
    ``offs [G]`` int32 group ends along M (no CPU kernel exists)."""
    assert a.dtype == b.dtype == fq.FP8_DTYPE and a.stride(-1) == 1 and b.stride(-2) == 1
    assert scale_a.shape == (a.shape[0],) and scale_a.is_contiguous() and scale_a.dtype == torch.float32
    assert scale_b.shape == (b.shape[0], b.shape[2]) and scale_b.stride(1) == 1
    assert offs.dtype == torch.int32 and offs.shape == (b.shape[0],) and int(offs[-1]) == a.shape[0]
    out = torch.empty((a.shape[0], b.shape[2]), dtype=out_dtype, device=a.device)
    start = 0
    for group, end in enumerate(offs.tolist()):
        rows = a[start:end].float() * scale_a[start:end, None]
        out[start:end] = (rows @ (b[group].float() * scale_b[group][None, :])).to(out_dtype)
        start = end
    return out


@needs_backend
@pytest.mark.parametrize("tokens", [5, 40])
def test_grouped_mm_experts_equal_the_same_math(tokens, monkeypatch):
    """The per-channel FP8 experts on two grouped GEMMs (ops/fp8_grouped_mm.py), with the grouped GEMM
    emulated: the pairs' sort by expert, the gathered rows, the scales and the weighted sum back in
    token order give the emulated FP8 math (float32, 1e-5) and the unquantized one (0.12)."""
    from fastdeploy.ops import fp8_grouped_mm

    monkeypatch.setattr(torch, "_scaled_grouped_mm", _grouped_mm_emulated, raising=False)
    x, w13, w2, weights, ids = _problem(tokens, 128, 64, torch.float32, seed=tokens + 90)
    (q13, s13), (q2, s2) = (
        fq.quantize_weight_per_channel(w13.float()),
        fq.quantize_weight_per_channel(w2.float()),
    )
    out = fp8_grouped_mm.grouped_mm_experts(*_on(DEVICE, x, q13, q2, weights, ids, s13, s2))
    deq13, deq2 = q13.float() * s13[..., None], q2.float() * s2[..., None]
    assert _rel_err(out, _reference(x, deq13, deq2, weights, ids, act_quant=_token_quant)) < 1e-5
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 0.12


def test_grouped_mm_only_where_it_applies(monkeypatch):
    from fastdeploy.ops import fp8_grouped_mm

    x, w13, w2, *_ = _problem(8, 128, 64, torch.bfloat16, seed=3)
    q13, q2 = fq.quantize_weight_per_channel(w13.float())[0], fq.quantize_weight_per_channel(w2.float())[0]
    assert not fp8_grouped_mm.grouped_mm_applies(x, q13, q2, None)  # off by default
    monkeypatch.setenv("FD_MOE_GROUPED_MM_MIN_TOKENS", "4")
    assert not fp8_grouped_mm.grouped_mm_applies(x, q13, q2, (128, 128))  # block scales
    assert not fp8_grouped_mm.grouped_mm_applies(x, w13, w2, None)  # bf16 weights
    if not CUDA:
        assert not fp8_grouped_mm.grouped_mm_applies(x, q13, q2, None)  # no GPU
    monkeypatch.setenv("FD_MOE_GROUPED_MM_MIN_TOKENS", "9")
    assert not fp8_grouped_mm.grouped_mm_applies(x, q13, q2, None)  # too few tokens


@pytest.mark.gpu
def test_grouped_mm_experts_on_the_gpu_equal_the_triton_kernels(monkeypatch):
    """``torch._scaled_grouped_mm`` itself (Hopper): the same FP8 math as the Triton grouped GEMM
    (bf16: rounding of the intermediates and of the weighted rows apart, 2e-2), and taken by
    fused_experts at and above FD_MOE_GROUPED_MM_MIN_TOKENS."""
    from fastdeploy.ops import fp8_grouped_mm

    if not CUDA or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("needs a GPU with the grouped FP8 GEMM (sm_90 / sm_100)")
    x, w13, w2, weights, ids = _problem(300, 256, 128, torch.bfloat16, seed=7)
    (q13, s13), (q2, s2) = (
        fq.quantize_weight_per_channel(w13.float()),
        fq.quantize_weight_per_channel(w2.float()),
    )
    args = _on("cuda", x, q13, q2, weights, ids, s13, s2)
    triton_out = moe.fused_experts(*args, block_shape=None)
    grouped_out = fp8_grouped_mm.grouped_mm_experts(*args)
    assert _rel_err(grouped_out, triton_out.cpu().double()) < 2e-2
    assert _rel_err(grouped_out, _reference(x, w13, w2, weights, ids)) < 0.12
    monkeypatch.setenv("FD_MOE_GROUPED_MM_MIN_TOKENS", "300")
    assert fp8_grouped_mm.grouped_mm_applies(args[0], q13.cuda(), q2.cuda(), None)
    dispatched = moe.fused_experts(*args, block_shape=None)  # (the Triton path differs by ~1e-2)
    assert _rel_err(dispatched, grouped_out.cpu().double()) < 1e-3
