"""What one model-runner step carries between its stages, and the device-side stop check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fastdeploy.model_executor.sampler import LogprobsTensors
from fastdeploy.worker.input_batch import InputBatch


@dataclass
class StepState:
    """A step between ``_preprocess_and_execute_model``, ``_postprocess`` and ``_save_model_output``.

    Everything here refers to the step's own requests: the persistent batch may have
    moved on (requests finished, slots reused) by the time the step is saved.
    """

    step_id: int
    sample_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Batch slots that sample a token this step, in output row order."""
    req_ids: list[str] = field(default_factory=list)
    """The request of each sampled row (to detect slots reused before the save)."""
    num_tokens_after: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per sampled row, the request's token count once it has this step's token."""
    stopped_by_length: torch.Tensor | None = None
    """[rows] bool on the device: the request ends by length with this token (uploaded with the inputs)."""
    logits: torch.Tensor | None = None
    """[rows, vocab] float32 logits, until sampled."""
    greedy_tokens: torch.Tensor | None = None
    """[rows] argmax of ``logits`` when the decode graph computed it, until sampled."""
    prompt_logprobs: dict[str, list] | None = None
    token_ids_host: torch.Tensor | None = None
    """Pinned host copy of the sampled ids; valid once ``event`` has completed."""
    logprobs: LogprobsTensors | None = None
    stopped: torch.Tensor | None = None
    """[rows] bool on the device: the request ends with this token."""
    stopped_host: torch.Tensor | None = None
    """Pinned host copy of ``stopped``; valid once ``event`` has completed."""
    event: Any = None
    """CUDA event recorded after the device-to-host copies (None on a CPU: already done)."""


def length_stop_flags(
    batch: InputBatch, slots: np.ndarray, num_tokens_after: np.ndarray, max_model_len: int
) -> np.ndarray:
    """Per sampled row (slot ``slots[i]``, ``num_tokens_after[i]`` tokens once it has its new one),
    whether the request ends by length: ``max_tokens`` outputs or ``max_model_len`` tokens.

    Known on the host before sampling, so it travels with the step's inputs.
    """
    num_output_after = num_tokens_after - batch.num_prompt_tokens[slots]
    return (num_output_after >= batch.max_tokens[slots]) | (num_tokens_after >= max_model_len)


def device_stop_flags(
    batch: InputBatch,
    slots: np.ndarray,
    sampled: torch.Tensor,
    by_length: torch.Tensor,
    num_tokens_after: np.ndarray,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> torch.Tensor:
    """Per sampled row, whether its token ends the request: ``by_length`` (the device copy of
    :func:`length_stop_flags`), or a stop id (EOS unless ignored, ``stop_token_ids``) once
    ``min_tokens`` are out.

    Token comparisons happen on the device, so the ids never travel to the host for this.
    """
    cached = batch.per_composition("stop_ids", slots, lambda: _stop_id_rows(batch, slots, to_device))
    if cached is None:
        return by_length
    rows, owners, rows_dev, tokens_dev = cached
    hits = (sampled[rows_dev] == tokens_dev).to(torch.int32)
    gated = batch.min_tokens[owners] > 0
    if gated.any():  # stop ids count only once min_tokens are out
        num_output_after = num_tokens_after - batch.num_prompt_tokens[slots]
        eligible = num_output_after[rows] >= batch.min_tokens[owners]
        hits = hits * to_device(eligible.astype(np.int32))
    counts = torch.zeros(len(slots), dtype=torch.int32, device=sampled.device).index_add_(0, rows_dev, hits)
    return by_length | (counts > 0)


def _stop_id_rows(batch: InputBatch, slots: np.ndarray, to_device: Callable[[np.ndarray], torch.Tensor]):
    """(rows, owning slots, rows on the device, stop ids on the device) of every stop id of the
    sampled rows, or None when none has any."""
    stop_slots, stop_tokens = batch.sparse_entries()["stop_ids"]
    rows = batch.rows_of(slots)[stop_slots]
    keep = rows >= 0
    rows, tokens, owners = rows[keep], stop_tokens[keep], stop_slots[keep]
    return (rows, owners, to_device(rows), to_device(tokens)) if len(rows) else None
