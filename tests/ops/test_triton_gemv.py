"""The Triton small-M linear kernel against float64 references and the unfused path, on random inputs.

On a CPU-only machine the kernel runs in Triton's interpreter (small shapes, a few
seconds); the GPU copies run the compiled, autotuned kernel on Llama-sized shapes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

triton_gemv = pytest.importorskip("fastdeploy.ops.triton_gemv")

from fastdeploy.ops import layer_ops  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_backend = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)
BROADCAST = {"BLOCK_N": 32, "BLOCK_K": 128, "DOT": False, "STAGES": 1}
DOT = {"BLOCK_N": 32, "BLOCK_K": 128, "DOT": True, "STAGES": 1}


def _rand(*shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def _reference(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    """float64 ``act @ weight.T``; the activation rounded to x.dtype at the unfused path's points."""
    if silu_mul:
        k = weight.shape[1]
        gate, up = x[:, :k].cpu(), x[:, k:].cpu()
        act = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    else:
        act = x.cpu()
    return act.double() @ weight.cpu().double().T


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "unwritten (NaN) outputs"
    return ((out.cpu().double() - ref).norm() / ref.norm()).item()


def _tol(dtype: torch.dtype) -> float:
    """Norm-relative tolerance: float32 accumulation order only; bf16 rounds the output (and,
    with silu_mul, the activation twice) to 8 bits, and the interpreter truncates instead of
    rounding (about twice the error, biased). A wrong row, column or activation is O(1)."""
    if dtype == torch.bfloat16:
        return 8e-3 if CUDA else 2e-2
    return 1e-4


def _inputs(m, n, k, silu_mul, dtype, device="cpu", row_pad=0, seed=0):
    width = 2 * k if silu_mul else k
    x = _rand(m, width + row_pad, dtype=dtype, seed=seed, device=device)[:, :width]
    w = _rand(n, k, dtype=dtype, seed=seed + 1, device=device) * 0.1
    return x, w


def _run(x, w, silu_mul, config):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    triton_gemv._launch(x, w, out, silu_mul, config)
    return out


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("n,k", [(200, 300), (256, 512)])
def test_matches_float64_reference(n, k, silu_mul, dtype):
    device = DEVICE
    for m in range(1, triton_gemv.SMALL_M_MAX + 1):
        x, w = _inputs(m, n, k, silu_mul, dtype, device, seed=m)
        out = triton_gemv.small_m_linear(x, w, silu_mul=silu_mul)
        assert out.shape == (m, n) and out.dtype == dtype
        err = _rel_err(out, _reference(x, w, silu_mul))
        assert err < _tol(dtype), f"M={m}: relative error {err}"


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 4])
def test_dot_form_matches_reference(m, dtype):
    """The tl.dot form (which the autotuner may pick for M > 1) with a K tail and an N tail."""
    x, w = _inputs(m, 200, 300, False, dtype, DEVICE, seed=7)
    err = _rel_err(_run(x, w, False, DOT), _reference(x, w, False))
    assert err < _tol(dtype), f"relative error {err}"


@needs_backend
@pytest.mark.parametrize("silu_mul", [False, True])
def test_strided_rows_and_both_forms_agree(silu_mul):
    """x as a view with a row stride larger than its width; the broadcast form with EVEN_K."""
    x, w = _inputs(3, 96, 256, silu_mul, torch.float32, DEVICE, row_pad=40, seed=3)
    assert x.stride(0) > x.shape[1]
    ref = _reference(x, w, silu_mul)
    assert _rel_err(_run(x, w, silu_mul, BROADCAST), ref) < 1e-5
    if not silu_mul:
        assert _rel_err(_run(x, w, silu_mul, DOT), ref) < 1e-5
    assert _rel_err(triton_gemv.small_m_linear(x, w, silu_mul=silu_mul), ref) < 1e-5


@needs_backend
@pytest.mark.parametrize("m", [1, 4])
def test_bf16_fused_equals_unfused_path(m):
    """small_m_linear(gate_up, w, silu_mul=True) against silu_and_mul then F.linear, both in bf16."""
    device = DEVICE
    gate_up, w = _inputs(m, 200, 300, True, torch.bfloat16, device, seed=11)
    unfused = F.linear(layer_ops.silu_and_mul(gate_up), w)
    fused = triton_gemv.small_m_linear(gate_up, w, silu_mul=True)
    plain = triton_gemv.small_m_linear(layer_ops.silu_and_mul(gate_up), w)
    ref = unfused.double()
    assert ((fused.double() - ref).norm() / ref.norm()).item() < _tol(torch.bfloat16)
    assert ((plain.double() - ref).norm() / ref.norm()).item() < _tol(torch.bfloat16)
    if CUDA:  # same activation rounding on both paths: only the summation order differs
        assert ((fused.double() - plain.double()).abs() / (ref.abs() + 1)).max().item() < 1.6e-2


def test_validation_errors():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="2-D"):
        triton_gemv.small_m_linear(torch.randn(16), w)
    with pytest.raises(ValueError, match="dtype"):
        triton_gemv.small_m_linear(torch.randn(1, 16, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="dtype"):
        triton_gemv.small_m_linear(torch.randn(1, 16, dtype=torch.float64), w.double())
    with pytest.raises(ValueError, match="1 to 4 rows"):
        triton_gemv.small_m_linear(torch.randn(5, 16), w)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        triton_gemv.small_m_linear(torch.randn(0, 16), w)
    with pytest.raises(ValueError, match="in_features = 16"):
        triton_gemv.small_m_linear(torch.randn(1, 17), w)
    with pytest.raises(ValueError, match=r"2 \* in_features"):
        triton_gemv.small_m_linear(torch.randn(1, 16), w, silu_mul=True)
    with pytest.raises(ValueError, match="unit stride"):
        triton_gemv.small_m_linear(torch.randn(1, 32)[:, ::2], w)
    with pytest.raises(ValueError, match="contiguous"):
        triton_gemv.small_m_linear(torch.randn(1, 16), torch.randn(16, 8).T)
    with pytest.raises(ValueError, match="empty"):
        triton_gemv.small_m_linear(torch.randn(1, 0), torch.randn(8, 0))


def test_autotuner_configurations_are_pruned_sensibly():
    configs = triton_gemv._CONFIGS
    one_row = triton_gemv._prune(configs, {}, M=1, SILU_MUL=False)
    assert one_row and not any(c.kwargs["DOT"] for c in one_row)
    four_rows = triton_gemv._prune(configs, {}, M=4, SILU_MUL=False)
    assert any(c.kwargs["DOT"] for c in four_rows)
    for c in four_rows:
        if not c.kwargs["DOT"]:
            assert 4 * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= triton_gemv.ACC_ELEMENTS
    assert not any(c.kwargs["DOT"] for c in triton_gemv._prune(configs, {}, M=4, SILU_MUL=True))
    for c in configs:
        assert 2 <= c.kwargs["BLOCK_N"] <= 64 and 128 <= c.kwargs["BLOCK_K"] <= 2048
        assert c.num_warps in (4, 8) and 2 <= c.num_stages <= 5


@pytest.mark.gpu
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gpu_llama_shapes(m, silu_mul):
    """The compiled, autotuned kernel on the Llama-3.1-8B down_proj shape (and a qkv-like one)."""
    for n, k in ((4096, 14336), (6144, 4096)):
        x, w = _inputs(m, n, k, silu_mul, torch.bfloat16, "cuda", row_pad=64, seed=m)
        out = triton_gemv.small_m_linear(x, w, silu_mul=silu_mul)
        assert triton_gemv.is_warmed_up(x, w, silu_mul)
        ref = _reference(x, w, silu_mul)
        err = _rel_err(out, ref)
        assert err < 5e-3, f"M={m} N={n} K={k}: relative error {err}"
        unfused_in = layer_ops.silu_and_mul(x) if silu_mul else x
        cublas = F.linear(unfused_in, w).double().cpu()
        assert ((out.cpu().double() - cublas).norm() / cublas.norm()).item() < 5e-3
        again = triton_gemv.small_m_linear(x, w, silu_mul=silu_mul)  # tuned: same config, same bits
        assert torch.equal(out, again)


@pytest.mark.gpu
def test_gpu_capture_in_cuda_graph_after_warm_up():
    x, w = _inputs(1, 4096, 14336, True, torch.bfloat16, "cuda", seed=5)
    expected = triton_gemv.small_m_linear(x, w, silu_mul=True)  # warm-up: autotunes
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_gemv.small_m_linear(x, w, silu_mul=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


# --- dispatch in Linear -------------------------------------------------------------------


@pytest.fixture
def gemv_on(monkeypatch):
    monkeypatch.setenv("FD_SMALL_M_GEMV", "1")
    monkeypatch.delenv("FD_DISABLE_CUSTOM_OPS", raising=False)


def test_small_m_eligible_decisions(gemv_on, monkeypatch):
    from fastdeploy.model_executor.layers import linear

    assert linear._SMALL_M_MAX == triton_gemv.SMALL_M_MAX
    w = torch.randn(32, 64, dtype=torch.bfloat16)

    def ok(x, weight=w, bias=None, silu_mul=False):
        with linear.small_m_graph_warm_up():
            return linear.small_m_eligible(x, weight, bias, silu_mul, capturing=False)

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert ok(x[:1]) and ok(x) and ok(x.half(), w.half())
    assert not ok(torch.randn(5, 64, dtype=torch.bfloat16))  # more than SMALL_M_MAX rows
    assert not ok(x[:0])
    assert not ok(x.float(), w.float())  # float32 keeps cuBLAS
    assert not ok(x, w.half())
    assert not ok(x, bias=torch.zeros(32, dtype=torch.bfloat16))
    assert not ok(x.unsqueeze(0))
    assert not ok(torch.randn(1, 128, dtype=torch.bfloat16)[:, ::2])
    assert not ok(torch.randn(1, 63, dtype=torch.bfloat16))
    gate_up = torch.randn(4, 128, dtype=torch.bfloat16)
    assert ok(gate_up[:1], silu_mul=True) and ok(gate_up[:2], silu_mul=True)
    assert not ok(gate_up[:3], silu_mul=True)  # above SILU_FUSE_MAX_M: silu_and_mul, then the kernel
    assert not ok(x, silu_mul=True)
    monkeypatch.setenv("FD_DISABLE_CUSTOM_OPS", "1")
    assert not ok(x)
    monkeypatch.delenv("FD_DISABLE_CUSTOM_OPS")
    monkeypatch.setattr(linear, "load_triton_gemv", lambda: None)  # no triton
    assert not ok(x)
    monkeypatch.undo()
    monkeypatch.setenv("FD_SMALL_M_GEMV", "0")
    assert not ok(x)


def test_small_m_kernel_only_warms_up_eagerly_and_runs_in_graphs(gemv_on, monkeypatch):
    """Eager: only in the graph warm-up (which autotunes), cuBLAS otherwise; capture: warm shapes."""
    from fastdeploy.model_executor.layers import linear

    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    warm = set()
    monkeypatch.setattr(triton_gemv, "is_warmed_up", lambda x, weight, silu_mul=False: silu_mul in warm)
    assert not linear.small_m_eligible(x, w, None, capturing=False)  # plain eager decode: cuBLAS
    with linear.small_m_graph_warm_up():
        assert linear.small_m_eligible(x, w, None, capturing=False)
    assert not linear.small_m_eligible(x, w, None, capturing=True)  # capture must not autotune
    warm.add(False)
    assert not linear.small_m_eligible(x, w, None, capturing=False)
    assert linear.small_m_eligible(x, w, None, capturing=True)


def test_small_m_gemv_is_on_by_default_and_can_be_turned_off(monkeypatch):
    from fastdeploy import envs
    from fastdeploy.model_executor.layers.linear import Linear

    monkeypatch.delenv("FD_SMALL_M_GEMV", raising=False)
    assert envs.FD_SMALL_M_GEMV is True
    monkeypatch.setenv("FD_SMALL_M_GEMV", "0")
    assert Linear(8, 8, bias=False).small_m_gemv is False  # forward never looks further


def test_cpu_linear_never_takes_the_triton_path(gemv_on, monkeypatch):
    from fastdeploy.model_executor.layers.linear import Linear

    def boom(*args, **kwargs):
        raise AssertionError("the Triton small-M kernel ran on a CPU tensor")

    monkeypatch.setattr(triton_gemv, "small_m_linear", boom)
    layer = Linear(64, 32, bias=False).to(torch.bfloat16)
    x = _rand(1, 64, dtype=torch.bfloat16, seed=1)
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    gate_up = _rand(2, 128, dtype=torch.bfloat16, seed=2)
    assert torch.equal(layer.forward_silu_mul(gate_up), layer(layer_ops.silu_and_mul(gate_up)))


@pytest.mark.gpu
def test_gpu_linear_dispatch(gemv_on, monkeypatch):
    from fastdeploy.model_executor.layers.linear import Linear, small_m_graph_warm_up

    calls = []
    original = triton_gemv.small_m_linear

    def spy(x, weight, silu_mul=False):
        calls.append((x.shape[0], silu_mul))
        return original(x, weight, silu_mul=silu_mul)

    monkeypatch.setattr(triton_gemv, "small_m_linear", spy)
    layer = Linear(1024, 512, bias=False).to("cuda", torch.bfloat16)
    gate_up = _rand(4, 2048, dtype=torch.bfloat16, seed=3, device="cuda")
    for m in (1, 2, 3, 4):
        x = gate_up[:m, :1024]
        ref = F.linear(x, layer.weight).double()
        assert ((layer(x).double() - ref).norm() / ref.norm()).item() < 5e-3  # eager: cuBLAS
        with small_m_graph_warm_up():  # the warm-up before a capture: the kernel, autotuned
            assert ((layer(x).double() - ref).norm() / ref.norm()).item() < 5e-3
            ref = F.linear(layer_ops.silu_and_mul(gate_up[:m]), layer.weight).double()
            assert ((layer.forward_silu_mul(gate_up[:m]).double() - ref).norm() / ref.norm()).item() < 5e-3
    # silu_mul at M > SILU_FUSE_MAX_M: silu_and_mul, then the linear (the kernel: warm-up)
    assert calls == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
        (3, False),
        (3, False),
        (4, False),
        (4, False),
    ]
    calls.clear()
    layer(_rand(5, 1024, dtype=torch.bfloat16, seed=4, device="cuda"))  # five rows: cuBLAS
    layer.float()(_rand(1, 1024, dtype=torch.float32, seed=4, device="cuda"))  # float32: cuBLAS
    assert calls == []

    layer.bfloat16()
    x = gate_up[:1, :1024]
    expected = original(x, layer.weight)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)  # warm: the Triton kernel is captured
        fused = layer.forward_silu_mul(gate_up[:1])
    graph.replay()
    torch.cuda.synchronize()
    assert calls == [(1, False), (1, True)]
    assert torch.equal(out, expected)
    assert torch.equal(fused, original(gate_up[:1], layer.weight, silu_mul=True))
