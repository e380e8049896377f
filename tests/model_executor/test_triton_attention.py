"""The Triton paged-attention backend against a float64 dense reference on random inputs.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` is set below,
before triton is imported) on CPU tensors. With CUDA and without the interpreter, the ``gpu``
tests run the same cases compiled, at larger sizes; run the file with ``TRITON_INTERPRET=1``
on a GPU machine to get the interpreter cases there too.
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from paged_attention_cases import TOLERANCE, make_step, reference  # noqa: E402

from fastdeploy.config import EngineConfig  # noqa: E402
from fastdeploy.model_executor.attention.forward_context import set_forward_context  # noqa: E402
from fastdeploy.model_executor.attention.layer import Attention  # noqa: E402
from fastdeploy.model_executor.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from fastdeploy.ops.triton_attention import decode_num_splits  # noqa: E402
from fastdeploy.ops.triton_env import triton_interpreting  # noqa: E402
from fastdeploy.platforms import get_attention_backend  # noqa: E402

INTERPRETED = triton_interpreting()
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="CPU cases need TRITON_INTERPRET=1")


def gpu_compiled(test):
    """Marks a test that runs the compiled kernels on CUDA (``gpu``; skipped under the interpreter)."""
    skip = pytest.mark.skipif(
        INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA, no interpreter"
    )
    return pytest.mark.gpu(skip(test))


def _check(layer, q, common, dtype, decode_splits=None):
    backend = TritonAttentionBackend(decode_splits=decode_splits)
    meta = backend.build(common)
    out = backend.forward(layer, q, None, None, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = reference(layer, q, common)
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    return meta


# (cached context, new tokens): lengths off block boundaries, one block, and long enough to split
DECODES = [(0, 1), (4, 1), (15, 1), (16, 1), (39, 1), (130, 1), (299, 1)]
# fresh prefills, chunked prefills with cached context, and decodes in one step
MIXED = [(0, 23), (40, 17), (57, 1), (0, 5), (3, 1), (31, 9), (0, 1), (70, 1), (0, 70), (20, 45)]


def _scaled(shapes, factor):
    return [(ctx * factor, new * factor if new > 1 else 1) for ctx, new in shapes]


CASES = [  # heads, kv_heads, head_dim, dtype
    (2, 2, 64, torch.float32),
    (6, 2, 128, torch.bfloat16),
    (3, 1, 64, torch.float16),
    (4, 2, 256, torch.float16),
]


def _decode_case(heads, kv_heads, head_dim, dtype, splits, device="cpu", factor=1):
    layer, q, common = make_step(_scaled(DECODES, factor), heads, kv_heads, head_dim, dtype, device=device)
    meta = _check(layer, q, common, dtype, decode_splits=splits)
    assert meta.decode_only


def _mixed_case(heads, kv_heads, head_dim, dtype, device="cpu", factor=1):
    layer, q, common = make_step(
        _scaled(MIXED, factor), heads, kv_heads, head_dim, dtype, device=device, seed=1
    )
    assert not _check(layer, q, common, dtype).decode_only


def _fp8_case(decode, device="cpu", factor=1):
    shapes = _scaled(DECODES if decode else MIXED, factor)
    layer, q, common = make_step(shapes, 6, 2, 64, torch.bfloat16, fp8=True, device=device, seed=2)
    if not decode:  # the other accepted form: a byte cache named "fp8"
        layer.kv_cache = tuple(cache.view(torch.uint8) for cache in layer.kv_cache)
        layer.kv_cache_dtype = "fp8"
    _check(layer, q, common, torch.bfloat16, decode_splits=4 if decode else None)


def _mask_case(dtype=torch.float32, device="cpu", factor=1):
    # request 0: an image inside a fresh prompt; request 1: an image that began in the cached context and
    # ends inside this chunk; request 5: an image that ends exactly at the chunk's end
    spans = [(0, 4 * factor, 15 * factor), (1, 35 * factor, 50 * factor), (5, 33 * factor, 40 * factor)]
    layer, q, common = make_step(_scaled(MIXED, factor), 6, 2, 64, dtype, spans=spans, device=device, seed=3)
    _check(layer, q, common, dtype)


@needs_interpreter
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", CASES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_batch(heads, kv_heads, head_dim, dtype, splits):
    _decode_case(heads, kv_heads, head_dim, dtype, splits)


@needs_interpreter
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", CASES)
def test_mixed_batch(heads, kv_heads, head_dim, dtype):
    _mixed_case(heads, kv_heads, head_dim, dtype)


@needs_interpreter
@pytest.mark.parametrize("decode", [True, False])
def test_fp8_cache_with_scales(decode):
    _fp8_case(decode)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # 16- and 64-row query blocks
def test_mask_offsets_open_bidirectional_spans(dtype):
    _mask_case(dtype)


@needs_interpreter
def test_every_tile_masked(monkeypatch):
    """The other side of the default ``SPLIT_INTERIOR`` / ``LONGEST_FIRST`` (and of a small decode
    grid's unmasked tiles): every key tile masked, the query blocks in order: decodes (several
    splits), fresh and chunked prefills, an fp8 cache, mask offsets."""
    from fastdeploy.ops import triton_attention as ta

    monkeypatch.setattr(ta, "SPLIT_INTERIOR", False)
    monkeypatch.setattr(ta, "LONGEST_FIRST", False)
    monkeypatch.setattr(ta, "DECODE_INTERIOR_BELOW_PROGRAMS", 0)
    _decode_case(6, 2, 128, torch.bfloat16, 4)
    _mixed_case(2, 2, 64, torch.float32)
    _mixed_case(6, 2, 128, torch.bfloat16)
    _fp8_case(False)
    _mask_case(torch.bfloat16)


@needs_interpreter
def test_through_the_attention_layer():
    """The layer writes this step's keys/values into the cache, then the backend attends."""
    heads, kv_heads, head_dim, ctx, new = 4, 2, 64, 21, 6
    layer, _, common = make_step([(ctx, new)], heads, kv_heads, head_dim, torch.float32, seed=6)
    pos = torch.arange(ctx, ctx + new)
    blocks = common.block_table[0, pos // common.block_size].long()
    common.slot_mapping = blocks * common.block_size + pos % common.block_size
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(new, h * head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    attention = Attention(heads, kv_heads, head_dim, layer.scale, layer_idx=0)
    attention.kv_cache, attention.backend = layer.kv_cache, TritonAttentionBackend()
    with set_forward_context(attention.backend.build(common)):
        out = attention(q, k, v)
    key_cache = layer.kv_cache[0].view(-1, kv_heads, head_dim)
    torch.testing.assert_close(key_cache[common.slot_mapping], k.view(new, kv_heads, head_dim))
    expected = reference(layer, q.view(new, heads, head_dim), common)
    torch.testing.assert_close(out.double(), expected.view(new, -1), atol=2e-5, rtol=2e-5)


@needs_interpreter
def test_mask_offsets_in_a_decode_batch():
    layer, q, common = make_step(DECODES, 4, 2, 64, torch.float32, seed=4)
    limits = torch.from_numpy(
        np.maximum(common.seq_lens_cpu - np.arange(len(DECODES)) * 3, 1).astype(np.int32)
    )
    common.attn_mask_offsets = limits  # fewer keys than the sequence holds
    _check(layer, q, common, torch.float32, decode_splits=2)


@needs_interpreter
def test_padded_tokens_and_head_dim_checks():
    layer, q, common = make_step([(5, 3), (9, 1)], 2, 2, 64, torch.float32, seed=5)
    padded = torch.cat([q, torch.randn(3, *q.shape[1:])])  # rows past num_actual_tokens are ignored
    backend = TritonAttentionBackend()
    out = backend.forward(layer, padded, None, None, backend.build(common))
    torch.testing.assert_close(out[: len(q)].double(), reference(layer, q, common), atol=2e-5, rtol=2e-5)
    layer, q, common = make_step([(5, 3)], 2, 2, 48, torch.float32)
    with pytest.raises(ValueError, match="power-of-two"):
        backend.forward(layer, q, None, None, backend.build(common))


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_graph_padding_of_a_decode_batch(splits):
    """Padded requests (seq_len 0) get zeros; the real ones are unaffected."""
    layer, q, common = make_step([(40, 1), (7, 1), (0, 1), (0, 1)], 6, 2, 64, torch.float32, seed=8)
    real = replace(common, num_reqs=2, num_actual_tokens=2)
    common.seq_lens[2:] = 0
    common.seq_lens_cpu[2:] = 0
    out = TritonAttentionBackend(decode_splits=splits).forward(
        layer, q, None, None, TritonAttentionBackend().build(common)
    )
    torch.testing.assert_close(out[:2].double(), reference(layer, q, real)[:2], atol=2e-5, rtol=2e-5)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def _tiny_qwen3(path, hidden: int, head_dim: int) -> tuple[list[dict], object]:
    """A two-layer Qwen3 config (4 query / 2 KV heads) saved to ``path``, three prompts of 5-45 tokens
    and greedy parameters for 24 tokens."""
    from transformers import Qwen3Config

    from fastdeploy import SamplingParams

    config = Qwen3Config(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4 * head_dim,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(str(path))
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=gen).tolist()} for n in (5, 21, 45)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@needs_interpreter
def test_engine_greedy_tokens_match_the_torch_backend(tmp_path, monkeypatch):
    """A Qwen3-shaped dummy model through the engine (chunked prefill, mixed steps, decodes) on both backends."""
    from fastdeploy import LLM

    monkeypatch.setattr("fastdeploy.ops.cpu_ops.load_cpu_ops", lambda: None)  # the plain torch reference
    prompts, params = _tiny_qwen3(tmp_path, hidden=128, head_dim=32)
    tokens, threads = {}, torch.get_num_threads()  # the engine sets one thread (tiny matmuls); restore after
    for backend in ("torch", "triton"):
        llm = LLM(
            model=str(tmp_path), load_format="dummy", dtype="float32", seed=1234, block_size=16,
            num_gpu_blocks_override=24, max_num_seqs=4, max_num_batched_tokens=32, num_threads=1,
            attention_backend=backend,
        )  # fmt: skip
        try:
            assert llm.engine.core.executor.worker.runner.attn_backend.name == backend
            tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
            torch.set_num_threads(threads)
    assert tokens["triton"] == tokens["torch"]
    assert len({t for seq in tokens["triton"] for t in seq}) > 3


@pytest.mark.gpu
def test_qwen3_cache_write_in_the_qk_norm_kernel_gives_the_same_tokens(tmp_path, monkeypatch):
    """On a GPU Qwen3's q/k norm and rotary kernel also writes the keys and values to the cache
    (no separate cache-write kernel): greedy tokens in float32 equal those with the write apart,
    with prefills, chunks, decodes and the decode graphs."""
    from fastdeploy import LLM
    from fastdeploy.ops import layer_ops

    if not torch.cuda.is_available() or layer_ops.load_triton_ops() is None:
        pytest.skip("needs a GPU and triton")
    prompts, params = _tiny_qwen3(tmp_path, hidden=256, head_dim=64)
    calls, fused_call = [], layer_ops.qk_norm_rotary_
    monkeypatch.setattr(
        "fastdeploy.model_executor.models.llama.qk_norm_rotary_",
        lambda *a: calls.append(a[-1] is not None) or fused_call(*a),
    )
    tokens = {}
    for fused in (False, True):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(Attention, "fuses_rotary", lambda self, x: False)
            llm = LLM(
                model=str(tmp_path), load_format="dummy", dtype="float32", seed=1234, device="cuda",
                max_num_seqs=4, max_num_batched_tokens=32, attention_backend="triton", gpu_memory_utilization=0.2,
            )  # fmt: skip
            try:
                tokens[fused] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
            finally:
                llm.shutdown()
                del llm  # (its KV cache: the next engine sizes its own by the memory left)
                gc.collect()
                torch.cuda.empty_cache()
        assert any(calls) == fused  # the cache went to the kernel exactly when it may
        calls.clear()
    assert tokens[True] == tokens[False]


def test_decode_split_policy():
    assert decode_num_splits(num_reqs=1, num_kv_heads=8, max_kv_len=32768, num_sms=132) == 16
    assert decode_num_splits(num_reqs=1, num_kv_heads=8, max_kv_len=1024, num_sms=132) == 4
    assert decode_num_splits(num_reqs=256, num_kv_heads=8, max_kv_len=32768, num_sms=132) == 1
    assert (
        decode_num_splits(num_reqs=8, num_kv_heads=4, max_kv_len=32768, num_sms=132) == 8
    )  # 9 → power of two
    assert decode_num_splits(num_reqs=4, num_kv_heads=2, max_kv_len=100, num_sms=132) == 1


def test_backend_selection(monkeypatch):
    monkeypatch.setattr("fastdeploy.ops.cpu_ops.load_cpu_ops", lambda: None)  # skip building the C++ kernels
    config = EngineConfig()
    config.device.attention_backend = "auto"
    assert get_attention_backend(config, torch.device("cpu"), torch.float32, 64).name == "torch"
    assert get_attention_backend(config, torch.device("cuda"), torch.bfloat16, 128).name == "triton"
    assert get_attention_backend(config, torch.device("cuda"), torch.bfloat16, 80).name == "torch"
    config.device.attention_backend = "triton"
    if INTERPRETED:
        assert get_attention_backend(config, torch.device("cpu"), torch.float32, 64).name == "triton"
    with pytest.raises(ValueError, match="power-of-two"):
        get_attention_backend(config, torch.device("cuda"), torch.float32, 80)


GPU_CASES = [*CASES, (32, 8, 128, torch.bfloat16), (8, 1, 256, torch.bfloat16)]


@gpu_compiled
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", GPU_CASES)
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_gpu_decode_batch(heads, kv_heads, head_dim, dtype, splits):
    _decode_case(heads, kv_heads, head_dim, dtype, splits, device="cuda", factor=8)


@gpu_compiled
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", GPU_CASES)
def test_gpu_mixed_batch(heads, kv_heads, head_dim, dtype):
    _mixed_case(heads, kv_heads, head_dim, dtype, device="cuda", factor=8)


@gpu_compiled
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_fp8_cache_with_scales(decode):
    _fp8_case(decode, device="cuda", factor=8)


@gpu_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_mask_offsets(dtype):
    _mask_case(dtype, device="cuda", factor=8)


@gpu_compiled
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", GPU_CASES)
def test_gpu_every_tile_masked(heads, kv_heads, head_dim, dtype, monkeypatch):
    """The compiled kernels with every key tile masked and the query blocks in order (the default
    unmasks the interior tiles): decodes (8 splits) and mixed steps."""
    from fastdeploy.ops import triton_attention as ta

    monkeypatch.setattr(ta, "SPLIT_INTERIOR", False)
    monkeypatch.setattr(ta, "LONGEST_FIRST", False)
    monkeypatch.setattr(ta, "DECODE_INTERIOR_BELOW_PROGRAMS", 0)
    _decode_case(heads, kv_heads, head_dim, dtype, 8, device="cuda", factor=8)
    _mixed_case(heads, kv_heads, head_dim, dtype, device="cuda", factor=8)
