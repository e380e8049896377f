"""The interface every attention backend implements, with its capabilities declared as fields.

The runner, the CUDA-graph code and the backend registry read a backend's capabilities
(``supports_cuda_graphs``, ``supports_fp8_kv_cache``, ``supports_mm_bidirectional``,
``devices``) as plain attributes; nothing probes a backend by name. A backend may also
declare a partner for small decode-only steps (``decode_backend``): the registry then pairs
the two in a :class:`PrefillDecodeBackend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """What a model asks of its attention backend on one device: the inputs of backend choice."""

    device: torch.device
    dtype: torch.dtype
    """Activation (and, without fp8, KV-cache) dtype."""
    head_dim: int
    num_heads: int = 1
    num_kv_heads: int = 1
    kv_cache_dtype: str = "auto"
    """``auto`` (the activation dtype) or ``fp8_e4m3`` (per-slot, per-head scales)."""
    needs_mask_offsets: bool = False
    """Whether steps carry ``attn_mask_offsets`` (bidirectional multimodal attention)."""


class AttentionMetadata(Protocol):
    """What the runner and the attention layer read from any backend's per-step metadata."""

    common: CommonAttentionMetadata

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Flat cache slot of every token (read by the cache-write op)."""
        ...


class AttentionBackend(ABC):
    """One attention implementation over the paged KV cache.

    Subclasses declare their capabilities as class attributes (the defaults here are the
    conservative ones) and implement :meth:`from_spec`, :meth:`build` and :meth:`forward`;
    graph-capable ones also :meth:`build_graph_metadata` and :meth:`update_graph_metadata`.
    A backend becomes selectable by one registration in
    :mod:`fastdeploy.model_executor.attention.registry`.
    """

    name: str = ""
    """The name ``--attention-backend`` uses (and the registry key)."""
    devices: tuple[str, ...] = ()
    """Device types (``torch.device.type``) it can run on."""
    supports_cuda_graphs: bool = False
    """Its decode-step metadata can be captured in a CUDA graph (see ``build_graph_metadata``)."""
    supports_mixed_graphs: bool = False
    """Its kernels' grids for any step depend only on shapes, so a step padded to a captured token
    size with empty requests replays a graph (``fastdeploy/worker/mixed_graphs.py``)."""
    supports_fp8_kv_cache: bool = False
    """It reads ``fp8_e4m3`` KV caches with per-slot, per-head scales."""
    supports_mm_bidirectional: bool = False
    """It honours ``attn_mask_offsets`` (multimodal tokens attending to each other both ways)."""
    decode_backend: str | None = None
    """A registered backend that runs this one's decode-only steps of at most
    :meth:`decode_backend_max_batch` requests (a declared prefill/decode pairing), or None."""

    @classmethod
    def decode_backend_max_batch(cls) -> int:
        """Largest decode-only step handed to :attr:`decode_backend` (0: none)."""
        return 0

    @classmethod
    def unavailable_reason(cls, spec: AttentionSpec) -> str | None:
        """Why this backend cannot serve ``spec`` beyond the declared fields (dtype, head size,
        a missing package), or None when it can. The registry checks ``devices``,
        ``supports_fp8_kv_cache`` and ``supports_mm_bidirectional`` itself."""
        return None

    @classmethod
    @abstractmethod
    def from_spec(cls, spec: AttentionSpec) -> AttentionBackend:
        """The backend instance for this model on this device."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """This step's metadata, built once per step and read by every layer."""

    @abstractmethod
    def forward(
        self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k/v: [T, Hkv, D] (already written to ``layer.kv_cache``) → [T, Hq, D]."""

    def build_graph_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """Metadata to capture a decode CUDA graph of ``common.num_reqs`` requests with."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")

    def update_graph_metadata(self, meta: AttentionMetadata, common: CommonAttentionMetadata) -> None:
        """Prepare a captured graph's metadata for this step's real requests (before replay)."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")


class PrefillDecodeBackend(AttentionBackend):
    """A declared pairing: decode-only steps of at most ``decode_max_batch`` requests run
    ``decode``, every other step (prefills, mixed steps, larger decodes) runs ``prefill``.

    The routing depends only on a step's ``CommonAttentionMetadata`` (its ``max_query_len``
    and ``num_reqs``; for a CUDA graph, the captured size), so the metadata of a step always
    goes back to the backend that built it. It carries ``prefill``'s name, and a capability
    only when both halves have it.
    """

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend, decode_max_batch: int):
        self.prefill = prefill
        self.decode = decode
        self.decode_max_batch = decode_max_batch
        self.name = prefill.name
        self.devices = tuple(d for d in prefill.devices if d in decode.devices)
        self.supports_cuda_graphs = prefill.supports_cuda_graphs and decode.supports_cuda_graphs
        self.supports_mixed_graphs = prefill.supports_mixed_graphs  # (steps that are not decode-only)
        self.supports_fp8_kv_cache = prefill.supports_fp8_kv_cache and decode.supports_fp8_kv_cache
        self.supports_mm_bidirectional = (
            prefill.supports_mm_bidirectional and decode.supports_mm_bidirectional
        )

    @classmethod
    def from_spec(cls, spec: AttentionSpec) -> AttentionBackend:
        raise TypeError("a PrefillDecodeBackend is assembled by the registry from two registered backends")

    def backend_for(self, common: CommonAttentionMetadata) -> AttentionBackend:
        """The half that serves a step laid out as ``common``."""
        if common.max_query_len == 1 and common.num_reqs <= self.decode_max_batch:
            return self.decode
        return self.prefill

    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return self.backend_for(common).build(common)

    def forward(
        self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.backend_for(meta.common).forward(layer, q, k, v, meta)

    def build_graph_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return self.backend_for(common).build_graph_metadata(common)

    def update_graph_metadata(self, meta: AttentionMetadata, common: CommonAttentionMetadata) -> None:
        self.backend_for(meta.common).update_graph_metadata(meta, common)
