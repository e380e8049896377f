"""Random paged-attention steps and a float64 dense reference, shared by the backend tests."""

from __future__ import annotations

import math

import numpy as np
import torch

from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


class Layer:
    """The attributes of an ``Attention`` layer that a backend reads."""

    def __init__(self, kv_cache, scale, kv_scales=None):
        self.kv_cache, self.scale, self.kv_scales = kv_cache, scale, kv_scales
        self.kv_cache_dtype = "auto" if kv_scales is None else "fp8_e4m3"


def make_step(shapes, heads, kv_heads, head_dim, dtype, *, fp8=False, spans=(), device="cpu", seed=0):
    """A random paged cache and one step of requests ``(cached context, new tokens)``.

    ``spans`` are ``(request, first, end)`` position ranges that attend bidirectionally (mask
    offsets); with none, the step has no offsets (causal). Returns the layer, q, common metadata.
    """
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    blocks_per_req = [-(-(ctx + new) // block_size) for ctx, new in shapes]
    max_blocks = max(blocks_per_req) + 2  # wider than any request: the static decode bound
    num_blocks = sum(blocks_per_req) + 3
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    caches = [
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
        for _ in range(2)
    ]
    kv_scales = None
    if fp8:
        kv_scales = tuple(
            torch.rand(num_blocks, block_size, kv_heads, generator=gen) * 0.5 + 0.05 for _ in range(2)
        )
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.randint(0, num_blocks, (len(shapes), max_blocks), generator=gen, dtype=torch.int32)
    first = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = perm[first : first + n]
        first += n
    query_lens = np.array([new for _, new in shapes])
    seq_lens = np.array([ctx + new for ctx, new in shapes])
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    num_tokens = int(qsl[-1])
    offsets = None
    if spans:
        positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, query_lens)])
        limits = positions + 1
        for req, lo, hi in spans:
            token_pos = positions[qsl[req] : qsl[req + 1]]
            inside = (token_pos >= lo) & (token_pos < hi)
            limits[qsl[req] : qsl[req + 1]][inside] = hi
        offsets = torch.from_numpy(limits.astype(np.int32)).to(device)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    common = CommonAttentionMetadata(
        num_reqs=len(shapes),
        num_actual_tokens=num_tokens,
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=block_table.to(device),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),  # unused by forward()
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        block_table_cpu=block_table.numpy(),
        attn_mask_offsets=offsets,
    )
    to_dev = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)
    scales = None if kv_scales is None else tuple(map(to_dev, kv_scales))
    layer = Layer(tuple(map(to_dev, caches)), 1 / math.sqrt(head_dim), scales)
    return layer, to_dev(q), common


def reference(layer, q, common):
    """Dense float64 attention per request over its context gathered through the block table."""
    caches = [c.view(torch.float8_e4m3fn) if c.dtype == torch.uint8 else c for c in layer.kv_cache]
    key_cache, value_cache = (c.cpu().double() for c in caches)
    if layer.kv_scales is not None:
        key_cache = key_cache * layer.kv_scales[0].cpu().double()[..., None]
        value_cache = value_cache * layer.kv_scales[1].cpu().double()[..., None]
    q = q.cpu().double()
    group = q.shape[1] // key_cache.shape[2]
    block_table = common.block_table.cpu().long()
    offsets = None if common.attn_mask_offsets is None else common.attn_mask_offsets.cpu().long()
    out = torch.empty_like(q)
    for r in range(common.num_reqs):
        start, end = int(common.query_start_loc_cpu[r]), int(common.query_start_loc_cpu[r + 1])
        seq_len = int(common.seq_lens_cpu[r])
        pos = torch.arange(seq_len)
        slots = block_table[r, pos // common.block_size]
        keys = key_cache[slots, pos % common.block_size].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = value_cache[slots, pos % common.block_size].repeat_interleave(group, dim=1)
        query_pos = torch.arange(seq_len - (end - start), seq_len)
        limit = query_pos + 1 if offsets is None else offsets[start:end].clamp(max=seq_len)
        visible = pos[None, :] < limit[:, None]  # [Q, S]
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * layer.scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out
