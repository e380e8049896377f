"""The decode kernel's prologue (q / k RMSNorm, NeoX rotary, the new keys and values cached) against
a float64 reference on random inputs: the attention output and the cache slots it writes.

Without CUDA the kernel runs in Triton's CPU interpreter; the ``gpu`` cases run it compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from paged_attention_cases import TOLERANCE, make_step, reference, tiny_qwen3  # noqa: E402

from fastdeploy.model_executor.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from fastdeploy.ops.qk_rotary import QKRotary  # noqa: E402
from fastdeploy.ops.triton_attention import decode_attention  # noqa: E402
from fastdeploy.ops.triton_env import triton_interpreting  # noqa: E402

INTERPRETED = triton_interpreting()
DECODES = [(0, 1), (4, 1), (15, 1), (16, 1), (39, 1), (130, 1), (299, 1)]
EPS = 1e-6


def _norm_rope64(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Heads ``x [T, H, D]`` RMS-normalized times ``weight`` (if given), then rotated; float64."""
    x = x.double()
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _case(heads, kv_heads, head_dim, dtype, splits, norm, device="cpu", factor=1, seed=0):
    shapes = [(ctx * factor, 1) for ctx, _ in DECODES]
    layer, q_raw, common = make_step(shapes, heads, kv_heads, head_dim, dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    tokens = q_raw.shape[0]
    k_raw, v_raw = (
        torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device) for _ in range(2)
    )
    positions = torch.from_numpy(common.seq_lens_cpu - 1).to(device)
    table = common.block_table.cpu().long()
    pos = positions.cpu()
    slots = (
        table[torch.arange(tokens), pos // common.block_size] * common.block_size + pos % common.block_size
    )
    slots[2] = -1  # a token without a slot (CUDA-graph padding): nothing written, its key left as it was
    common.slot_mapping = slots.to(device)
    angles = torch.rand(max(common.seq_lens_cpu) + 1, head_dim // 2, generator=gen) * 6.28
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    weights = [None, None]
    if norm:
        weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device) for _ in range(2)]
    rotary = QKRotary(positions, cos, sin, weights[0], weights[1], EPS)

    # the reference: norms and rotary in float64, the keys / values written where the slot is >= 0
    key_cache, value_cache = (c.clone() for c in layer.kv_cache)
    q_w, k_w = (w.cpu() if w is not None else None for w in weights)
    q_ref = _norm_rope64(q_raw.cpu(), q_w, cos.cpu()[pos], sin.cpu()[pos])
    k_ref = _norm_rope64(k_raw.cpu(), k_w, cos.cpu()[pos], sin.cpu()[pos])
    written = slots >= 0
    for cache, new in ((key_cache, k_ref), (value_cache, v_raw.cpu().double())):
        flat = cache.view(-1, kv_heads, head_dim)
        flat[slots[written].to(flat.device)] = new[written].to(dtype).to(flat.device)
    ref_layer = type(layer)((key_cache, value_cache), layer.scale)
    expected = reference(ref_layer, q_ref.to(dtype), common)

    out = torch.empty_like(q_raw)
    decode_attention(
        out, q_raw, *layer.kv_cache, common.block_table, common.seq_lens, common.query_start_loc,
        scale=layer.scale, num_reqs=common.num_reqs, num_splits=splits, rotary=rotary,
        new_kv=(k_raw, v_raw, common.slot_mapping),
    )  # fmt: skip
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)
    for got, want in zip(layer.kv_cache, (key_cache, value_cache)):
        # the keys one rounding of the float64 values (the kernel rounds at the same points as the
        # separate kernel: normalized, weighted, rotated), the values copied exactly
        torch.testing.assert_close(got.cpu().double(), want.cpu().double(), atol=tol, rtol=tol)
    assert torch.equal(layer.kv_cache[1].cpu(), value_cache.cpu())


CASES = [  # heads, kv_heads, head_dim, dtype
    (2, 2, 64, torch.float32),
    (8, 1, 64, torch.bfloat16),
    (6, 2, 32, torch.float16),
]


@pytest.mark.skipif(not INTERPRETED, reason="CPU cases need TRITON_INTERPRET=1")
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", CASES)
@pytest.mark.parametrize("splits, norm", [(1, True), (4, True), (2, False)])
def test_decode_kernel_norms_rotates_and_caches(heads, kv_heads, head_dim, dtype, splits, norm):
    _case(heads, kv_heads, head_dim, dtype, splits, norm)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA, no interpreter")
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 4, 128), (16, 8, 128), (8, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_decode_kernel_norms_rotates_and_caches(heads, kv_heads, head_dim, dtype, splits):
    _case(heads, kv_heads, head_dim, dtype, splits, norm=True, device="cuda", factor=4)


def test_backend_runs_it_for_decode_steps_without_mask_offsets():
    backend = TritonAttentionBackend()
    layer, q, common = make_step(DECODES, 2, 1, 64, torch.float32)
    assert backend.runs_qk_rotary(backend.build(common))
    _, _, mixed = make_step([(4, 3), (0, 1)], 2, 1, 64, torch.float32)
    assert not backend.runs_qk_rotary(backend.build(mixed))
    _, _, masked = make_step([(20, 1), (3, 1)], 2, 1, 64, torch.float32, spans=[(0, 2, 9)])
    assert not backend.runs_qk_rotary(backend.build(masked))


def test_refuses_fp8_caches_and_mask_limits():
    layer, q, common = make_step(DECODES[:2], 2, 1, 64, torch.bfloat16, fp8=True)
    rotary = QKRotary(torch.zeros(2, dtype=torch.int64), torch.ones(4, 32), torch.zeros(4, 32))
    keys = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit cache"):
        decode_attention(
            torch.empty_like(q), q, *layer.kv_cache, common.block_table, common.seq_lens, common.query_start_loc,
            scale=1.0, num_reqs=2, num_splits=1, k_scale=layer.kv_scales[0], v_scale=layer.kv_scales[1],
            rotary=rotary, new_kv=(keys, keys, common.slot_mapping),
        )  # fmt: skip


@pytest.mark.gpu
def test_gpu_engine_tokens_same_with_the_prologue_in_the_decode_kernel(tmp_path, monkeypatch):
    """On a GPU (float32, prefills, chunks, decode graphs): a Qwen3-shaped model's greedy tokens with
    the q / k norms, rotary and cache write inside the decode kernel equal those without."""
    import gc

    from fastdeploy import LLM

    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs CUDA, no interpreter")
    prompts, params = tiny_qwen3(tmp_path, hidden=256, head_dim=64)
    calls = []
    fused = TritonAttentionBackend.forward_qk_rotary
    monkeypatch.setattr(TritonAttentionBackend, "forward_qk_rotary", lambda *a: calls.append(1) or fused(*a))
    tokens = {}
    for fusion in ("0", "1"):
        monkeypatch.setenv("FD_DECODE_ROTARY_FUSION", fusion)
        llm = LLM(
            model=str(tmp_path), load_format="dummy", dtype="float32", seed=1234, device="cuda",
            max_num_seqs=4, max_num_batched_tokens=32, attention_backend="triton", gpu_memory_utilization=0.2,
        )  # fmt: skip
        try:
            tokens[fusion] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        assert bool(calls) == (fusion == "1")
    assert tokens["1"] == tokens["0"]
