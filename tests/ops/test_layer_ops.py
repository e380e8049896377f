"""The C++ CPU layer kernels against float64 references and the torch fallback, on random inputs."""

from __future__ import annotations

import os

import pytest
import torch

from fastdeploy.ops import layer_ops
from fastdeploy.ops.cpu_ops import load_cpu_ops

kernels = load_cpu_ops()
_ORIGINAL_TRITON_KERNELS = layer_ops._triton_kernels
needs_kernels = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be built here")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

raises_from_extension = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a C++ exception thrown by a CPU extension ends the process on the GPU image (torch "
    "2.11+cu130 with the system's g++ 13.3, any flags: tools/probe_cpu_ext_throw.py, "
    "docs/benchmarks.md); the CPU kernels are not used there",
)


def _rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * 2).to(dtype)


def _close(actual, expected, dtype, roundings=1):
    """``roundings``: how many bfloat16 rounding points the op has (each can cost ~0.4%)."""
    err = ((actual.double() - expected.to(actual.device)).abs() / (expected.abs() + 1)).max().item()
    tol = TOL[dtype] * (roundings if dtype == torch.bfloat16 else 1)
    if dtype == torch.bfloat16 and _interpreted_triton_active():
        tol = max(tol, 2e-2)  # the Triton interpreter truncates float -> bfloat16 instead of rounding
    assert err < tol, f"relative error {err}"


def _interpreted_triton_active() -> bool:
    return (
        os.environ.get("TRITON_INTERPRET") == "1"
        and layer_ops._triton_kernels is not _ORIGINAL_TRITON_KERNELS
    )


@pytest.fixture(params=["kernel", "torch", "triton"])
def impl(request, monkeypatch):
    """Run each op through the C++ kernel, the torch fallback and the Triton GPU kernels
    (in Triton's interpreter on a CPU-only machine)."""
    if request.param == "kernel":
        if kernels is None:
            pytest.skip("CPU kernels could not be built here")
        return request.param
    monkeypatch.setattr(layer_ops, "_cpu_kernels", lambda x: None)
    if request.param == "triton":
        triton_ops = layer_ops.load_triton_ops()
        if triton_ops is None:
            pytest.skip("triton is not installed")
        if os.environ.get("TRITON_INTERPRET") != "1":  # these inputs are CPU tensors
            pytest.skip("the Triton interpreter is off (on a GPU: test_triton_kernels_on_the_gpu_*)")
        monkeypatch.setattr(layer_ops, "_triton_kernels", lambda x: triton_ops)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 576, 100])
def test_rms_norm(impl, dtype, n):
    x, w = _rand(7, n, dtype=dtype), _rand(n, dtype=dtype, seed=1)
    xd = x.double()
    ref = w.double() * xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    _close(layer_ops.rms_norm(x, w, 1e-5), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [576, 100])
def test_fused_add_rms_norm(impl, dtype, n):
    x, r, w = _rand(5, n, dtype=dtype), _rand(5, n, dtype=dtype, seed=2), _rand(n, dtype=dtype, seed=3)
    summed = (x.double() + r.double()).to(dtype).double()
    ref = w.double() * summed / (summed.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    out, residual = layer_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    _close(residual, summed, dtype)
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_embedding_rotates_only_the_leading_heads(impl, dtype, head_dim):
    tokens, heads, extra = 6, 4, 3  # rotate 4 heads of each row, leave 3 untouched
    width = (heads + extra) * head_dim
    buf = _rand(tokens, width + 8, dtype=dtype)  # strided rows: a view of a wider buffer
    x = buf[:, :width]
    before = x.clone()
    positions = torch.tensor([0, 3, 7, 100, 5, 31])
    angles = (
        torch.rand(128, head_dim // 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 6
    )
    cos, sin = angles.cos().float(), angles.sin().float()
    layer_ops.rotary_embedding_(positions, x, cos, sin, heads, head_dim)
    h = before[:, : heads * head_dim].double().view(tokens, heads, head_dim)
    x1, x2 = h.chunk(2, dim=-1)
    c, s = cos[positions].double().unsqueeze(1), sin[positions].double().unsqueeze(1)
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).view(tokens, -1)
    _close(x[:, : heads * head_dim], ref, dtype)
    assert torch.equal(x[:, heads * head_dim :], before[:, heads * head_dim :])
    assert torch.equal(buf[:, width:], _rand(tokens, width + 8, dtype=dtype)[:, width:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 4, 2), (40, 3, 5)])
def test_qk_norm_rotary_normalizes_each_head_then_rotates_q_and_k(impl, dtype, head_dim, heads, kv_heads):
    """Qwen3's q/k path: RMSNorm per head with the q or k weight, then rotary; v untouched."""
    tokens, eps = 6, 1e-6
    width = (heads + 2 * kv_heads) * head_dim
    buf = _rand(tokens, width + 8, dtype=dtype)  # strided rows: a view of a wider buffer
    qkv = buf[:, :width]
    before = qkv.clone()
    q_w, k_w = _rand(head_dim, dtype=dtype, seed=7), _rand(head_dim, dtype=dtype, seed=8)
    positions = torch.tensor([0, 3, 7, 100, 5, 31])
    angles = (
        torch.rand(128, head_dim // 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 6
    )
    cos, sin = angles.cos().float(), angles.sin().float()
    layer_ops.qk_norm_rotary_(positions, qkv, q_w, k_w, eps, cos, sin, heads, kv_heads, head_dim)
    c, s = cos[positions].double().unsqueeze(1), sin[positions].double().unsqueeze(1)

    def reference(part: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
        h = part.double().view(tokens, n, head_dim)
        h = weight.double() * h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        x1, x2 = h.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).view(tokens, -1)

    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    # bfloat16: rounded after the norm, after the weight, and after the rotation (three points)
    _close(qkv[:, :q_end], reference(before[:, :q_end], q_w, heads), dtype, roundings=3)
    _close(qkv[:, q_end:k_end], reference(before[:, q_end:k_end], k_w, kv_heads), dtype, roundings=3)
    assert torch.equal(qkv[:, k_end:], before[:, k_end:])
    assert torch.equal(buf[:, width:], _rand(tokens, width + 8, dtype=dtype)[:, width:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1536, 40])
def test_silu_and_mul(impl, dtype, n):
    gate_up = _rand(9, 2 * n, dtype=dtype)
    g, u = gate_up.double().split(n, dim=-1)
    ref = g / (1 + (-g).exp()) * u
    _close(layer_ops.silu_and_mul(gate_up), ref, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fallback_closely(dtype):
    """Same rounding points: the kernel and the fallback differ only by float32 summation order."""
    x, w = _rand(16, 576, dtype=dtype), _rand(576, dtype=dtype, seed=5)
    diff = (kernels_out := layer_ops.rms_norm(x, w, 1e-5)).float() - layer_ops._rms_norm_torch(
        x, w, 1e-5
    ).float()
    step = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert diff.abs().max().item() <= step * kernels_out.float().abs().max().item()


@needs_kernels
@raises_from_extension
def test_write_cache_skips_negative_slots_and_checks_bounds():
    cache = _rand(4, 16, 3, 64, dtype=torch.bfloat16)
    before = cache.clone()
    src = _rand(5, 3, 64, dtype=torch.bfloat16, seed=6)
    slots = torch.tensor([3, -1, 17, 63, -1])
    kernels.write_cache(src, cache, slots)
    flat, flat_before = cache.view(-1, 3, 64), before.view(-1, 3, 64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], src[t])
    untouched = [i for i in range(64) if i not in (3, 17, 63)]
    assert torch.equal(flat[untouched], flat_before[untouched])
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_cache(src, cache, torch.tensor([0, 1, 2, 3, 64]))


@needs_kernels
@raises_from_extension
def test_kernels_reject_bad_shapes():
    x = _rand(4, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.empty_like(x), x, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.silu_and_mul(torch.empty(4, 32, dtype=torch.float16), torch.empty(4, 64, dtype=torch.float16))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_flash_on_cpu_uses_the_kernel_and_matches_the_fallback(dtype, monkeypatch):
    from fastdeploy.ops import cache_ops

    qkv = _rand(6, 5 * 64, dtype=dtype)  # strided key/value views, as the model passes them
    key, value = qkv[:, 3 * 64 : 4 * 64].view(6, 1, 64), qkv[:, 4 * 64 :].view(6, 1, 64)
    slots = torch.tensor([5, -1, 0, 31, 16, -1])
    caches = [_rand(2, 16, 1, 64, dtype=dtype, seed=s) for s in (7, 8)]
    expected = [c.clone() for c in caches]
    cache_ops.reshape_and_cache_flash_torch(key, value, *expected, slots)
    monkeypatch.setattr(cache_ops, "reshape_and_cache_flash_torch", None)  # must not be needed
    cache_ops.reshape_and_cache_flash(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_on_the_gpu_match_the_torch_path(dtype):
    """The real (compiled) Triton kernels against the torch fallback, both on the GPU."""
    triton_ops = layer_ops.load_triton_ops()
    if triton_ops is None:
        pytest.skip("triton is not installed")
    x, r, w = (_rand(33, 4096, dtype=dtype, seed=s).cuda() for s in (1, 2, 3))
    w = w[0]
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    ref = layer_ops._rms_norm_torch(x, w, 1e-5).double()
    assert ((triton_ops.rms_norm(x, w, 1e-5).double() - ref).abs() / (ref.abs() + 1)).max() < tol
    summed = x + r
    ref = layer_ops._rms_norm_torch(summed, w, 1e-6).double()
    out, residual = triton_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    assert torch.equal(residual, summed)
    assert ((out.double() - ref).abs() / (ref.abs() + 1)).max() < tol
    gate_up = _rand(17, 2 * 1536, dtype=dtype, seed=4).cuda()
    g, u = gate_up.split(1536, dim=-1)
    ref = (torch.nn.functional.silu(g) * u).double()
    assert ((triton_ops.silu_and_mul(gate_up).double() - ref).abs() / (ref.abs() + 1)).max() < tol
    qkv = _rand(9, 48 * 128, dtype=dtype, seed=5).cuda()
    positions = torch.tensor([0, 1, 5, 9, 100, 7, 3, 2, 4095], device="cuda")
    angles = torch.rand(4096, 64, device="cuda", dtype=torch.float64) * 6
    cos, sin = angles.cos().float(), angles.sin().float()
    expected = qkv.clone()
    monkey = layer_ops._triton_kernels
    try:
        layer_ops._triton_kernels = lambda t: None  # the torch path on the same GPU tensors
        layer_ops.rotary_embedding_(positions, expected, cos, sin, 40, 128)
    finally:
        layer_ops._triton_kernels = monkey
    triton_ops.rotary_embedding_(positions, qkv, cos, sin, 40, 128)
    assert ((qkv.double() - expected.double()).abs() / (expected.double().abs() + 1)).max() < tol
    qkv = _rand(9, 48 * 128, dtype=dtype, seed=6).cuda()
    q_w, k_w = (_rand(128, dtype=dtype, seed=s).cuda() for s in (7, 8))
    expected = qkv.clone()
    try:
        layer_ops._triton_kernels = lambda t: None
        layer_ops.qk_norm_rotary_(positions, expected, q_w, k_w, 1e-6, cos, sin, 32, 8, 128)
    finally:
        layer_ops._triton_kernels = monkey
    triton_ops.qk_norm_rotary_(positions, qkv, q_w, k_w, 1e-6, cos, sin, 32, 8, 128)
    qk_tol = tol * (3 if dtype == torch.bfloat16 else 1)  # the torch path rounds the rotation's products too
    assert ((qkv.double() - expected.double()).abs() / (expected.double().abs() + 1)).max() < qk_tol


def _triton_ops_and_device():
    """The Triton layer ops and where they run (a GPU, or the interpreter on a CPU), or a skip."""
    triton_ops = layer_ops.load_triton_ops()
    if triton_ops is None:
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and the Triton interpreter is off")
    return triton_ops, device


def _rotary_cache_case(device: str, hq: int, hkv: int, dim: int, slots: list[int]):
    """Random qkv rows (one a slot; a negative slot writes nothing), positions, float32 cos / sin
    tables and two random NHD caches of 2 blocks of 16."""
    tokens = len(slots)
    qkv = _rand(tokens, (hq + 2 * hkv) * dim, dtype=torch.float32).to(device)
    positions = torch.tensor([0, 5, 9, 17, 3, 40, 2][:tokens], device=device)
    angles = torch.rand(64, dim // 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 6
    cos, sin = angles.cos().float().to(device), angles.sin().float().to(device)
    caches = [_rand(2, 16, hkv, dim, dtype=torch.float32, seed=s).to(device) for s in (4, 5)]
    return qkv, positions, torch.tensor(slots, device=device), cos, sin, caches


def test_fused_rotary_and_cache_write_equals_the_two_ops(monkeypatch):
    """The GPU kernel that rotates q/k and writes k/v to the cache, against rotary + cache write."""
    triton_ops, device = _triton_ops_and_device()
    from fastdeploy.ops.cache_ops import reshape_and_cache_flash_torch

    tokens, hq, hkv, dim = 7, 6, 2, 64
    qkv, positions, slots, cos, sin, caches = _rotary_cache_case(
        device, hq, hkv, dim, [3, -1, 8, 30, 12, 0, 21]
    )

    expected_qkv, expected_caches = qkv.clone(), [c.clone() for c in caches]
    monkeypatch.setattr(layer_ops, "_cpu_kernels", lambda x: None)
    monkeypatch.setattr(layer_ops, "_triton_kernels", lambda x: None)
    layer_ops.rotary_embedding_(positions, expected_qkv, cos, sin, hq + hkv, dim)
    views = expected_qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    k_ref = views[1].reshape(tokens, hkv, dim)
    v_ref = views[2].reshape(tokens, hkv, dim)
    reshape_and_cache_flash_torch(k_ref, v_ref, *expected_caches, slots)

    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    triton_ops.rotary_and_cache_(positions, q, k, v, cos, sin, *caches, slots)
    assert torch.allclose(qkv, expected_qkv, atol=1e-5)
    assert torch.allclose(caches[0], expected_caches[0], atol=1e-5)
    assert torch.equal(caches[1], expected_caches[1])


def test_qk_norm_rotary_with_the_cache_write_equals_the_ops_apart(monkeypatch):
    """Qwen3's q/k norm and rotary kernel writing the keys and values to their cache slots too
    (a negative slot writes nothing), against the torch norms, rotary and cache write."""
    triton_ops, device = _triton_ops_and_device()
    hq, hkv, dim = 6, 2, 64
    qkv, positions, slots, cos, sin, caches = _rotary_cache_case(device, hq, hkv, dim, [3, -1, 8, 30, 12])
    q_w, k_w = (_rand(dim, dtype=torch.float32, seed=s).to(device) for s in (7, 8))

    expected_qkv, expected_caches = qkv.clone(), [c.clone() for c in caches]
    with monkeypatch.context() as patch:
        patch.setattr(layer_ops, "_triton_kernels", lambda x: None)  # the torch ops, one after the other
        layer_ops.qk_norm_rotary_(
            positions, expected_qkv, q_w, k_w, 1e-6, cos, sin, hq, hkv, dim, (*expected_caches, slots)
        )
    untouched = [c.clone() for c in caches]
    triton_ops.qk_norm_rotary_(positions, qkv, q_w, k_w, 1e-6, cos, sin, hq, hkv, dim, (*caches, slots))
    assert torch.allclose(qkv, expected_qkv, atol=1e-5)
    assert torch.allclose(caches[0], expected_caches[0], atol=1e-5)
    assert torch.equal(caches[1], expected_caches[1])
    written = torch.zeros(2 * 16, dtype=torch.bool)
    written[[3, 8, 30, 12]] = True
    for cache, before in zip(caches, untouched):  # only the four slots changed
        changed = (cache.cpu() != before.cpu()).reshape(2 * 16, -1).any(dim=1)
        assert torch.equal(changed, written)
