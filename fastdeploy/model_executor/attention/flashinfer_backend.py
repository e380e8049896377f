"""Paged attention through FlashInfer's kernels on NVIDIA GPUs (``--attention-backend flashinfer``).

FlashInfer describes a batch's KV cache as CSR page lists (``kv_indptr``, ``kv_indices``,
``last_page_len``) and does its work partitioning on the host in ``plan()``, once per step;
every layer then reuses the plan. We lay the step out on the host from the runner's host
copies of ``seq_lens`` and the block table (no device reads), and plan lazily at the first
layer, so steps that replay a CUDA graph never plan the eager wrappers.

* Any step with a query longer than one token (prefill, chunked prefill with cached
  context, decodes mixed in): the batch-prefill wrapper, causal, reading the NHD cache.
* Decode-only steps: the batch-decode wrapper on tensor cores (the same compiled module as
  prefill, so each dtype and head size JIT-compiles once).
* Decode CUDA graphs: one decode wrapper per captured batch size over fixed buffers; before
  each replay the step is planned again into them (padding requests read one token of
  block 0, and their rows are discarded).
* ``plan()`` reads pinned page lists, with the page ids already on the device
  (:func:`plan_inputs`), so planning step N+1 never waits for step N to finish on the GPU.

The backend declares a decode partner (``decode_backend = "triton"``): the registry pairs
it with the Triton backend, which runs decode-only steps of at most
``FD_TRITON_DECODE_MAX_BATCH`` requests (default: every decode step) in one kernel with no
host plan; FlashInfer keeps the prefill and mixed steps (docs/attention.md; the
measurements behind it are in docs/benchmarks.md).

Limits: bf16/fp16 activations and caches, head sizes 64/128/256, no fp8 caches with our
per-slot scales, no attention-mask offsets (bidirectional multimodal attention); the
registry picks another backend for those.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastdeploy import envs
from fastdeploy.model_executor.attention.backend import AttentionBackend, AttentionSpec
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
from fastdeploy.ops.upload import upload

WORKSPACE_BYTES = 128 << 20
"""Float workspace of the split-KV partial results, shared by every wrapper (steps never overlap)."""
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def flashinfer_importable() -> bool:
    """Whether the ``flashinfer`` package is installed (it is imported only when used)."""
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_unsupported_reason(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashInfer's kernels cannot serve a model of this dtype and head size, or None."""
    if dtype not in SUPPORTED_DTYPES:
        return f"it runs float16/bfloat16 models only, not {dtype}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    return None


@dataclass
class PagedLayout:
    """One step's KV pages in FlashInfer's CSR form (host arrays, int32)."""

    kv_indptr: np.ndarray
    """[reqs + 1]: request ``i`` owns ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``."""
    kv_indices: np.ndarray
    """Block ids of every request's pages, request after request."""
    last_page_len: np.ndarray
    """[reqs]: tokens in each request's last page, 1..block_size."""


def paged_layout(
    seq_lens: np.ndarray, block_table: np.ndarray, block_size: int, pad_to: int = 0
) -> PagedLayout:
    """The pages holding each request's ``seq_lens`` tokens, from its block-table row.

    ``pad_to`` appends requests of one token in block 0 up to that many requests: the
    padding rows of a CUDA graph, which must read finite values and are then discarded.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    num_pages = (seq_lens + block_size - 1) // block_size
    if len(seq_lens) and int(num_pages.max()) > block_table.shape[1]:
        raise ValueError(
            f"a request of {int(seq_lens.max())} tokens needs more than the "
            f"{block_table.shape[1]} blocks of its block-table row"
        )
    in_use = np.arange(block_table.shape[1])[None, :] < num_pages[:, None]
    indices = np.asarray(block_table)[: len(seq_lens)][in_use]
    last_page_len = seq_lens - (num_pages - 1) * block_size
    padding = pad_to - len(seq_lens)
    if padding > 0:
        num_pages = np.concatenate([num_pages, np.ones(padding, dtype=np.int64)])
        indices = np.concatenate([indices, np.zeros(padding, dtype=indices.dtype)])
        last_page_len = np.concatenate([last_page_len, np.ones(padding, dtype=np.int64)])
    indptr = np.concatenate([[0], np.cumsum(num_pages)])
    return PagedLayout(
        kv_indptr=indptr.astype(np.int32),
        kv_indices=indices.astype(np.int32),
        last_page_len=last_page_len.astype(np.int32),
    )


@dataclass
class FlashInferMetadata:
    """One step's layout and the wrapper that runs it (planned at the first layer)."""

    common: CommonAttentionMetadata
    wrapper: Any
    decode: bool
    layout: PagedLayout
    planned: bool = False
    graph_size: int = 0
    """Batch size of the CUDA graph this metadata was captured for (0: eager)."""

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Flat cache slot of every token (read by the cache-write op)."""
        return self.common.slot_mapping


def plan_inputs(
    layout: PagedLayout, qo_indptr: np.ndarray | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(kv_indptr, kv_indices on the device, last_page_len, qo_indptr) for FlashInfer's ``plan()``.

    ``plan()`` copies host page lists to the device. From pageable memory such a copy may
    wait for the stream; the page ids of a CUDA-graph wrapper are even copied with
    ``non_blocking=False``, which waits for the step still running, so the host could not
    prepare step N+1 while step N runs. So the host lists are pinned, and the page ids go
    up beforehand through :func:`upload` (asynchronous); FlashInfer then copies them
    device to device.
    """

    def host(values: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
        return tensor.pin_memory() if device.type == "cuda" else tensor

    (indices,) = upload([layout.kv_indices], device)
    qo = None if qo_indptr is None else host(qo_indptr)
    return host(layout.kv_indptr), indices, host(layout.last_page_len), qo


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer paged attention (FA2 kernels, JIT-compiled by FlashInfer on first use).

    ``num_heads``/``num_kv_heads``/``head_dim`` and ``dtype`` are the model's; ``scale``
    the softmax scale planned into the kernels (a layer with another scale passes the
    ratio as ``q_scale``). On its own it serves every step; the registry pairs it with its
    declared :attr:`decode_backend` for small decode-only steps.
    """

    name = "flashinfer"
    devices = ("cuda",)
    supports_cuda_graphs = True
    supports_fp8_kv_cache = False  # FlashInfer takes one scale per tensor, our fp8 cache one per slot
    supports_mm_bidirectional = False
    decode_backend = "triton"
    """Decode-only steps of at most ``FD_TRITON_DECODE_MAX_BATCH`` requests run the Triton decode
    kernel: one kernel and no host plan, and the faster decode on the GPUs measured."""

    @classmethod
    def decode_backend_max_batch(cls) -> int:
        """``FD_TRITON_DECODE_MAX_BATCH`` (default 1024, so every decode step; 0: FlashInfer decodes too)."""
        return envs.FD_TRITON_DECODE_MAX_BATCH

    @classmethod
    def unavailable_reason(cls, spec: AttentionSpec) -> str | None:
        """A bf16/fp16 model of head size 64/128/256, and the ``flashinfer`` package installed."""
        reason = flashinfer_unsupported_reason(spec.dtype, spec.head_dim)
        if reason is None and not flashinfer_importable():
            reason = "the flashinfer package is not installed (pip install flashinfer-python)"
        return reason

    @classmethod
    def from_spec(cls, spec: AttentionSpec) -> FlashInferAttentionBackend:
        """Builds the wrappers and their workspace on ``spec.device``."""
        return cls(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device)

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        import flashinfer

        reason = flashinfer_unsupported_reason(dtype, head_dim)
        if reason is not None:
            raise ValueError(f"the flashinfer attention backend cannot run this model: {reason}")
        self._flashinfer = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.device = device
        self.scale = head_dim**-0.5
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True, backend="fa2"
        )
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._last_plan: torch.cuda.Event | None = None

    # ---- per step -------------------------------------------------------------------

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """Lay the step's pages out on the host; the plan itself waits for the first layer."""
        if common.attn_mask_offsets is not None:
            raise NotImplementedError(
                "the flashinfer backend has no attention-mask offsets (bidirectional multimodal "
                "attention); use --attention-backend triton"
            )
        if common.block_table_cpu is None:
            raise ValueError("the flashinfer backend needs the host block table (block_table_cpu)")
        decode = common.max_query_len == 1
        layout = paged_layout(common.seq_lens_cpu, common.block_table_cpu, common.block_size)
        return FlashInferMetadata(common, self._decode if decode else self._prefill, decode, layout)

    def forward(
        self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: FlashInferMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k/v: [T, Hkv, D] (already in the cache, so unused here) → [T, Hq, D]."""
        if layer.kv_cache_dtype != "auto":
            raise NotImplementedError(
                f"kv_cache_dtype {layer.kv_cache_dtype!r} is not supported by flashinfer attention"
            )
        if not meta.planned:
            self._plan(meta)
        n = meta.graph_size or meta.common.num_actual_tokens
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q_scale = None if layer.scale == self.scale else layer.scale / self.scale
        meta.wrapper.run(q[:n], layer.kv_cache, out=out[:n], q_scale=q_scale)
        return out

    def _plan(self, meta: FlashInferMetadata) -> None:
        # plan() copies from a pinned host buffer that the next plan() overwrites: make sure
        # the device has taken the previous copy first (it has, unless the host runs ahead).
        if self._last_plan is not None:
            self._last_plan.synchronize()
        layout, bs = meta.layout, meta.common.block_size
        kw = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, bs)
        qo_indptr = None if meta.decode else meta.common.query_start_loc_cpu
        indptr, indices, last, qo = plan_inputs(layout, qo_indptr, self.device)
        if meta.decode:
            meta.wrapper.plan(indptr, indices, last, *heads, **kw)
        else:
            meta.wrapper.plan(qo, indptr, indices, last, *heads, causal=True, **kw)
        meta.planned = True
        if not torch.cuda.is_current_stream_capturing():
            self._last_plan = torch.cuda.Event()
            self._last_plan.record()

    # ---- CUDA graphs ----------------------------------------------------------------

    def build_graph_metadata(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """Metadata to capture a decode graph of ``common.num_reqs`` requests: a decode wrapper
        over fixed buffers, planned with one-token requests until each replay re-plans it."""
        size = common.num_reqs
        indptr_buf, indices_buf, last_buf = self._graph_buffers_for(size, common.block_table.shape[1])
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr_buf[: size + 1],
            paged_kv_indices_buffer=indices_buf,
            paged_kv_last_page_len_buffer=last_buf[:size],
            backend="fa2",
        )
        layout = paged_layout(
            np.zeros(0, dtype=np.int64), np.zeros((0, 1), np.int32), common.block_size, size
        )
        meta = FlashInferMetadata(common, wrapper, decode=True, layout=layout, graph_size=size)
        self._plan(meta)
        return meta

    def update_graph_metadata(self, meta: FlashInferMetadata, common: CommonAttentionMetadata) -> None:
        """Re-plan a captured graph's wrapper for this step's real requests (before replay)."""
        meta.layout = paged_layout(
            common.seq_lens_cpu, common.block_table_cpu, common.block_size, pad_to=meta.graph_size
        )
        self._plan(meta)

    def _graph_buffers_for(self, size: int, max_blocks: int) -> tuple[torch.Tensor, ...]:
        """One set of fixed plan buffers, sized by the first (largest) captured batch and
        shared by every graph (replays never overlap)."""
        if self._graph_buffers is None:  # the first (largest) graph this backend captures
            self._graph_buffers = (
                torch.zeros(size + 1, dtype=torch.int32, device=self.device),
                torch.zeros(size * max_blocks, dtype=torch.int32, device=self.device),
                torch.zeros(size, dtype=torch.int32, device=self.device),
            )
        if self._graph_buffers[2].shape[0] < size:
            raise ValueError("capture CUDA graphs largest batch first (the plan buffers are sized by it)")
        return self._graph_buffers
