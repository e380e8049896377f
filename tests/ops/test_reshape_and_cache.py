"""reshape_and_cache_flash on random inputs: the torch fallback (CPU and CUDA) and the CUDA kernel.

Every test takes the ``impl`` fixture; the CUDA variants are marked ``gpu``
(skipped without a device) and the kernel is skipped when fastdeploy_ops is
not built. The references are float64 computations per token and head.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from op_impls import IMPL_PARAMS, Impl, select_impl

from fastdeploy.ops import (
    _ext,
    cache_ops,
    has_cuda_ops,
    reshape_and_cache_flash,
    reshape_and_cache_flash_torch,
)
from fastdeploy.ops._ext import cuda_op
from fastdeploy.ops.cache_ops import FP8_E4M3_MAX, FP8_SCALE_FLOOR, quantize_fp8_e4m3_per_head

NUM_BLOCKS, BLOCK_SIZE, HEADS, TOKENS = 12, 16, 4, 37


def _kernel(
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=None, v_scale=None
):
    # the public wrapper: it validates in Python, then calls the kernel for CUDA tensors
    assert key.is_cuda and cuda_op("reshape_and_cache_flash") is not None
    cache_ops.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )


@pytest.fixture(params=IMPL_PARAMS)
def impl(request) -> Impl:
    return select_impl(request.param, reshape_and_cache_flash_torch, _kernel)


@pytest.fixture
def fp8_impl(impl: Impl) -> Impl:
    if not impl.fp8_capable():
        pytest.skip("fp8 KV cache needs compute capability 8.9")
    return impl


def _inputs(gen: torch.Generator, dtype: torch.dtype, head_dim: int, tokens: int = TOKENS):
    """Random key/value whose heads differ in magnitude (so per-head scales matter) and slots with padding."""
    magnitude = torch.exp(2 * torch.randn(tokens, HEADS, 1, generator=gen))
    key = (torch.randn(tokens, HEADS, head_dim, generator=gen) * magnitude).to(dtype)
    value = (torch.randn(tokens, HEADS, head_dim, generator=gen) * magnitude.flip(0)).to(dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    slots[::5] = -1
    return key, value, slots


def _fp8_caches(gen: torch.Generator, head_dim: int):
    """Random fp8 bytes (NaN codes avoided) and random scales, to show which rows were written."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, HEADS, head_dim)
    caches = [
        torch.randint(0, 0x7E, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for _ in "kv"
    ]
    scales = [torch.rand(shape[:3], generator=gen) + 0.5 for _ in "kv"]
    return caches, scales


def _to(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_auto_copies_every_valid_token_and_skips_padding(impl, dtype, head_dim, slot_dtype):
    gen = torch.Generator().manual_seed(head_dim)
    key, value, slots = _inputs(gen, dtype, head_dim)
    key_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HEADS, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HEADS, head_dim, generator=gen).to(dtype)
    ref_k, ref_v = key_cache.double(), value_cache.double()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            ref_k[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[t].double()
            ref_v[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[t].double()
    k, v, kc, vc, s = _to(impl.device, key, value, key_cache, value_cache, slots.to(slot_dtype))
    impl.fn(k, v, kc, vc, s, "auto")
    assert torch.equal(kc.cpu().double(), ref_k)
    assert torch.equal(vc.cpu().double(), ref_v)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_stores_per_head_scales_and_values_within_e4m3_error(fp8_impl, dtype, head_dim, kv_cache_dtype):
    gen = torch.Generator().manual_seed(1000 + head_dim)
    key, value, slots = _inputs(gen, dtype, head_dim)
    (key_cache, value_cache), (k_scale, v_scale) = _fp8_caches(gen, head_dim)
    before = [t.clone() for t in (key_cache, value_cache, k_scale, v_scale)]
    args = _to(fp8_impl.device, key, value, key_cache, value_cache, slots, k_scale, v_scale)
    fp8_impl.fn(*args[:5], kv_cache_dtype, *args[5:])
    outputs = [t.cpu() for t in args[2:4] + args[5:]]
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    for x, cache, scale in ((key, outputs[0], outputs[2]), (value, outputs[1], outputs[3])):
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            written[slot] = True
            block, offset = divmod(slot, BLOCK_SIZE)
            exact = x[t].double()  # [HEADS, head_dim]
            expected_scale = (exact.abs().amax(-1) / FP8_E4M3_MAX).clamp_min(FP8_SCALE_FLOOR).float()
            assert torch.equal(scale[block, offset], expected_scale), (t, slot)
            q = cache[block, offset].double()
            assert torch.equal(q.abs().amax(-1), torch.full((HEADS,), FP8_E4M3_MAX, dtype=torch.float64))
            err = (q * scale[block, offset, :, None].double() - exact).abs()
            bound = exact.abs() / 16 + scale[block, offset, :, None].double() * (2**-10 + 1e-6)
            assert bool((err <= bound).all()), (t, slot, float((err - bound).max()))
    for got, old in zip(outputs, before):
        flat_got, flat_old = got.view(NUM_BLOCKS * BLOCK_SIZE, -1), old.view(NUM_BLOCKS * BLOCK_SIZE, -1)
        assert torch.equal(flat_got[~written].view(torch.uint8), flat_old[~written].view(torch.uint8))


def test_fp8_accepts_a_uint8_cache_and_a_zero_head_gets_the_floor_scale(fp8_impl):
    gen = torch.Generator().manual_seed(7)
    key, value, slots = _inputs(gen, torch.bfloat16, 128)
    key[:, 1] = 0  # one all-zero head in every token: scale = floor, values 0, never NaN
    (key_cache, value_cache), (k_scale, v_scale) = _fp8_caches(gen, 128)
    args = _to(fp8_impl.device, key, value, key_cache.view(torch.uint8), value_cache.view(torch.uint8), slots)
    scales = _to(fp8_impl.device, k_scale, v_scale)
    fp8_impl.fn(*args, "fp8_e4m3", *scales)
    valid = slots[slots >= 0]
    stored_k = args[2].cpu().view(torch.float8_e4m3fn).view(-1, HEADS, 128)[valid]
    stored_scale = scales[0].cpu().view(-1, HEADS)[valid]
    assert torch.equal(stored_scale[:, 1], torch.full((len(valid),), FP8_SCALE_FLOOR, dtype=torch.float32))
    assert torch.equal(stored_k[:, 1].float(), torch.zeros(len(valid), 128))
    dequant = cache_ops.dequantize_fp8_e4m3_per_head(args[2].cpu(), scales[0].cpu()).view(-1, HEADS, 128)[
        valid
    ]
    assert torch.isfinite(dequant).all()
    exact = key[slots >= 0].float()
    assert bool(
        ((dequant - exact).abs() <= exact.abs() / 16 + stored_scale[..., None] * (2**-10 + 1e-6)).all()
    )


def test_quantize_definition_on_exactly_representable_values():
    gen = torch.Generator().manual_seed(3)
    codes = torch.tensor([-448.0, 224.0, 96.0, 40.0, -13.0, 0.5, 320.0, -2.5])  # all e4m3 numbers
    magnitude = torch.exp(torch.randn(5, 1, generator=gen))
    quantized, scale = quantize_fp8_e4m3_per_head(codes / 224 * magnitude)
    assert torch.equal(scale, ((2.0 * magnitude[:, 0]).double() / FP8_E4M3_MAX).float())
    # x / (absmax / 448) = codes up to float32 rounding, far from any e4m3 rounding boundary
    assert torch.equal(quantized.float(), codes.expand(5, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("layout", ["qkv_slice", "head_major", "padded_head"])
def test_strided_key_value_views_match_contiguous_copies(impl, kv_cache_dtype, layout, dtype):
    if kv_cache_dtype != "auto" and not impl.fp8_capable():
        pytest.skip("fp8 KV cache needs compute capability 8.9")
    gen = torch.Generator().manual_seed(11)
    head_dim = 64
    if layout == "qkv_slice":  # k and v cut out of one fused projection output
        qkv = torch.randn(TOKENS, (8 + 2 * HEADS) * head_dim, generator=gen).to(dtype)
        key = qkv[:, 8 * head_dim : (8 + HEADS) * head_dim].view(TOKENS, HEADS, head_dim)
        value = qkv[:, (8 + HEADS) * head_dim :].view(TOKENS, HEADS, head_dim)
    elif layout == "head_major":
        key = torch.randn(HEADS, TOKENS, head_dim, generator=gen).to(dtype).transpose(0, 1)
        value = torch.randn(HEADS, TOKENS, head_dim, generator=gen).to(dtype).transpose(0, 1)
    else:  # odd head strides and a misaligned start: the kernel's unvectorised path
        key = torch.randn(TOKENS, HEADS, head_dim + 3, generator=gen).to(dtype)[..., :head_dim]
        value = torch.randn(TOKENS, HEADS, head_dim + 3, generator=gen).to(dtype)[..., 3:]
    assert not key.is_contiguous() and not value.is_contiguous()
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:TOKENS]
    slots[1::4] = -1
    if kv_cache_dtype == "auto":
        caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, HEADS, head_dim, generator=gen).to(dtype) for _ in "kv"]
        scales = [None, None]
    else:
        caches, scales = _fp8_caches(gen, head_dim)
    results = []
    for k, v in ((key, value), (key.contiguous(), value.contiguous())):
        out_caches = _to(impl.device, *[c.clone() for c in caches])
        out_scales = [None if s is None else s.clone().to(impl.device) for s in scales]
        k, v, s = _to(impl.device, k, v, slots)
        impl.fn(k, v, *out_caches, s, kv_cache_dtype, *out_scales)
        results.append([t.cpu() for t in out_caches + out_scales if t is not None])
    for strided, contiguous in zip(*results):
        assert torch.equal(strided.view(torch.uint8), contiguous.view(torch.uint8))


def test_only_the_first_len_slot_mapping_tokens_are_written(impl):
    gen = torch.Generator().manual_seed(5)
    key = torch.randn(8, 2, 64, generator=gen)
    cache_k, cache_v = torch.randn(2, 4, 2, 64, generator=gen), torch.randn(2, 4, 2, 64, generator=gen)
    before = cache_k.clone()
    k, ck, cv, s = _to(impl.device, key, cache_k, cache_v, torch.tensor([0, 1, 2]))
    impl.fn(k, k, ck, cv, s, "auto")
    assert torch.equal(ck.cpu().view(-1, 2, 64)[:3], key[:3])
    assert torch.equal(ck.cpu().view(-1, 2, 64)[3:], before.view(-1, 2, 64)[3:])


def _bad_args(**changes):
    gen = torch.Generator().manual_seed(9)
    args = {
        "key": torch.randn(4, 2, 64, generator=gen),
        "value": torch.randn(4, 2, 64, generator=gen),
        "key_cache": torch.randn(2, 4, 2, 64, generator=gen),
        "value_cache": torch.randn(2, 4, 2, 64, generator=gen),
        "slot_mapping": torch.arange(4),
        "kv_cache_dtype": "auto",
        "k_scale": None,
        "v_scale": None,
    }
    if changes.pop("fp8", False):
        fp8_cache = torch.randint(0, 0x7E, (2, 4, 2, 64), generator=gen, dtype=torch.uint8)
        args.update(key_cache=fp8_cache, value_cache=fp8_cache.clone(), kv_cache_dtype="fp8_e4m3")
        args.update(k_scale=torch.rand(2, 4, 2, generator=gen), v_scale=torch.rand(2, 4, 2, generator=gen))
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"key": torch.randn(4, 2, 32), "value": torch.randn(4, 2, 32)}, "heads/head_dim"),
        ({"slot_mapping": torch.rand(4)}, "int32 or int64"),
        ({"slot_mapping": torch.arange(9)}, "at most"),
        ({"value_cache": torch.randn(3, 4, 2, 64)}, "key_cache and value_cache"),
        ({"key_cache": torch.randn(2, 4, 2, 64).half()}, "input dtype"),
        ({"kv_cache_dtype": "int8"}, "unsupported kv_cache_dtype 'int8'"),
        ({"fp8": True, "k_scale": None}, "needs k_scale"),
        ({"fp8": True, "v_scale": torch.rand(2, 4, 3)}, r"v_scale must be \[num_blocks"),
        ({"fp8": True, "k_scale": torch.rand(2, 4, 2).half()}, "k_scale must be float32"),
        ({"fp8": True, "key_cache": torch.randn(2, 4, 2, 64)}, "float8_e4m3fn or uint8"),
    ],
)
def test_invalid_arguments_are_refused_with_a_clear_error(impl, changes, message):
    if changes.get("fp8") and not impl.fp8_capable():
        pytest.skip("fp8 KV cache needs compute capability 8.9")
    args = {
        name: (t.to(impl.device) if isinstance(t, torch.Tensor) else t)
        for name, t in _bad_args(**changes).items()
    }
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        impl.fn(**args)


@pytest.mark.gpu
def test_fp8_is_refused_below_compute_capability_8_9(impl):
    if impl.device != "cuda" or impl.fp8_capable():
        pytest.skip("needs a CUDA GPU older than compute capability 8.9")
    args = {name: (t.cuda() if isinstance(t, torch.Tensor) else t) for name, t in _bad_args(fp8=True).items()}
    with pytest.raises(RuntimeError, match="compute capability 8.9"):
        impl.fn(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_stores_the_same_bits_as_the_cpu_fallback(impl, dtype, kv_cache_dtype):
    if impl.name != "kernel-cuda" or (kv_cache_dtype != "auto" and not impl.fp8_capable()):
        pytest.skip("compares the CUDA kernel (fp8 needs compute capability 8.9) with the CPU fallback")
    gen = torch.Generator().manual_seed(21)
    key, value, slots = _inputs(gen, dtype, 128)
    if kv_cache_dtype == "auto":
        caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, HEADS, 128, generator=gen).to(dtype) for _ in "kv"]
        scales = [None, None]
    else:
        caches, scales = _fp8_caches(gen, 128)
    cpu = [t.clone() for t in caches] + [None if s is None else s.clone() for s in scales]
    reshape_and_cache_flash_torch(key, value, cpu[0], cpu[1], slots, kv_cache_dtype, cpu[2], cpu[3])
    gpu = [None if t is None else t.cuda() for t in caches + scales]
    impl.fn(key.cuda(), value.cuda(), gpu[0], gpu[1], slots.cuda(), kv_cache_dtype, gpu[2], gpu[3])
    for got, expected in zip(gpu, cpu):
        if expected is not None:
            assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
def test_kernel_refuses_a_strided_head_dim(impl):
    if impl.name != "kernel-cuda":
        pytest.skip("only the kernel needs unit stride in head_dim")
    args = {name: (t.cuda() if isinstance(t, torch.Tensor) else t) for name, t in _bad_args().items()}
    args["key"] = torch.randn(4, 2, 128, device="cuda")[..., ::2]
    with pytest.raises((RuntimeError, ValueError), match="unit stride"):
        impl.fn(**args)


def test_public_function_takes_the_kernel_only_for_cuda_tensors(monkeypatch):
    calls = []
    monkeypatch.setattr(_ext, "_load", lambda: True)  # pretend fastdeploy_ops is loaded
    monkeypatch.setattr(cache_ops, "cuda_op", lambda name: lambda *args: calls.append((name, args)))
    monkeypatch.setenv("FD_DISABLE_CUSTOM_OPS", "0")
    assert has_cuda_ops()
    gen = torch.Generator().manual_seed(13)
    key, value, slots = _inputs(gen, torch.float32, 64)
    caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, HEADS, 64, generator=gen) for _ in "kv"]
    reshape_and_cache_flash(key, value, *caches, slots, "auto")  # CPU tensors: the torch path
    assert calls == []
    assert torch.equal(caches[0].view(-1, HEADS, 64)[slots[slots >= 0]], key[slots >= 0])
    cuda_key = SimpleNamespace(is_cuda=True)  # stands in for a CUDA tensor
    monkeypatch.setattr(cache_ops, "_validate", lambda *args: True)  # the stand-in has no shape to check
    reshape_and_cache_flash(cuda_key, value, *caches, slots, "fp8")
    assert calls == [("reshape_and_cache_flash", (cuda_key, value, *caches, slots, "fp8", None, None))]
    monkeypatch.setenv("FD_DISABLE_CUSTOM_OPS", "1")
    assert not has_cuda_ops()


@pytest.mark.gpu
def test_public_function_uses_the_kernel_for_cuda_tensors(monkeypatch):
    if not has_cuda_ops():
        pytest.skip("fastdeploy_ops is not built")

    def refuse(*args):
        raise AssertionError("the torch fallback ran although the kernel is loaded")

    monkeypatch.setattr(cache_ops, "reshape_and_cache_flash_torch", refuse)
    gen = torch.Generator().manual_seed(17)
    key, value, slots = _inputs(gen, torch.float16, 128)
    caches = _to(
        "cuda", *[torch.randn(NUM_BLOCKS, BLOCK_SIZE, HEADS, 128, generator=gen).half() for _ in "kv"]
    )
    reshape_and_cache_flash(key.cuda(), value.cuda(), *caches, slots.cuda(), "auto")
    assert torch.equal(caches[1].cpu().view(-1, HEADS, 128)[slots[slots >= 0]], value[slots >= 0])
