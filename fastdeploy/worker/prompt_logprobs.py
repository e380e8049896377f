"""Prompt logprobs from the hidden states of a prefill step.

The model normally turns into logits only the last position of a finishing
prefill. A request that asked for prompt logprobs also needs the logits of its
other prefill positions: position ``p`` predicts prompt token ``p + 1``. Only
those requests' rows are computed, a bounded number of rows at a time, so a
long prompt never holds a ``[prompt, vocab]`` float32 tensor at once.

With chunked prefill a chunk's last position predicts the first token of the
next chunk, which is already known (the whole prompt is in the persistent
batch), so every chunk reports its own range and nothing is lost between
chunks. As vLLM does by default, the logprobs are ``log_softmax`` of the raw
logits in float32 (before temperature, penalties or bias).
"""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy.worker.input_batch import InputBatch

MAX_ROWS_PER_PASS = 256
"""Prompt positions turned into logits at once (256 × a 150k vocabulary ≈ 150 MB of float32)."""


def _logprob_rows(
    model: torch.nn.Module, hidden: torch.Tensor, rows: np.ndarray, targets: np.ndarray, k: int
) -> tuple[list, list, list, list]:
    """Top-``k`` ids/logprobs, the target token's logprob and its 1-based rank, per hidden row."""
    top_ids: list = []
    top_lps: list = []
    token_lps: list = []
    ranks: list = []
    for start in range(0, len(rows), MAX_ROWS_PER_PASS):
        index = torch.as_tensor(rows[start : start + MAX_ROWS_PER_PASS], device=hidden.device)
        target = torch.as_tensor(targets[start : start + MAX_ROWS_PER_PASS], device=hidden.device)
        logprobs = model.compute_logits(hidden[index]).float().log_softmax(dim=-1)
        token_lp = logprobs.gather(-1, target.unsqueeze(-1))
        rank = (logprobs > token_lp).sum(-1) + 1
        if k > 0:
            values, ids = logprobs.topk(k, dim=-1)
            top_ids += ids.cpu().tolist()
            top_lps += values.cpu().tolist()
        else:
            top_ids += [[] for _ in range(len(index))]
            top_lps += [[] for _ in range(len(index))]
        token_lps += token_lp.squeeze(-1).cpu().tolist()
        ranks += rank.cpu().tolist()
    return top_ids, top_lps, token_lps, ranks


def compute_prompt_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    batch: InputBatch,
    slots: np.ndarray,
    query_start_loc: np.ndarray,
) -> dict[str, list] | None:
    """Prompt logprobs of this step's prefill positions, for the requests that asked.

    ``slots[i]`` is the batch slot whose scheduled tokens are the hidden rows
    ``query_start_loc[i]:query_start_loc[i + 1]``, starting at position
    ``batch.num_computed_tokens[slot]``. Returns ``{req_id: [first prompt index,
    entries]}`` (see ``ModelRunnerOutput.prompt_logprobs``), or None when no
    scheduled request wants prompt logprobs.
    """
    wanted = np.flatnonzero(batch.num_prompt_logprobs[slots] >= 0)
    if len(wanted) == 0:
        return None
    spans = []  # (req_id, first prompt index, number of rows, k)
    rows, targets = [], []
    for i in wanted.tolist():
        slot = int(slots[i])
        start = int(batch.num_computed_tokens[slot])
        num_scheduled = int(query_start_loc[i + 1] - query_start_loc[i])
        end = min(start + num_scheduled, int(batch.num_prompt_tokens[slot]) - 1)
        if end <= start:
            continue  # a decode step, or a resumed request past its prompt
        rows.append(query_start_loc[i] + np.arange(end - start))
        targets.append(batch.token_ids[slot, start + 1 : end + 1])
        spans.append((batch.req_ids[slot], start + 1, end - start, int(batch.num_prompt_logprobs[slot])))
    if not spans:
        return None
    max_k = max(k for *_, k in spans)
    top_ids, top_lps, token_lps, ranks = _logprob_rows(
        model, hidden, np.concatenate(rows), np.concatenate(targets), max_k
    )
    out: dict[str, list] = {}
    offset = 0
    for req_id, first_index, count, k in spans:
        entries = [
            [top_ids[r][:k], top_lps[r][:k], token_lps[r], ranks[r]] for r in range(offset, offset + count)
        ]
        out[req_id] = [first_index, entries]
        offset += count
    return out
