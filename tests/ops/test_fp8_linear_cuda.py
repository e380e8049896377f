"""The FP8 linear on a GPU (skipped without one): every path against its reference, CUDA-graph
replays equal to eager calls bit for bit, and a capture of a shape the GEMV has not tuned taking
the GEMM path instead (autotuning synchronizes, which a capture forbids).

Tolerances (norm-relative; bf16 activations and outputs): the w8a16 GEMV against the float64
product with the dequantized weight, 8e-3 (one rounding of the output to bf16); the w8a8 paths
against the torch path on the same quantized operands, 1e-2 (the output rounding, and cuBLAS's
or Triton's summation order against float32's).
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy.ops import fp8_linear as fl
from fastdeploy.ops import fp8_quant as fq

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
gemv = pytest.importorskip("fastdeploy.ops.triton_fp8_gemv")
BLOCK = (128, 128)


def _operands(m, n, k, block, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    wq, ws = fq.quantize_weight_per_channel(w) if block is None else fq.quantize_weight_block(w, block)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    return x, wq, ws, bias


def _rel(got, ref) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def _paths() -> list[tuple[str, fl.Fp8LinearBackend, tuple[int, int] | None]]:
    out = [
        ("gemv block", fl.Fp8LinearBackend(64, False), BLOCK),
        ("gemv channel", fl.Fp8LinearBackend(64, False), None),
        ("scaled_mm rowwise", fl.Fp8LinearBackend(0, False), None),
        ("triton channel", fl.Fp8LinearBackend(0, False, 4096), None),
        ("triton block", fl.Fp8LinearBackend(0, False), BLOCK),
    ]
    if fl.blockwise_scaled_mm_works(torch.device("cuda")):
        out.append(("scaled_mm blockwise", fl.Fp8LinearBackend(0, True), BLOCK))
    return out


@pytest.mark.parametrize("m", [1, 3, 16, 48])
def test_every_path_matches_its_reference(m):
    for name, backend, block in _paths():
        x, wq, ws, bias = _operands(m, 384, 512, block, seed=m)
        out = fl.fp8_linear(x, wq, ws, block, bias, backend)
        assert out.dtype == torch.bfloat16 and out.shape == (m, 384)
        if name.startswith("gemv"):
            w = (
                wq.double() * ws.double()[:, None]
                if block is None
                else fq.dequantize_weight_block(wq, ws, block, torch.float64)
            )
            ref, tol = x.double() @ w.t() + bias.double(), 8e-3
        else:
            ref, tol = fl.fp8_linear_torch(x.float(), wq, ws, block) + bias.float(), 1e-2
        assert _rel(out, ref) < tol, name


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    return graph, out


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per-channel", "block"])
@pytest.mark.parametrize("m", [1, 4, 16, 40])
def test_graph_replay_equals_eager(block, m):
    backend = fl.Fp8LinearBackend.for_device(torch.device("cuda"))
    x, wq, ws, bias = _operands(m, 512, 1024, block, seed=100 + m)
    fl.fp8_linear(x, wq, ws, block, bias, backend)  # the warm-up: tunes the GEMV's shape
    static_x = x.clone()
    graph, out = _capture(lambda: fl.fp8_linear(static_x, wq, ws, block, bias, backend))
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    eager = fl.fp8_linear(x2, wq, ws, block, bias, backend)
    assert torch.equal(out, eager)


def test_cold_capture_takes_the_gemm_path():
    """A GEMV shape never run eagerly is not autotuned inside the capture: the quantize + GEMM
    path is captured instead, and the result is still right."""
    backend = fl.Fp8LinearBackend(16, False)
    x, wq, ws, _ = _operands(2, 272, 640, BLOCK, seed=7)  # a shape no other test uses
    assert not gemv.is_warmed_up(x, wq, BLOCK, False)
    fl.fp8_linear(x, wq, ws, BLOCK, None, fl.Fp8LinearBackend(0, False))  # compiles the GEMM path's kernels
    static_x = x.clone()
    graph, out = _capture(lambda: fl.fp8_linear(static_x, wq, ws, BLOCK, None, backend))
    graph.replay()
    torch.cuda.synchronize()
    assert not gemv.is_warmed_up(x, wq, BLOCK, False)
    assert _rel(out.float(), fl.fp8_linear_torch(x.float(), wq, ws, BLOCK)) < 1e-2


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per-channel", "block"])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_silu_mul_fused_down_proj(block, m):
    """fp8_linear_silu_mul: the GEMV's SiLU prologue at 1-2 rows, the two ops beyond; equal to
    silu_and_mul then fp8_linear up to the summation order, also replayed from a graph."""
    from fastdeploy.ops.layer_ops import silu_and_mul

    backend = fl.Fp8LinearBackend(16, False)
    gate_up, _, _, bias = _operands(m, 384, 1024, block, seed=200 + m)
    _, wq, ws, _ = _operands(m, 384, 512, block, seed=300 + m)
    fused = fl.fp8_linear_silu_mul(gate_up, wq, ws, block, bias, backend)
    unfused = fl.fp8_linear(silu_and_mul(gate_up), wq, ws, block, bias, backend)
    assert _rel(fused, unfused) < 8e-3
    assert gemv.is_warmed_up(gate_up, wq, block, True, silu_mul=True) == (m <= gemv.SILU_FUSE_MAX_M)
    static = gate_up.clone()
    graph, out = _capture(lambda: fl.fp8_linear_silu_mul(static, wq, ws, block, bias, backend))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused)


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per-channel", "block"])
@pytest.mark.parametrize("m", [1, 2])
def test_norm_fused_linear_through_the_layer(block, m):
    """Linear.forward_normed of an FP8 layer: one kernel (the norm prologue) at 1-2 rows, equal
    to the norm then the layer up to bf16 rounding; the new residual exactly; replays in a graph."""
    from fastdeploy.model_executor.layers.layernorm import RMSNorm
    from fastdeploy.model_executor.layers.linear import Linear
    from fastdeploy.model_executor.layers.quantization import Fp8Config

    with torch.device("cuda"):
        layer = Linear(
            512, 384, bias=False, quant_config=Fp8Config(weight_block_size=block), dtype=torch.bfloat16
        )
        norm = RMSNorm(512, 1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.2)
    layer.process_weights_after_loading()
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 512, device="cuda", generator=g).to(torch.bfloat16)
    residual = torch.randn(m, 512, device="cuda", generator=g).to(torch.bfloat16)
    out, res = layer.forward_normed(x, residual, norm)
    assert gemv.is_warmed_up(x, layer.weight, block, False, norm="add")
    hidden, res_ref = norm(x.clone(), residual.clone())
    assert torch.equal(res, res_ref)
    assert _rel(out, layer(hidden)) < 8e-3
    sx, sr = x.clone(), residual.clone()
    graph, (g_out, g_res) = _capture(lambda: layer.forward_normed(sx, sr, norm))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_res, res)
