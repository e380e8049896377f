"""Reference attention backend in plain torch: runs everywhere, reads the paged cache.

Decode requests (one new token) are attended in batched calls over their
gathered, length-masked context, in groups of similar length; prefill chunks one request at a time, with a
causal mask offset by the cached context when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata


DECODE_GROUP_SIZE = 16
"""Decode requests attended per call: small enough that the gathered context stays in
the CPU cache between the gather and the matmuls, large enough to amortise launches."""


@dataclass
class PrefillChunk:
    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor


@dataclass
class DecodeGroup:
    """Decode requests of similar length, attended together."""

    token_idx: torch.Tensor
    """Token index of each request of the group."""
    block_ids: torch.Tensor
    """[group, blocks] block table rows trimmed to the group's longest context."""
    key_mask: torch.Tensor
    """[group, 1, 1, context] True where a key position is inside the sequence."""


@dataclass
class TorchAttentionMetadata:
    common: CommonAttentionMetadata
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.common.slot_mapping


class TorchAttentionBackend:
    """Plain-torch paged attention (CPU default and the reference for other backends)."""

    name = "torch"

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl, seq_lens, bs = common.query_start_loc_cpu, common.seq_lens_cpu, common.block_size
        query_lens = np.diff(qsl)
        decode_reqs = np.flatnonzero(query_lens == 1)
        decode_reqs = decode_reqs[
            np.argsort(seq_lens[decode_reqs], kind="stable")
        ]  # similar lengths together
        device = common.block_table.device
        groups = []
        for first in range(0, len(decode_reqs), DECODE_GROUP_SIZE):
            reqs_np = decode_reqs[first : first + DECODE_GROUP_SIZE]
            num_blocks = -(-int(seq_lens[reqs_np].max()) // bs)
            reqs = torch.from_numpy(reqs_np).to(device)
            positions = torch.arange(num_blocks * bs, device=device)
            key_mask = positions[None, :] < common.seq_lens[reqs][:, None]
            groups.append(
                DecodeGroup(
                    token_idx=torch.from_numpy(qsl[reqs_np].astype(np.int64)).to(device),
                    block_ids=common.block_table[reqs, :num_blocks].long(),
                    key_mask=key_mask.view(len(reqs_np), 1, 1, -1),
                )
            )
        prefills = []
        for i in np.flatnonzero(query_lens > 1):
            num_blocks = -(-int(seq_lens[i]) // bs)
            prefills.append(
                PrefillChunk(
                    int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i]), common.block_table[i, :num_blocks].long()
                )
            )
        return TorchAttentionMetadata(common=common, decode_groups=groups, prefills=prefills)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchAttentionMetadata):
        """q: [T, Hq, D]; k/v: [T, Hkv, D] (already in the cache) → [T, Hq, D]."""
        key_cache, value_cache = layer.kv_cache
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            out[group.token_idx] = _decode(q[group.token_idx], key_cache, value_cache, group, layer.scale)
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = _prefill(q, k, v, key_cache, value_cache, chunk, layer.scale)
        return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., nblk] block ids → [..., heads, nblk * block_size, head_dim] context."""
    gathered = cache[block_ids]  # [..., nblk, bs, H, D]
    gathered = gathered.flatten(-4, -3)  # [..., nblk * bs, H, D]
    return gathered.transpose(-3, -2)


def _decode(q, key_cache, value_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
    """One query token per request. Scores are taken against every KV head at once (a single
    batched matmul over the gathered ``[reqs, context * kv_heads, head_dim]`` rows, with no
    transposed copies); entries pairing a query head with another group's KV head are masked
    out before the softmax. The extra FLOPs are negligible next to the saved memory traffic."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    keys = key_cache[group.block_ids].view(num_reqs, -1, head_dim).to(q.dtype)  # [reqs, ctx * kv_heads, D]
    values = value_cache[group.block_ids].view(num_reqs, -1, head_dim).to(q.dtype)
    scores = torch.bmm(q, keys.transpose(1, 2)).float() * scale  # [reqs, heads, ctx * kv_heads]
    scores = scores.view(num_reqs, num_kv_heads, group_size, -1, num_kv_heads)
    own_head = torch.eye(num_kv_heads, dtype=torch.bool, device=q.device).view(
        num_kv_heads, 1, 1, num_kv_heads
    )
    allowed = own_head & group.key_mask.view(num_reqs, 1, 1, -1, 1)
    probs = scores.masked_fill(~allowed, float("-inf")).view(num_reqs, num_heads, -1).softmax(-1)
    return torch.bmm(probs.to(q.dtype), values)


def _prefill(q, k, v, key_cache, value_cache, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    query = q[chunk.start : chunk.end].transpose(0, 1)
    num_new = chunk.end - chunk.start
    context = chunk.seq_len - num_new
    if context == 0:
        keys = k[chunk.start : chunk.end].transpose(0, 1)
        values = v[chunk.start : chunk.end].transpose(0, 1)
        out = sdpa(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        keys = _gather(key_cache, chunk.block_ids)[:, : chunk.seq_len].to(q.dtype)
        values = _gather(value_cache, chunk.block_ids)[:, : chunk.seq_len].to(q.dtype)
        key_pos = torch.arange(chunk.seq_len, device=q.device)
        query_pos = torch.arange(context, chunk.seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = sdpa(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
