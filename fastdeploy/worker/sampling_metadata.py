"""Builds the sampler's per-step tensors from the persistent batch.

Everything is gathered with vectorised numpy indexing over the slots being
sampled; the only per-request Python work is for requests with multi-token
``bad_words`` (their prefix must be compared with the latest output tokens).
Tensors that depend only on which requests are in the batch (temperatures, top-k/p,
min-p, logit bias, static bans, seeded generators) are built once per batch
composition and reused until a request joins or leaves; only history-dependent
parts (penalties, ``min_tokens``, multi-token bad words) are rebuilt every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from fastdeploy.model_executor.sampler import PenaltyTensors, SamplingTensors
from fastdeploy.worker.input_batch import InputBatch


def _composition_part(
    batch: InputBatch,
    slots: np.ndarray,
    row_of_slot: np.ndarray,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> tuple[SamplingTensors, tuple[np.ndarray, np.ndarray], bool]:
    """What depends only on the batch's requests: the sampler inputs without bans and
    penalties, the single-token bans as (rows, tokens), and whether any row has penalties."""
    temperature, top_k = batch.temperature[slots], batch.top_k[slots]
    top_p, min_p = batch.top_p[slots], batch.min_p[slots]
    sparse = batch.sparse_entries()
    logit_bias = None
    b_slots, b_tokens, b_values = sparse["logit_bias"]
    if len(b_slots):
        rows = row_of_slot[b_slots]
        keep = rows >= 0
        if keep.any():
            logit_bias = (to_device(rows[keep]), to_device(b_tokens[keep]), to_device(b_values[keep]))
    s_slots, s_tokens = sparse["static_bans"]
    s_rows = row_of_slot[s_slots]
    num_logprobs = batch.num_logprobs[slots]
    rep, pres, freq = (
        batch.repetition_penalty[slots],
        batch.presence_penalty[slots],
        batch.frequency_penalty[slots],
    )
    base = SamplingTensors(
        temperature=to_device(temperature),
        top_p=to_device(top_p),
        top_k=to_device(top_k),
        min_p=to_device(min_p),
        generators={
            int(row_of_slot[slot]): gen for slot, gen in batch.generators.items() if row_of_slot[slot] >= 0
        },
        all_greedy=bool(((temperature == 0) | (top_k == 1)).all()),
        logit_bias=logit_bias,
        max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
        max_top_k=int(top_k.max()) if len(top_k) else 0,
        any_top_p=bool((top_p < 1.0).any()),
        any_min_p=bool((min_p > 0).any()),
    )
    has_penalties = bool((rep != 1).any() or (pres != 0).any() or (freq != 0).any())
    return base, (s_rows[s_rows >= 0], s_tokens[s_rows >= 0]), has_penalties


def build_sampling_tensors(
    batch: InputBatch, slots: np.ndarray, vocab_size: int, to_device: Callable[[np.ndarray], torch.Tensor]
) -> SamplingTensors:
    """The sampler inputs for rows ``slots`` (row i samples for slot ``slots[i]``)."""
    row_of_slot = batch.rows_of(slots)
    base, static_bans, has_penalties = batch.per_composition(
        "sampling", slots, lambda: _composition_part(batch, slots, row_of_slot, to_device)
    )
    sparse = batch.sparse_entries()
    num_output = batch.num_tokens - batch.num_prompt_tokens

    ban_rows, ban_tokens = [static_bans[0]], [static_bans[1]]
    m_slots, m_tokens, _ = sparse["stop_ids"]  # banned while a slot's outputs are fewer than min_tokens
    if len(m_slots):
        active = (row_of_slot[m_slots] >= 0) & (num_output[m_slots] < batch.min_tokens[m_slots])
        ban_rows.append(row_of_slot[m_slots[active]])
        ban_tokens.append(m_tokens[active])
    for slot, words in batch.bad_word_seqs.items():
        row = row_of_slot[slot]
        if row < 0:
            continue
        output = batch.token_ids[slot, batch.num_prompt_tokens[slot] : batch.num_tokens[slot]]
        for word in words:
            prefix = word[:-1]
            if len(output) >= len(prefix) and output[len(output) - len(prefix) :].tolist() == prefix:
                ban_rows.append(np.array([row]))
                ban_tokens.append(np.array([word[-1]]))
    banned = None
    if sum(len(r) for r in ban_rows):
        banned = (to_device(np.concatenate(ban_rows)), to_device(np.concatenate(ban_tokens)))

    penalties = None
    if has_penalties:
        rep, pres, freq = (
            batch.repetition_penalty[slots],
            batch.presence_penalty[slots],
            batch.frequency_penalty[slots],
        )
        penalties = _penalty_tensors(batch, slots, vocab_size, rep, pres, freq, to_device)
    return dataclasses.replace(base, banned=banned, penalties=penalties)


def _penalty_tensors(
    batch: InputBatch,
    slots: np.ndarray,
    vocab_size: int,
    rep: np.ndarray,
    pres: np.ndarray,
    freq: np.ndarray,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> PenaltyTensors:
    """Prompt-token masks and output-token counts from a padded token tensor (scatter-add, no row loop)."""
    num_tokens = batch.num_tokens[slots]
    num_prompt = batch.num_prompt_tokens[slots]
    width = int(num_tokens.max())
    tokens = batch.token_ids[slots, :width]
    pos = np.arange(width)[None, :]
    pad = vocab_size  # an extra column that collects padding, dropped afterwards
    prompt_ids = np.where(pos < num_prompt[:, None], tokens, pad)
    output_ids = np.where((pos >= num_prompt[:, None]) & (pos < num_tokens[:, None]), tokens, pad)
    rows = len(slots)
    prompt_idx, output_idx = to_device(prompt_ids), to_device(output_ids)
    prompt_mask = torch.zeros(rows, vocab_size + 1, dtype=torch.bool, device=prompt_idx.device)
    prompt_mask.scatter_(1, prompt_idx, True)
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.float32, device=output_idx.device)
    counts.scatter_add_(
        1, output_idx, torch.ones(output_idx.shape, dtype=torch.float32, device=output_idx.device)
    )
    return PenaltyTensors(
        repetition=to_device(rep),
        presence=to_device(pres),
        frequency=to_device(freq),
        prompt_mask=prompt_mask[:, :vocab_size],
        output_counts=counts[:, :vocab_size],
    )
