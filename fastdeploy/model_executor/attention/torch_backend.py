"""Reference attention backend in plain torch: runs everywhere, reads the paged cache.

Decode requests (one new token) are attended in batched calls over their
gathered, length-masked context, in groups of similar length; prefill chunks one request at a time, with a
causal mask offset by the cached context when there is one (or the per-token key limits of
``attn_mask_offsets``). On CPUs with the C++ kernels built, decodes and prefills each take one
kernel call per layer instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from fastdeploy.model_executor.attention.backend import AttentionBackend, AttentionSpec
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata

DECODE_GROUP_SIZE = 16
"""Decode requests attended per call: small enough that the gathered context stays in
the CPU cache between the gather and the matmuls, large enough to amortise launches."""


@dataclass
class PrefillChunk:
    """Tokens ``start:end`` of one request, or of ``count`` adjacent fresh prompts of equal length."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None
    """The request's block table row; None for fresh prompts (no cached context to read)."""
    count: int = 1


@dataclass
class DecodeGroup:
    """Decode requests of similar length, attended together."""

    token_idx: torch.Tensor
    """Token index of each request of the group."""
    block_ids: torch.Tensor
    """[group, blocks] block table rows trimmed to the group's longest context."""
    key_mask: torch.Tensor
    """[group, 1, 1, context, 1] True where a key position is inside the sequence."""
    blocked: dict[int, torch.Tensor]
    """kv_heads → [group, kv_heads, 1, context, kv_heads] True for scores ``_decode`` must drop
    (built by the first layer of the step, reused by the others)."""


@dataclass
class DecodeBatch:
    """Every decode request of the step, in the form the C++ CPU kernel reads."""

    token_idx: torch.Tensor
    block_table: torch.Tensor
    """[decodes, blocks] int32, contiguous."""
    seq_lens: torch.Tensor
    """[decodes] int32."""


@dataclass
class PrefillBatch:
    """Every prefill chunk of the step, in the form the C++ CPU kernel reads."""

    q_start: torch.Tensor
    """[prefills] int64: first token row of each chunk."""
    q_lens: torch.Tensor
    """[prefills] int32."""
    seq_lens: torch.Tensor
    """[prefills] int32: context including the chunk."""
    block_table: torch.Tensor
    """[prefills, blocks] int32, contiguous."""
    limits: torch.Tensor
    """[tokens] int32 key limits (``attn_mask_offsets``), or empty for causal attention."""


@dataclass
class TorchAttentionMetadata:
    """One step's decodes and prefill chunks, grouped for the torch path or the C++ kernels."""

    common: CommonAttentionMetadata
    decode_groups: list[DecodeGroup]
    """Decodes for the torch path (empty when ``decode_batch`` is used)."""
    decode_batch: DecodeBatch | None
    """Decodes for the C++ CPU kernel, when it is loaded."""
    prefills: list[PrefillChunk]
    """Prefill chunks for the torch path (empty when ``prefill_batch`` is used)."""
    prefill_batch: PrefillBatch | None = None
    """Prefills for the C++ CPU kernel, when it is loaded."""

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.common.slot_mapping


class TorchAttentionBackend(AttentionBackend):
    """Plain-torch paged attention (CPU default and the reference for other backends).

    With ``cpu_kernels`` (the compiled :mod:`fastdeploy.ops.cpu_ops` module), decode and
    prefill attention run in C++ kernels that read the paged cache in place; everything
    else stays torch.
    """

    name = "torch"
    devices = ("cpu", "cuda")
    supports_cuda_graphs = False  # it slices per request on the host
    supports_fp8_kv_cache = False
    supports_mm_bidirectional = True

    CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
    CPU_KERNEL_HEAD_DIMS = (64, 128, 256)

    def __init__(self, cpu_kernels: Any = None):
        self.cpu_kernels = cpu_kernels

    @classmethod
    def from_spec(cls, spec: AttentionSpec) -> TorchAttentionBackend:
        """With the C++ CPU kernels where they fit (a CPU, fp32/bf16, head size 64/128/256, and
        the kernels build), else the torch path."""
        from fastdeploy.ops.cpu_ops import load_cpu_ops

        fits = (
            spec.device.type == "cpu"
            and spec.dtype in cls.CPU_KERNEL_DTYPES
            and spec.head_dim in cls.CPU_KERNEL_HEAD_DIMS
        )
        return cls(load_cpu_ops() if fits else None)

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        """Groups the step's decodes and prefill chunks (or packs them for the C++ kernels)."""
        qsl = common.query_start_loc_cpu
        query_lens = np.diff(qsl)
        decode = query_lens == 1
        if self.cpu_kernels is not None and common.num_prompt_tokens_cpu is not None:
            # a prompt's last token alone (after a prefix-cache hit, or a one-token last chunk) is
            # computed by the prefill kernel, as it is when the whole prompt runs at once: the
            # decode kernel rounds differently (CPU batch invariance, docs/api.md)
            decode &= common.seq_lens_cpu > common.num_prompt_tokens_cpu
        decode_reqs = np.flatnonzero(decode)
        prefill_reqs = np.flatnonzero((query_lens > 0) & ~decode)
        if self.cpu_kernels is not None:
            return TorchAttentionMetadata(
                common=common,
                decode_groups=[],
                decode_batch=_kernel_decodes(common, decode_reqs) if len(decode_reqs) else None,
                prefills=[],
                prefill_batch=_kernel_prefills(common, prefill_reqs) if len(prefill_reqs) else None,
            )
        groups = _decode_groups(common, decode_reqs) if len(decode_reqs) else []
        return TorchAttentionMetadata(
            common=common,
            decode_groups=groups,
            decode_batch=None,
            prefills=_prefill_chunks(common, prefill_reqs),
        )

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchAttentionMetadata):
        """q: [T, Hq, D]; k/v: [T, Hkv, D] (already in the cache) → [T, Hq, D]."""
        key_cache, value_cache = layer.kv_cache
        out = torch.empty_like(q)
        decodes, prefills = meta.decode_batch, meta.prefill_batch
        if decodes is not None:  # the kernels read q's rows and write out's rows in place
            self.cpu_kernels.paged_decode_attention(
                out,
                q,
                key_cache,
                value_cache,
                decodes.block_table,
                decodes.seq_lens,
                decodes.token_idx,
                layer.scale,
            )
        if prefills is not None:
            self.cpu_kernels.paged_prefill_attention(
                out,
                q,
                key_cache,
                value_cache,
                prefills.block_table,
                prefills.seq_lens,
                prefills.q_start,
                prefills.q_lens,
                prefills.limits,
                layer.scale,
            )
        for group in meta.decode_groups:
            out[group.token_idx] = _decode(q[group.token_idx], key_cache, value_cache, group, layer.scale)
        limits = meta.common.attn_mask_offsets
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = _prefill(
                q, k, v, key_cache, value_cache, chunk, layer.scale, limits
            )
        return out


def _kernel_decodes(common: CommonAttentionMetadata, reqs: np.ndarray) -> DecodeBatch:
    return DecodeBatch(
        token_idx=torch.from_numpy(common.query_start_loc_cpu[reqs].astype(np.int64)),
        block_table=common.block_table[torch.from_numpy(reqs)].contiguous(),
        seq_lens=torch.from_numpy(common.seq_lens_cpu[reqs].astype(np.int32)),
    )


def _kernel_prefills(common: CommonAttentionMetadata, reqs: np.ndarray) -> PrefillBatch:
    qsl = common.query_start_loc_cpu
    limits = common.attn_mask_offsets
    return PrefillBatch(
        q_start=torch.from_numpy(qsl[reqs].astype(np.int64)),
        q_lens=torch.from_numpy((qsl[reqs + 1] - qsl[reqs]).astype(np.int32)),
        seq_lens=torch.from_numpy(common.seq_lens_cpu[reqs].astype(np.int32)),
        block_table=common.block_table[torch.from_numpy(reqs)].contiguous(),
        limits=torch.empty(0, dtype=torch.int32) if limits is None else limits.to(torch.int32).contiguous(),
    )


def _prefill_chunks(common: CommonAttentionMetadata, reqs: np.ndarray) -> list[PrefillChunk]:
    """One chunk per request; adjacent fresh prompts of equal length are merged (causal only)."""
    qsl, seq_lens, bs = common.query_start_loc_cpu, common.seq_lens_cpu, common.block_size
    mergeable = common.attn_mask_offsets is None
    prefills: list[PrefillChunk] = []
    for i in reqs:
        start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        if seq_len == end - start:  # a fresh prompt: batch it with an equal, adjacent one
            last = prefills[-1] if prefills else None
            if (
                mergeable
                and last
                and last.block_ids is None
                and last.end == start
                and last.seq_len == seq_len
            ):
                last.end, last.count = end, last.count + 1
            else:
                prefills.append(PrefillChunk(start, end, seq_len, None))
            continue
        num_blocks = -(-seq_len // bs)
        prefills.append(PrefillChunk(start, end, seq_len, common.block_table[i, :num_blocks].long()))
    return prefills


def _decode_groups(common: CommonAttentionMetadata, decode_reqs: np.ndarray) -> list[DecodeGroup]:
    """Decode requests sorted by length and cut into groups of ``DECODE_GROUP_SIZE``."""
    qsl, seq_lens, bs = common.query_start_loc_cpu, common.seq_lens_cpu, common.block_size
    device = common.block_table.device
    decode_reqs = decode_reqs[np.argsort(seq_lens[decode_reqs], kind="stable")]  # similar lengths together
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
                key_mask=key_mask.view(len(reqs_np), 1, 1, -1, 1),
                blocked={},
            )
        )
    return groups


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
    blocked = group.blocked.get(num_kv_heads)
    if blocked is None:  # built by the first layer, reused by the others
        own_head = torch.eye(num_kv_heads, dtype=torch.bool, device=q.device)
        blocked = ~(own_head.view(num_kv_heads, 1, 1, num_kv_heads) & group.key_mask)
        group.blocked[num_kv_heads] = blocked
    probs = scores.masked_fill(blocked, float("-inf")).view(num_reqs, num_heads, -1).softmax(-1)
    return torch.bmm(probs.to(q.dtype), values)


def _prefill(
    q, k, v, key_cache, value_cache, chunk: PrefillChunk, scale: float, limits: torch.Tensor | None
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1:]
    if chunk.block_ids is None and limits is None:  # fresh prompts: causal over this step's own keys
        shape = (chunk.count, chunk.seq_len, -1, head_dim)
        query = q[chunk.start : chunk.end].view(shape).transpose(1, 2)
        keys = k[chunk.start : chunk.end].view(shape).transpose(1, 2)
        values = v[chunk.start : chunk.end].view(shape).transpose(1, 2)
        out = sdpa(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, num_heads, head_dim)
    query = q[chunk.start : chunk.end].transpose(0, 1)
    context = chunk.seq_len - (chunk.end - chunk.start)
    if chunk.block_ids is None:
        keys, values = k[chunk.start : chunk.end].transpose(0, 1), v[chunk.start : chunk.end].transpose(0, 1)
    else:
        keys = _gather(key_cache, chunk.block_ids)[:, : chunk.seq_len].to(q.dtype)
        values = _gather(value_cache, chunk.block_ids)[:, : chunk.seq_len].to(q.dtype)
    key_pos = torch.arange(chunk.seq_len, device=q.device)
    if limits is None:
        query_limit = torch.arange(context, chunk.seq_len, device=q.device) + 1
    else:
        query_limit = limits[chunk.start : chunk.end].to(torch.int64).clamp(1, chunk.seq_len)
    mask = key_pos[None, :] < query_limit[:, None]
    out = sdpa(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
