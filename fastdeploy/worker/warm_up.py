"""A model runner's start-up forwards: the profile run that sizes the KV cache, and the warm-up steps
that compile the kernels' variants before the first request needs them.

Functions of a :class:`~fastdeploy.worker.model_runner.ModelRunner` (its model, batch, metadata
builder and graphs), kept apart from the per-step code.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from fastdeploy.core.step_io import bitmask_words
from fastdeploy.model_executor.attention.forward_context import set_forward_context
from fastdeploy.model_executor.sampler import apply_token_bitmask
from fastdeploy.worker.step_state import StepArrays

if TYPE_CHECKING:
    from fastdeploy.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

WARM_UP_QUERY_LENS = (2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
"""Token counts of the start-up prefills (capped at the step token budget, which is warmed up
too): powers of two, so that for any GQA group one of them falls in each row-block class of the
attention kernel and of either class of Triton's integer specialization (multiples of 16 or
not); 1,024, 4,096 and the budget for the fused-MoE kernels' larger tile and expert-sort chunk
classes, which a fresh machine otherwise compiled in the first requests' steps (~1.2 s,
``benchmarks/gpubench/cold_start.py``). A count above ``max_model_len`` runs as several requests."""


def warm_up_request_lens(num_tokens: int, max_model_len: int) -> list[int]:
    """The prompt lengths of a warm-up step of ``num_tokens`` tokens: one request, or requests of
    ``max_model_len`` tokens and the rest (a step may hold more tokens than one request can)."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@torch.inference_mode()
def profile_run(runner: ModelRunner) -> None:
    """One forward pass of ``max_num_batched_tokens`` tokens plus sampling of ``max_num_seqs``
    rows, without a KV cache, so that the peak activation memory can be measured. A budget past
    ``max_model_len`` is the prompts of several requests, as a real step of that size is (their
    positions restart; the cache-less attention reads them as one causal run)."""
    sched = runner.config.scheduler
    num_tokens = sched.max_num_batched_tokens
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=runner.device)
    positions = torch.cat(
        [torch.arange(n, dtype=torch.int64) for n in warm_up_request_lens(num_tokens, runner.max_model_len)]
    ).to(runner.device)
    hidden = runner.model(ids, positions)
    rows = min(sched.max_num_seqs, num_tokens)
    logits = runner.model.compute_logits(hidden[:rows])
    logits.softmax(-1).sort(dim=-1)  # top-p sorts the whole vocabulary
    del hidden, logits
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


@torch.inference_mode()
def warm_up_kernels(runner: ModelRunner) -> None:
    """Compile the attention kernels at start-up rather than in the first requests' steps.

    Triton and FlashInfer compile a kernel variant the first time a step needs it, a
    second or more each: the first prompt waited for its prefill kernels, and with
    ``--enforce-eager`` the first step of each new decode batch size for its own. Here one
    prefill per query-length class runs, and, when no graphs were captured, one decode per
    size a graph would have had; their requests write nothing to the KV cache. Multimodal
    models are skipped: their M-RoPE positions are not the plain ones these steps use.
    """
    if runner.mm is not None:
        return
    start = time.perf_counter()
    budget = runner.config.scheduler.max_num_batched_tokens
    query_lens = sorted({min(n, budget) for n in WARM_UP_QUERY_LENS} | {budget})
    for query_len in query_lens:
        logits = warm_up_prefill(runner, query_len)
    warm_up_grammar_mask(logits)
    decode_sizes: list[int] = []
    if runner.graphs is None and runner.device.type == "cuda":
        if runner.attn_backend.supports_cuda_graphs:  # its graph metadata works eagerly
            graphs = runner.new_decode_graphs()
            graphs.warm_up()
            decode_sizes = graphs.sizes
    logger.info(
        "compiled the kernels of prefill lengths %s and eager decode sizes 1..%s in %.1f s",
        query_lens,
        decode_sizes[-1] if decode_sizes else "-",
        time.perf_counter() - start,
    )


def warm_up_prefill(runner: ModelRunner, num_tokens: int) -> torch.Tensor:
    """One forward of ``num_tokens`` new prompt tokens that writes no cache slot: one request, or as
    many of at most ``max_model_len`` as a step of that many tokens needs; returns its logits."""
    width = runner.batch.block_table.table.shape[1]
    seq_lens = np.array(warm_up_request_lens(num_tokens, runner.max_model_len), dtype=np.int64)
    query_start_loc = np.concatenate([[0], np.cumsum(seq_lens)])
    no_tokens = np.zeros(0, dtype=np.int64)
    host = StepArrays(
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_table=np.zeros((len(seq_lens), width), dtype=np.int32),
        slot_mapping=np.full(num_tokens, -1, dtype=np.int64),
        input_ids=np.zeros(num_tokens, dtype=np.int64),
        positions=np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens]),
        logits_indices=query_start_loc[1:] - 1,
        unsaved_tokens=no_tokens,
        unsaved_rows=no_tokens,
        length_codes=np.zeros(len(seq_lens), dtype=np.int32),
    )
    dev = host.upload(runner.device)
    attn_metadata = runner.attention_metadata(host, dev, query_start_loc, seq_lens, int(seq_lens.max()))
    with set_forward_context(attn_metadata):
        hidden = runner.model(dev.input_ids, dev.positions)
    return runner.model.compute_logits(hidden[dev.logits_indices])


def warm_up_grammar_mask(logits: torch.Tensor) -> None:
    """Compile xgrammar's bitmask kernel (Triton) now, for the row counts it is specialized on
    (one, a multiple of 16, any other), rather than in the first structured-output steps
    (docs/benchmarks.md, sixteenth session). Nothing to do without xgrammar."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return
    vocab = logits.shape[-1]
    scratch = logits.new_zeros((16, vocab))
    mask = torch.full((16, bitmask_words(vocab)), -1, dtype=torch.int32, device=logits.device)
    for rows in (1, 2, 16):
        apply_token_bitmask(scratch, mask, torch.arange(rows, device=logits.device))
