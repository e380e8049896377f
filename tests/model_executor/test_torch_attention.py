"""The torch paged-attention backend against dense causal attention on random inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
from fastdeploy.model_executor.attention.torch_backend import TorchAttentionBackend
from fastdeploy.ops import reshape_and_cache_flash


class _Layer:
    def __init__(self, kv_cache, scale):
        self.kv_cache, self.scale = kv_cache, scale


def _dense_reference(q, k, v, scale, limits=None):
    """Causal attention of the last q.shape[0] positions over all of k/v, in float64, GQA by repeat;
    ``limits`` (per query row, exclusive) replace the causal bound."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    q = q.double()
    num_q, num_k = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if limits is None:
        limits = torch.arange(num_k - num_q, num_k) + 1
    allowed = torch.arange(num_k)[None, :] < limits[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _cpu_kernels():
    from fastdeploy.ops.cpu_ops import load_cpu_ops

    kernels = load_cpu_ops()
    if kernels is None:
        pytest.skip("the C++ CPU kernels cannot be built on this machine")
    return kernels


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("decode_path", ["torch", "cpu-kernel"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask-offsets"])
def test_mixed_batch_of_decodes_prefills_and_chunks(dtype, tol, decode_path, masked):
    """Every path against a dense reference; with mask offsets, spans of tokens (one inside a fresh
    prompt, one that starts in the cached context) attend to each other bidirectionally."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 160
    scale = 1 / math.sqrt(head_dim)
    # (context already cached, new tokens this step): fresh prefill, chunked prefill with context, decodes
    shapes = [
        (0, 23),
        (0, 23),
        (0, 23),
        (40, 17),
        (57, 1),
        (0, 12),
        (0, 12),
        (5, 1),
        (100, 1),
        (0, 1),
        (31, 9),
    ] + [(i * 7 % 90 + 1, 1) for i in range(20)]
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = 8
    block_table = torch.zeros(len(shapes), max_blocks, dtype=torch.int32)
    full_k, full_v, queries, slot_mapping = [], [], [], []
    next_block = 0
    for r, (ctx, new) in enumerate(shapes):
        n_blocks = -(-(ctx + new) // block_size)
        blocks = perm[next_block : next_block + n_blocks]
        next_block += n_blocks
        assert next_block <= num_blocks  # every request owns distinct blocks
        block_table[r, :n_blocks] = blocks
        k = torch.randn(ctx + new, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx + new, kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(ctx + new)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        # the cached context is already in the cache; this step's tokens are written by the op
        reshape_and_cache_flash(k[:ctx], v[:ctx], key_cache, value_cache, slots[:ctx], "auto")
        slot_mapping.append(slots[ctx:])
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(new, heads, head_dim, generator=gen).to(dtype))
    q = torch.cat(queries)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    slot_mapping = torch.cat(slot_mapping)
    reshape_and_cache_flash(k_new, v_new, key_cache, value_cache, slot_mapping, "auto")
    qsl = np.concatenate([[0], np.cumsum([n for _, n in shapes])])
    seq_lens = np.array([c + n for c, n in shapes])
    # per-token exclusive key limits: causal, except two "image" spans seen whole by their tokens
    row_limits = [torch.arange(c, c + n) + 1 for c, n in shapes]
    if masked:
        row_limits[0][5:15] = 15  # positions 5..14 of a fresh prompt
        row_limits[3][:11] = 51  # positions 35..50 of a chunk whose first 40 tokens are cached
        row_limits[10][2:] = 40  # a span running to the end of the chunk
    limits = torch.cat(row_limits).to(torch.int32) if masked else None
    common = CommonAttentionMetadata(
        num_reqs=len(shapes),
        num_actual_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(n for _, n in shapes),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        attn_mask_offsets=limits,
    )
    backend = TorchAttentionBackend(_cpu_kernels() if decode_path == "cpu-kernel" else None)
    out = backend.forward(_Layer((key_cache, value_cache), scale), q, k_new, v_new, backend.build(common))
    for r in range(len(shapes)):
        ref = _dense_reference(queries[r], full_k[r], full_v[r], scale, row_limits[r] if masked else None)
        got = out[qsl[r] : qsl[r + 1]].double()
        assert (got - ref).norm() / ref.norm() < tol, (r, shapes[r])


@pytest.mark.parametrize("group", [1, 4])
def test_cache_less_causal_attention_against_the_float64_reference(group):
    """The attention of a step without a KV cache (the start-up profile pass): one causal run, the
    KV heads expanded for GQA (so that on a GPU SDPA takes a kernel without ``[H, T, T]`` scores)."""
    from fastdeploy.model_executor.attention.layer import _causal_attention

    g = torch.Generator().manual_seed(group)
    q = torch.randn(37, 8, 16, generator=g)
    k = torch.randn(37, 8 // group, 16, generator=g)
    v = torch.randn(37, 8 // group, 16, generator=g)
    out = _causal_attention(q, k, v, 0.25)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, 0.25), rtol=1e-5, atol=1e-5)
