"""CUDA graphs of the model's forward for small steps that are not decode-only: a lone prompt's
prefill, a prompt chunk, decodes with a new prompt mixed in (``--cuda-graph-max-tokens``).

A small prefill runs eagerly otherwise, and its kernels take less time on the GPU than the host
takes to launch them: a lone 512-token prompt of an 8B model runs 11 ms of kernels in 20-27 ms
(docs/benchmarks.md, seventeenth session). Here a step of ``t`` tokens and ``r`` requests replays
the graph captured for the smallest token size ``>= t``, whose attention metadata has room for
every request the scheduler may batch and one more:

* the step's tokens, positions and cache slots fill the first ``t`` rows of static buffers; the
  rows up to the size are padding tokens (slot -1: they write no cache);
* requests ``0..r-1`` keep their query ranges, sequence lengths and block-table rows; request
  ``r`` owns the padding tokens with sequence length 0 (it reads nothing; its rows come out
  zero), and the requests after it own no token (their programs return at once).

The attention backend must launch grids that depend only on shapes (``supports_mixed_graphs``:
the Triton backend, whose unified kernel's grid is ``size // BLOCK_Q + request slots``). The
tile configuration is that of the size's longest possible query, which is right for any step
it serves. The LM head and the sampler stay outside the graph (only some rows sample).
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from fastdeploy.config import EngineConfig
from fastdeploy.distributed import ep_step_tokens
from fastdeploy.model_executor.attention.backend import AttentionBackend
from fastdeploy.model_executor.attention.forward_context import set_forward_context
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
from fastdeploy.model_executor.layers.linear import small_m_graph_warm_up
from fastdeploy.worker.cuda_graph import CapturedForwards

logger = logging.getLogger(__name__)


MIXED_SIZE_STEP = 128
"""Above 256 tokens the sizes grow by this many (below, they double): a step pads by at most
twice its tokens while that is few tokens, and by at most this many beyond."""


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then steps of :data:`MIXED_SIZE_STEP`, up to ``max_tokens`` (always
    included): one captured graph per size."""
    sizes = []
    size = 16
    while size < max_tokens:
        sizes.append(size)
        size = size * 2 if size < 256 else size + MIXED_SIZE_STEP
    return sizes + [max_tokens]


class MixedStepGraphs(CapturedForwards):
    """Captured forwards of small non-decode steps, one per token size, and the buffers they read.

    Without :meth:`capture` (a CPU, tests) :meth:`run` runs the same padded forward eagerly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        max_tokens: int,
        max_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ):
        self.max_reqs = max_reqs
        # one request slot more: the request that owns the padding tokens
        super().__init__(
            model, attn_backend, mixed_token_sizes(max_tokens), max_reqs + 1, max_blocks_per_req,
            block_size, max_model_len, device,
        )  # fmt: skip
        self.metadata = {size: self._metadata(size) for size in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """size → (graph, its hidden-state output)."""

    def _metadata(self, size: int):
        slots = self.max_reqs + 1
        common = CommonAttentionMetadata(
            num_reqs=slots,
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=np.zeros(slots + 1, dtype=np.int64),  # (read by host-planning
            seq_lens_cpu=np.zeros(slots, dtype=np.int64),  # backends, which have no mixed graphs)
            max_query_len=size,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )
        return self.attn_backend.build_graph_metadata(common)

    def padded_size(self, common: CommonAttentionMetadata) -> int | None:
        """The token size a step replays, or None when it does not fit (too many tokens or requests,
        a wider block table, or a mask other than causal)."""
        if (
            common.num_reqs > self.max_reqs
            or common.block_table.shape[1] > self.block_table.shape[1]
            or common.attn_mask_offsets is not None
        ):
            return None
        for size in self.sizes:
            if size >= common.num_actual_tokens:
                return size
        return None

    def _load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata, size: int
    ):
        """Copy the step into the static buffers and pad it to ``size`` tokens (see the module doc)."""
        tokens, reqs = common.num_actual_tokens, common.num_reqs
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(common.slot_mapping, non_blocking=True)
        self.input_ids[tokens:size].zero_()
        self.positions[tokens:size].zero_()
        self.slot_mapping[tokens:size].fill_(-1)
        self.query_start_loc[: reqs + 1].copy_(common.query_start_loc, non_blocking=True)
        self.query_start_loc[reqs + 1 :].fill_(size)
        self.seq_lens[:reqs].copy_(common.seq_lens, non_blocking=True)
        self.seq_lens[reqs:].zero_()
        width = common.block_table.shape[1]
        self.block_table[:reqs, :width].copy_(common.block_table, non_blocking=True)

    def _forward(self, size: int) -> torch.Tensor:
        with set_forward_context(self.metadata[size]), ep_step_tokens(size):
            return self.model(self.input_ids[:size], self.positions[:size])

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata, size: int
    ) -> torch.Tensor:
        """The hidden states ``[num_actual_tokens, hidden]`` of this step, by the graph of ``size``
        (a view of the graph's output: use it before the next replay)."""
        self._load(input_ids, positions, common, size)
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self._forward(size)
        return out[: common.num_actual_tokens]

    def _load_padding(self, size: int) -> None:
        """Every token of ``size`` padding (request 0 owns them all, reads and writes nothing)."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slot_mapping[:size].fill_(-1)
        self.query_start_loc[0] = 0
        self.query_start_loc[1:].fill_(size)
        self.seq_lens.zero_()

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every size, largest first, in ``pool`` (the decode graphs' memory pool, shared)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._load_padding(size)
            with small_m_graph_warm_up():  # compiles and tunes this size's kernels
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for steps of up to %d tokens (sizes %s, %d requests) in %.1f s",
            self.sizes[-1],
            self.sizes,
            self.max_reqs,
            time.perf_counter() - start,
        )

    def try_capture(self, pool=None) -> bool:
        """:meth:`capture`, or False (and no graphs: those steps run eagerly) when the GPU runs out
        of memory meanwhile or a kernel refuses to be captured (an error here never stops the engine:
        these graphs are an optimisation)."""
        try:
            self.capture(pool)
            return True
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            logger.warning("could not capture the mixed-step CUDA graphs (%s): those steps run eagerly", exc)
            self.graphs.clear()
            if torch.cuda.is_available():
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            return False


def mixed_step_graphs(
    model: torch.nn.Module,
    attn_backend: AttentionBackend,
    config: EngineConfig,
    max_blocks_per_req: int,
    max_model_len: int,
    device: torch.device,
) -> MixedStepGraphs | None:
    """The graphs ``--cuda-graph-max-tokens`` asks for (not yet captured), or None: 0 asked for, or
    an attention backend whose grids depend on more than shapes."""
    sched = config.scheduler
    max_tokens = min(config.device.cuda_graph_max_tokens, sched.max_num_batched_tokens)
    if max_tokens <= 0 or not attn_backend.supports_mixed_graphs:
        return None
    max_reqs = min(sched.max_num_seqs, max_tokens)  # every request of a step has a token in it
    return MixedStepGraphs(
        model,
        attn_backend,
        max_tokens,
        max_reqs,
        max_blocks_per_req,
        config.cache.block_size,
        max_model_len,
        device,
    )
