"""CUDA graphs of the model's forward pass for decode-only steps, one per padded batch size.

A decode step of ``n`` requests replays the graph captured for the smallest size
``>= n``: the step's inputs are copied into static device buffers, padding
requests get ``seq_len`` 0 (they read nothing) and slot -1 (they write nothing),
and the first ``n`` rows of the captured output are the step's hidden states.
Graphs of at most :data:`LOGITS_IN_GRAPH_MAX_BS` rows also run the LM head into a
static float32 logits buffer and take its row-wise argmax (the greedy tokens): at
such sizes the step is short enough for the host's launches of these (a cuBLAS call,
a conversion, the argmax kernels) to matter, and the buffers are small. The sampler
stays outside the graph and uses the greedy tokens only when no logit processing
applies. Capture needs a graph-safe attention backend
(``supports_cuda_graphs``: Triton, FlashInfer; a backend that plans on the host
re-plans in ``update_graph_metadata`` before each replay) and the compiled
``reshape_and_cache_flash`` (its torch fallback checks slots on the host).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import NamedTuple

import numpy as np
import torch

from fastdeploy.distributed import ep_step_tokens
from fastdeploy.model_executor.attention.backend import AttentionBackend
from fastdeploy.model_executor.attention.forward_context import set_forward_context
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
from fastdeploy.model_executor.layers.linear import small_m_graph_warm_up
from fastdeploy.ops.layer_ops import argmax_rows

logger = logging.getLogger(__name__)

LOGITS_IN_GRAPH_MAX_BS = 16
"""Largest captured size whose graph also computes the logits (a [16, vocab] float32 buffer)."""


class GraphOutput(NamedTuple):
    """What one replay leaves for the step: hidden states, and for small sizes logits and argmax."""

    hidden: torch.Tensor
    """[num_reqs, hidden]"""
    logits: torch.Tensor | None
    """[num_reqs, vocab] float32 (None above LOGITS_IN_GRAPH_MAX_BS)."""
    greedy_tokens: torch.Tensor | None
    """[num_reqs] int64 argmax of ``logits``."""


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size`` (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 8))
    if max_batch_size not in sizes:
        sizes.append(max_batch_size)
    return sorted(set(sizes))


class CapturedForwards:
    """A model's forward captured at several ``sizes``, and the device buffers those captures read,
    which each replay's step is copied into: ``sizes[-1]`` token rows (ids, positions, cache
    slots: -1 writes nothing) and ``num_reqs`` request rows (query starts, sequence lengths,
    block-table rows), zero-filled."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        sizes: list[int],
        num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ):
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = sizes
        self.block_size = block_size
        self.max_model_len = max_model_len
        num_tokens = sizes[-1]
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(num_reqs, max_blocks_per_req, dtype=torch.int32, device=device)


class DecodeGraphs(CapturedForwards):
    """Captured decode forwards and the static buffers they read."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        max_batch_size: int,
        max_blocks_per_req: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ):
        sizes = capture_sizes(max_batch_size)
        n = sizes[-1]
        super().__init__(model, attn_backend, sizes, n, max_blocks_per_req, block_size, max_model_len, device)
        self.query_start_loc.copy_(torch.arange(n + 1, dtype=torch.int32))  # one token a request, fixed
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        """size → (graph, its hidden-state output, the attention metadata it was captured with)."""
        self.pool = None
        """The captures' memory pool (the mixed-step graphs capture into it too)."""
        self.logits: torch.Tensor | None = None
        """[min(max size, LOGITS_IN_GRAPH_MAX_BS), vocab] float32, written by the small sizes' graphs."""
        self.greedy_tokens = torch.zeros(min(n, LOGITS_IN_GRAPH_MAX_BS), dtype=torch.int64, device=device)
        """The argmax of ``logits``, written by the same graphs."""

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, size: int):
        common = CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=np.arange(size + 1),
            seq_lens_cpu=np.ones(size, dtype=np.int64),
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )
        return self.attn_backend.build_graph_metadata(common)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool.

        Under inference mode: otherwise autograd would keep every captured forward's
        activations alive for a backward pass that never comes (gigabytes per size).
        """
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            meta = self._metadata(size)
            with_logits = size <= LOGITS_IN_GRAPH_MAX_BS
            self._warm_up_size(size, meta)
            graph = torch.cuda.CUDAGraph()
            with set_forward_context(meta), ep_step_tokens(size), torch.cuda.graph(graph, pool=pool):
                out = self.model(self.input_ids[:size], self.positions[:size])
                if with_logits:
                    logits = self.model.compute_logits(out, out=self.logits[:size])
                    argmax_rows(logits, out=self.greedy_tokens[:size])
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, out, meta)
        self.pool = pool
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s; %.2f GiB reserved by torch",
            len(self.sizes),
            self.max_batch_size,
            time.perf_counter() - start,
            torch.cuda.memory_reserved() / 2**30,
        )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every size's forward once without capturing: an engine that runs decode steps
        eagerly (``--enforce-eager``) has its kernels compiled at start-up, not in the
        first steps of each batch size that requests bring."""
        for size in reversed(self.sizes):
            self._warm_up_size(size, self._metadata(size), for_capture=False)

    def _warm_up_size(self, size: int, meta, for_capture: bool = True) -> None:
        """One forward of ``size`` padding requests (they read and write nothing): compiles,
        and before a capture autotunes and allocates, what that size's steps need (eager
        steps keep cuBLAS, so only a capture tunes the small-M kernels)."""
        tune = small_m_graph_warm_up() if for_capture else contextlib.nullcontext()
        with set_forward_context(meta), ep_step_tokens(size), tune:
            hidden = self.model(self.input_ids[:size], self.positions[:size])
            if size <= LOGITS_IN_GRAPH_MAX_BS:
                logits = self.model.compute_logits(hidden)
                if self.logits is None:
                    rows = len(self.greedy_tokens)
                    self.logits = torch.empty(
                        rows, logits.shape[-1], dtype=logits.dtype, device=logits.device
                    )
                argmax_rows(logits, out=self.greedy_tokens[:size])
        torch.cuda.synchronize()

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a batch of ``num_reqs`` decodes replays, or None when it is too large."""
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        common: CommonAttentionMetadata,
        size: int | None = None,
    ) -> GraphOutput:
        """Replay the graph for this decode step: the smallest captured size that holds it, or
        ``size`` (larger: the size every expert-parallel replica replays in this step)."""
        n = common.num_reqs
        size = size or self.padded_size(n)
        graph, out, meta = self.graphs[size]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(common.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(common.seq_lens, non_blocking=True)
        width = common.block_table.shape[1]
        self.block_table[:n, :width].copy_(common.block_table, non_blocking=True)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        self.attn_backend.update_graph_metadata(meta, common)
        graph.replay()
        if size > LOGITS_IN_GRAPH_MAX_BS:
            return GraphOutput(out[:n], None, None)
        return GraphOutput(out[:n], self.logits[:n], self.greedy_tokens[:n])

    def run_padding(self, size: int) -> None:
        """Replay the graph of ``size`` with padding requests only (they read and write nothing):
        a replica without tokens in a step whose MoE layers gather from every replica."""
        width = self.block_table.shape[1]
        empty = CommonAttentionMetadata(
            num_reqs=0,
            num_actual_tokens=0,
            query_start_loc=self.query_start_loc[:1],
            seq_lens=self.seq_lens[:0],
            block_table=self.block_table[:0],
            slot_mapping=self.slot_mapping[:0],
            query_start_loc_cpu=np.zeros(1, dtype=np.int64),
            seq_lens_cpu=np.zeros(0, dtype=np.int64),
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            block_table_cpu=np.zeros((0, width), dtype=np.int32),
        )
        self.run(self.input_ids[:0], self.positions[:0], empty, size)
