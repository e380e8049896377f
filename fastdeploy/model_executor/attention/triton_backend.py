"""Paged attention backend built on the Triton kernels of :mod:`fastdeploy.ops.triton_attention`.

A step where every request has one query token runs the split-KV decode kernel
(flash-decoding); any other step (prefills, chunked prefills with cached context,
decodes mixed in) runs the unified kernel. Launch grids depend only on shapes and on
host values from :meth:`TritonAttentionBackend.build`; a decode-only step's grid is
``(num_reqs, kv_heads, splits)`` where ``splits`` comes from ``num_reqs``, the KV heads and
the static bound ``block_table.shape[1] * block_size`` (never ``max_seq_len``), so one
CUDA graph per padded batch size stays valid for every step of that size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.model_executor.attention.backend import AttentionBackend, AttentionSpec
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
from fastdeploy.ops.cache_ops import FP8_KV_CACHE_DTYPES
from fastdeploy.ops.triton_attention import decode_attention, decode_num_splits, unified_attention
from fastdeploy.ops.triton_env import triton_interpreting


@dataclass
class TritonAttentionMetadata:
    """One step's layout for the Triton kernels."""

    common: CommonAttentionMetadata
    decode_only: bool
    """Every request has exactly one query token: use the decode kernel."""
    mask_limits: torch.Tensor | None
    """``common.attn_mask_offsets`` as int32 (None: causal)."""

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Flat cache slot of every token (read by the cache-write op)."""
        return self.common.slot_mapping


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention: any batch mix, GQA, bf16/fp16/fp32, fp8_e4m3 caches, mask offsets.

    ``decode_splits`` forces the number of KV splits of the decode kernel (tests, benchmarks);
    by default it follows :func:`decode_num_splits` with the device's SM count. A request with
    ``seq_lens == 0`` (CUDA-graph padding) reads nothing and gets zeros; output rows of tokens
    past ``num_actual_tokens`` are left unwritten.
    """

    name = "triton"
    devices = ("cuda", "cpu")  # a CPU only under TRITON_INTERPRET=1 (see unavailable_reason)
    supports_cuda_graphs = True
    supports_mixed_graphs = True  # the unified kernel's grid: tokens // BLOCK_Q + request slots
    supports_fp8_kv_cache = True
    supports_mm_bidirectional = True

    def __init__(self, decode_splits: int | None = None):
        self.decode_splits = decode_splits
        self._num_sms: int | None = None  # read from the device at the first decode step

    @classmethod
    def unavailable_reason(cls, spec: AttentionSpec) -> str | None:
        """The kernels tile head_dim in powers of two, and compile for CUDA devices only (on a CPU
        they run in Triton's interpreter, for tests)."""
        if spec.head_dim < 16 or spec.head_dim & (spec.head_dim - 1):
            return f"it needs a power-of-two head_dim >= 16, got {spec.head_dim}"
        if spec.device.type != "cuda" and not triton_interpreting():
            return "it runs on CUDA (on a CPU only under TRITON_INTERPRET=1)"
        return None

    @classmethod
    def from_spec(cls, spec: AttentionSpec) -> TritonAttentionBackend:
        """The decode split count follows the device (see :meth:`_splits`)."""
        return cls()

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Wraps the common metadata; decides between the decode and the unified kernel."""
        limits = common.attn_mask_offsets
        if limits is not None and limits.dtype != torch.int32:
            limits = limits.to(torch.int32)
        return TritonAttentionMetadata(
            common=common, decode_only=common.max_query_len == 1, mask_limits=limits
        )

    def build_graph_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Metadata to capture a decode graph with: the kernels read the graph's static
        buffers, so replays need no update."""
        return self.build(common)

    def update_graph_metadata(self, meta: TritonAttentionMetadata, common: CommonAttentionMetadata) -> None:
        """Nothing to do before a replay (see :meth:`build_graph_metadata`)."""

    def forward(
        self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TritonAttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k/v: [T, Hkv, D] (already in the cache, so unused here) → [T, Hq, D]."""
        key_cache, value_cache = layer.kv_cache
        k_scale = v_scale = None
        if layer.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            k_scale, v_scale = layer.kv_scales
        elif layer.kv_cache_dtype != "auto":
            raise NotImplementedError(
                f"kv_cache_dtype {layer.kv_cache_dtype!r} is not supported by triton attention"
            )
        common = meta.common
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        args = (out, q, key_cache, value_cache, common.block_table, common.seq_lens, common.query_start_loc)
        kwargs = dict(scale=layer.scale, k_scale=k_scale, v_scale=v_scale, mask_limits=meta.mask_limits)
        if meta.decode_only:
            decode_attention(
                *args, num_reqs=common.num_reqs, num_splits=self._splits(common, key_cache), **kwargs
            )
        else:
            unified_attention(
                *args,
                num_tokens=common.num_actual_tokens,
                num_reqs=common.num_reqs,
                max_query_len=common.max_query_len,
                **kwargs,
            )
        return out

    def _splits(self, common: CommonAttentionMetadata, key_cache: torch.Tensor) -> int:
        if self.decode_splits is not None:
            return self.decode_splits
        if self._num_sms is None:
            device = key_cache.device
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            )
        max_kv_len = common.block_table.shape[1] * common.block_size
        return decode_num_splits(common.num_reqs, key_cache.shape[2], max_kv_len, self._num_sms)
