"""Builds the sampler's per-step tensors from the persistent batch.

Everything is gathered with vectorised numpy indexing over the slots being
sampled; the only per-request Python work is for requests with multi-token
``bad_words`` (their prefix must be compared with the latest output tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fastdeploy.model_executor.sampler import PenaltyTensors, SamplingTensors
from fastdeploy.worker.input_batch import InputBatch


def build_sampling_tensors(
    batch: InputBatch, slots: np.ndarray, vocab_size: int, to_device: Callable[[np.ndarray], torch.Tensor]
) -> SamplingTensors:
    """The sampler inputs for rows ``slots`` (row i samples for slot ``slots[i]``)."""
    temperature = batch.temperature[slots]
    top_k = batch.top_k[slots]
    generators = {
        row: batch.generators[slot] for row, slot in enumerate(slots.tolist()) if slot in batch.generators
    }
    row_of_slot = np.full(batch.max_num_reqs, -1, dtype=np.int64)
    row_of_slot[slots] = np.arange(len(slots))
    sparse = batch.sparse_entries()
    num_output = batch.num_tokens - batch.num_prompt_tokens

    logit_bias = None
    b_slots, b_tokens, b_values = sparse["logit_bias"]
    if len(b_slots):
        rows = row_of_slot[b_slots]
        keep = rows >= 0
        if keep.any():
            logit_bias = (to_device(rows[keep]), to_device(b_tokens[keep]), to_device(b_values[keep]))

    ban_rows, ban_tokens = [], []
    m_slots, m_tokens = sparse["min_tokens"]
    if len(m_slots):
        active = (row_of_slot[m_slots] >= 0) & (num_output[m_slots] < batch.min_tokens[m_slots])
        ban_rows.append(row_of_slot[m_slots[active]])
        ban_tokens.append(m_tokens[active])
    s_slots, s_tokens = sparse["static_bans"]
    if len(s_slots):
        rows = row_of_slot[s_slots]
        ban_rows.append(rows[rows >= 0])
        ban_tokens.append(s_tokens[rows >= 0])
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
    if ban_rows and sum(len(r) for r in ban_rows):
        banned = (to_device(np.concatenate(ban_rows)), to_device(np.concatenate(ban_tokens)))

    penalties = None
    rep, pres, freq = (
        batch.repetition_penalty[slots],
        batch.presence_penalty[slots],
        batch.frequency_penalty[slots],
    )
    if (rep != 1).any() or (pres != 0).any() or (freq != 0).any():
        penalties = _penalty_tensors(batch, slots, vocab_size, rep, pres, freq, to_device)

    num_logprobs = batch.num_logprobs[slots]
    return SamplingTensors(
        temperature=to_device(temperature),
        top_p=to_device(batch.top_p[slots]),
        top_k=to_device(top_k),
        min_p=to_device(batch.min_p[slots]),
        generators=generators,
        all_greedy=bool(((temperature == 0) | (top_k == 1)).all()),
        logit_bias=logit_bias,
        banned=banned,
        penalties=penalties,
        max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
        max_top_k=int(top_k.max()) if len(top_k) else 0,
        any_top_p=bool((batch.top_p[slots] < 1.0).any()),
        any_min_p=bool((batch.min_p[slots] > 0).any()),
    )


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
