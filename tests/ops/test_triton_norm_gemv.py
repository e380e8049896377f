"""RMSNorm + small-M linear (+ rotary and cache write) in one Triton kernel, against float64
references and the unfused ops, on random inputs.

On a CPU-only machine the kernel runs in Triton's interpreter (small shapes); the GPU
tests run the compiled, autotuned kernel on Llama-3.2-1B and 3.1-8B shapes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

triton_norm_gemv = pytest.importorskip("fastdeploy.ops.triton_norm_gemv")

from fastdeploy.ops import layer_ops  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_backend = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)
EPS = 1e-5
CONFIG = {"BLOCK_N": 16, "BLOCK_K": 64, "STAGES": 1}


def _rand(*shape, dtype, seed, device=DEVICE, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def _inputs(m, n, k, dtype, seed=0):
    x = _rand(m, k, dtype=dtype, seed=seed)
    residual = _rand(m, k, dtype=dtype, seed=seed + 1)
    norm_w = (1 + _rand(k, dtype=torch.float64, seed=seed + 2, scale=0.2)).to(dtype).to(DEVICE)
    w = _rand(n, k, dtype=dtype, seed=seed + 3, scale=0.1)
    return x, residual, norm_w, w


def _reference(x, residual, norm_w, w):
    """float64 ``rms_norm(h) @ w.T`` with ``h = x + residual`` rounded to x.dtype (the unfused add)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h64 = h.cpu().double()
    normed = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.cpu().double()
    return normed @ w.cpu().double().T, h


def _rel_err(out, ref):
    assert not out.isnan().any(), "unwritten (NaN) outputs"
    return ((out.cpu().double() - ref).norm() / ref.norm()).item()


def _tol(dtype):
    """bf16 rounds the output to 8 bits (the interpreter truncates: about twice the error)."""
    if dtype == torch.bfloat16:
        return 8e-3 if CUDA else 2e-2
    return 1e-5


def _assert_residual(res_out, h):
    """The new residual is ``x + residual`` rounded once (the interpreter truncates: one ulp)."""
    if h.dtype == torch.float32 or CUDA:
        assert torch.equal(res_out, h)
    else:
        assert torch.allclose(res_out.float(), h.float(), rtol=2**-7, atol=0)


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("n,k", [(100, 200), (64, 256)])
def test_matches_float64_reference(n, k, with_residual, dtype):
    """Both row counts, with and without a residual, K and N tails (100 x 200) and even tiles."""
    config = None if CUDA else CONFIG
    for m in range(1, triton_norm_gemv.NORM_FUSE_MAX_M + 1):
        x, residual, norm_w, w = _inputs(m, n, k, dtype, seed=m)
        residual = residual if with_residual else None
        x_before = x.clone()
        res_before = None if residual is None else residual.clone()
        out, res_out = triton_norm_gemv.norm_small_m_linear(x, residual, norm_w, EPS, w, config=config)
        ref, h = _reference(x, residual, norm_w, w)
        assert out.shape == (m, n) and out.dtype == dtype
        err = _rel_err(out, ref)
        assert err < _tol(dtype), f"M={m}: relative error {err}"
        assert torch.equal(x, x_before), "x must not be updated in place"
        if residual is None:
            assert res_out is x
        else:
            assert torch.equal(residual, res_before), "residual must not be updated in place"
            _assert_residual(res_out, h)


@needs_backend
@pytest.mark.parametrize("m", [1, 2])
def test_bf16_fused_equals_the_unfused_ops(m):
    """Against the engine's own ops: fused_add_rms_norm then F.linear, in bf16."""
    x, residual, norm_w, w = _inputs(m, 96, 128, torch.bfloat16, seed=5)
    config = None if CUDA else CONFIG
    out, res_out = triton_norm_gemv.norm_small_m_linear(x, residual, norm_w, EPS, w, config=config)
    normed, summed = layer_ops.fused_add_rms_norm(x.clone(), residual.clone(), norm_w, EPS)
    unfused = F.linear(normed, w).double()
    assert ((out.double() - unfused).norm() / unfused.norm()).item() < _tol(torch.bfloat16)
    _assert_residual(res_out, summed)


def _rope_tables(head_dim, max_pos=64):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def _rotate(t, cos, sin, dtype):
    """NeoX rotation of heads ``t`` [H, D] (float32, already rounded), cos/sin rounded to dtype."""
    half = t.shape[-1] // 2
    a, b = t[:, :half], t[:, half:]
    c, s = cos.to(dtype).float(), sin.to(dtype).float()
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rotary_epilogue_rotates_and_writes_the_cache(head_dim, dtype):
    """q and k rotated at each row's position, k and v in the cache at the row's slot (the
    row with slot -1 writes nothing), every other cache row untouched."""
    hq, hkv, k = 4, 2, 192
    n = (hq + 2 * hkv) * head_dim
    m = 2
    x, residual, norm_w, w = _inputs(m, n, k, dtype, seed=9)
    cos, sin = _rope_tables(head_dim)
    positions = torch.tensor([7, 30], device=DEVICE)
    slots = torch.tensor([5, -1], device=DEVICE)
    key_cache = _rand(3, 4, hkv, head_dim, dtype=dtype, seed=20)
    value_cache = _rand(3, 4, hkv, head_dim, dtype=dtype, seed=21)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    rotary = triton_norm_gemv.RotaryCache(
        positions, cos, sin, slots, key_cache, value_cache, hq, hkv, head_dim
    )
    config = None if CUDA else CONFIG
    out, _ = triton_norm_gemv.norm_small_m_linear(x, residual, norm_w, EPS, w, rotary=rotary, config=config)

    ref, _ = _reference(x, residual, norm_w, w)
    y = ref.to(dtype).float()  # the linear's output rounding
    q_end, k_end = hq * head_dim, (hq + hkv) * head_dim
    for row in range(m):
        pos = positions[row].item()
        q = _rotate(y[row, :q_end].view(hq, head_dim), cos[pos].cpu(), sin[pos].cpu(), dtype)
        kk = _rotate(y[row, q_end:k_end].view(hkv, head_dim), cos[pos].cpu(), sin[pos].cpu(), dtype)
        expected = torch.cat([q.flatten(), kk.flatten(), y[row, k_end:]]).double()
        err = ((out[row].cpu().double() - expected).norm() / expected.norm()).item()
        assert err < _tol(dtype), f"row {row}: relative error {err}"
    flat_k, flat_v = key_cache.view(-1, hkv * head_dim), value_cache.view(-1, hkv * head_dim)
    assert torch.equal(flat_k[5], out[0, q_end:k_end]) and torch.equal(flat_v[5], out[0, k_end:])
    untouched = [i for i in range(12) if i != 5]
    assert torch.equal(flat_k[untouched], k_before.view(-1, hkv * head_dim)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view(-1, hkv * head_dim)[untouched])


@needs_backend
def test_rotary_epilogue_equals_the_unfused_rotary_and_cache_kernel():
    """Same rounding points as triton_layer_ops.rotary_and_cache_ on the unrotated output (fp32)."""
    hq, hkv, d, k = 2, 1, 32, 128
    dtype = torch.float32
    x, residual, norm_w, w = _inputs(1, (hq + 2 * hkv) * d, k, dtype, seed=13)
    cos, sin = _rope_tables(d)
    positions, slots = torch.tensor([11], device=DEVICE), torch.tensor([2], device=DEVICE)
    caches = [torch.zeros(1, 4, hkv, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    rotary = triton_norm_gemv.RotaryCache(positions, cos, sin, slots, caches[0], caches[1], hq, hkv, d)
    config = None if CUDA else CONFIG
    fused, _ = triton_norm_gemv.norm_small_m_linear(x, residual, norm_w, EPS, w, rotary=rotary, config=config)
    plain, _ = triton_norm_gemv.norm_small_m_linear(x, residual, norm_w, EPS, w, config=config)
    q, kk, v = plain.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, kk, v = q.view(1, hq, d), kk.view(1, hkv, d), v.view(1, hkv, d)
    layer_ops.load_triton_ops().rotary_and_cache_(positions, q, kk, v, cos, sin, caches[2], caches[3], slots)
    assert torch.allclose(fused, plain, rtol=1e-6, atol=1e-6)
    assert torch.allclose(caches[0], caches[2], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[1], caches[3])


def test_validation_errors():
    x, w, nw = torch.randn(1, 16), torch.randn(8, 16), torch.ones(16)
    call = triton_norm_gemv.norm_small_m_linear
    with pytest.raises(ValueError, match="1 to 2 rows"):
        call(torch.randn(3, 16), None, nw, EPS, w)
    with pytest.raises(ValueError, match="dtype"):
        call(x.bfloat16(), None, nw, EPS, w)
    with pytest.raises(ValueError, match="does not take"):
        call(torch.randn(1, 17), None, torch.ones(17), EPS, w)
    with pytest.raises(ValueError, match="norm_weight"):
        call(x, None, torch.ones(8), EPS, w)
    with pytest.raises(ValueError, match="residual must match"):
        call(x, torch.randn(2, 16), nw, EPS, w)
    with pytest.raises(ValueError, match="unit stride"):
        call(torch.randn(1, 32)[:, ::2], None, nw, EPS, w)
    cos = sin = torch.zeros(8, 4)
    cache = torch.zeros(2, 4, 1, 8)
    bad = triton_norm_gemv.RotaryCache(
        torch.zeros(1, dtype=torch.long), cos, sin, torch.zeros(1), cache, cache, 2, 1, 8
    )
    with pytest.raises(ValueError, match="q heads"):
        call(x, None, nw, EPS, torch.randn(24, 16), rotary=bad)
    wrong_cache = triton_norm_gemv.RotaryCache(
        torch.zeros(1, dtype=torch.long), cos, sin, torch.zeros(1), torch.zeros(2, 4, 2, 8), cache, 1, 1, 8
    )
    with pytest.raises(ValueError, match="key_cache"):
        call(x, None, nw, EPS, torch.randn(24, 16), rotary=wrong_cache)
    caches = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    fine = triton_norm_gemv.RotaryCache(
        torch.zeros(1, dtype=torch.long), cos, sin, torch.zeros(1), *caches, 2, 1, 8
    )
    with pytest.raises(ValueError, match="splits the head halves"):
        call(
            x,
            None,
            nw,
            EPS,
            torch.randn(32, 16),
            rotary=fine,
            config={"BLOCK_N": 16, "BLOCK_K": 16, "STAGES": 1},
        )


def test_rotary_configurations_keep_pairs_inside_a_head_half():
    for head_dim in (64, 128):
        kept = triton_norm_gemv._prune(triton_norm_gemv._CONFIGS, {}, M=2, ROTARY=True, HEAD_DIM=head_dim)
        assert kept
        for c in kept:
            assert (head_dim // 2) % (c.kwargs["BLOCK_N"] // 2) == 0
            assert 2 * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 16384


# --- dispatch in Linear -------------------------------------------------------------------


def test_forward_normed_on_cpu_is_the_norm_then_the_linear(monkeypatch):
    from fastdeploy.model_executor.layers.layernorm import RMSNorm
    from fastdeploy.model_executor.layers.linear import Linear

    monkeypatch.setenv("FD_SMALL_M_GEMV", "1")

    def boom(*args, **kwargs):
        raise AssertionError("the fused Triton kernel ran on a CPU tensor")

    monkeypatch.setattr(triton_norm_gemv, "norm_small_m_linear", boom)
    layer = Linear(64, 32, bias=False).to(torch.bfloat16)
    norm = RMSNorm(64, EPS).to(torch.bfloat16)
    x = _rand(1, 64, dtype=torch.bfloat16, seed=1, device="cpu")
    residual = _rand(1, 64, dtype=torch.bfloat16, seed=2, device="cpu")
    out, res = layer.forward_normed(x, None, norm)
    assert res is x and torch.equal(out, layer(norm(x)))
    normed, summed = norm(x.clone(), residual.clone())
    out, res = layer.forward_normed(x.clone(), residual.clone(), norm)
    assert torch.equal(out, layer(normed)) and torch.equal(res, summed)


def test_norm_fusable_decisions(monkeypatch):
    from fastdeploy.model_executor.layers import linear

    monkeypatch.setenv("FD_SMALL_M_GEMV", "1")
    monkeypatch.delenv("FD_DISABLE_CUSTOM_OPS", raising=False)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)

    def ok(x, residual=None, weight=w, capturing=False):
        with linear.small_m_graph_warm_up():
            return linear.norm_fusable(x, weight, None, residual, capturing=capturing)

    assert ok(x[:1]) and ok(x) and ok(x, x.clone())
    assert not ok(torch.randn(3, 64, dtype=torch.bfloat16))  # above NORM_FUSE_MAX_M
    assert not ok(x.float(), weight=w.float())
    assert not ok(x, x[:1].clone())  # residual of another shape
    assert not ok(torch.randn(1, 63, dtype=torch.bfloat16))
    assert not linear.norm_fusable(x, w, None, None, capturing=False)  # eager outside the warm-up
    monkeypatch.setenv("FD_SMALL_M_NORM_FUSION", "0")
    assert not ok(x)
    monkeypatch.delenv("FD_SMALL_M_NORM_FUSION")
    warm = set()
    monkeypatch.setattr(
        triton_norm_gemv, "is_warmed_up", lambda x, weight, has_res, rotary=None: has_res in warm
    )
    assert not linear.norm_fusable(x, w, None, x, capturing=True)  # capture must not autotune
    warm.add(True)
    assert linear.norm_fusable(x, w, None, x, capturing=True)


# --- GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim", [(2048, 32, 8, 64), (4096, 32, 8, 128)])
def test_gpu_llama_shapes(hidden, heads, kv_heads, head_dim, m):
    """Autotuned on the Llama-3.2-1B and 3.1-8B qkv (with the epilogue) and gate_up shapes."""
    dtype = torch.bfloat16
    n_qkv = (heads + 2 * kv_heads) * head_dim
    x, residual, norm_w, w = _inputs(m, n_qkv, hidden, dtype, seed=m)
    cos, sin = _rope_tables(head_dim, max_pos=4096)
    positions = torch.tensor([100, 3000][:m], device="cuda")
    slots = torch.tensor([17, 40][:m], device="cuda")
    caches = [torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2)]
    rotary = triton_norm_gemv.RotaryCache(positions, cos, sin, slots, *caches, heads, kv_heads, head_dim)
    out, res_out = triton_norm_gemv.norm_small_m_linear(x, residual, norm_w, EPS, w, rotary=rotary)
    assert triton_norm_gemv.is_warmed_up(x, w, True, rotary)
    pinned, _ = triton_norm_gemv.norm_small_m_linear(
        x, residual, norm_w, EPS, w, rotary=rotary, config=CONFIG
    )
    assert _rel_err(out, pinned.cpu().double()) < 5e-3  # autotuned = a fixed configuration
    normed, summed = layer_ops.fused_add_rms_norm(x.clone(), residual.clone(), norm_w, EPS)
    assert torch.equal(res_out, summed)
    unfused = F.linear(normed, w)  # q, k and v are views of it, as in the model
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q, k, v = (t.view(m, -1, head_dim) for t in unfused.split(sizes, -1))
    ref_caches = [torch.zeros_like(c) for c in caches]
    layer_ops.load_triton_ops().rotary_and_cache_(positions, q, k, v, cos, sin, *ref_caches, slots)
    assert _rel_err(out, unfused.double().cpu()) < 8e-3
    for fused_cache, ref_cache in zip(caches, ref_caches):
        assert _rel_err(fused_cache, ref_cache.double().cpu()) < 8e-3
    # gate_up-like: no epilogue, no residual (the first layer)
    w_up = _rand(4 * hidden, hidden, dtype=dtype, seed=30, scale=0.1)
    out, res_out = triton_norm_gemv.norm_small_m_linear(x, None, norm_w, EPS, w_up)
    ref, _ = _reference(x, None, norm_w, w_up)
    assert res_out is x and _rel_err(out, ref) < 5e-3


@pytest.mark.gpu
def test_gpu_capture_in_cuda_graph_after_warm_up():
    x, residual, norm_w, w = _inputs(1, 6144, 4096, torch.bfloat16, seed=4)
    expected, expected_res = triton_norm_gemv.norm_small_m_linear(x, residual, norm_w, EPS, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res_out = triton_norm_gemv.norm_small_m_linear(x, residual, norm_w, EPS, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(res_out, expected_res)
