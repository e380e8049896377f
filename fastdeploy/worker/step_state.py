"""What one model-runner step carries between its stages, and the device-side stop check."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from fastdeploy.core.step_io import StopCode, reaches_length_limit
from fastdeploy.model_executor.attention.backend import AttentionMetadata
from fastdeploy.model_executor.sampler import LogprobsTensors
from fastdeploy.ops.upload import upload
from fastdeploy.worker.input_batch import InputBatch

Array = TypeVar("Array", np.ndarray, torch.Tensor)


@dataclass
class StepArrays(Generic[Array]):
    """A step's model inputs: numpy arrays built on the host, then (:meth:`upload`) device tensors
    of the same names, dtypes and shapes, all moved in one host-to-device copy."""

    query_start_loc: Array
    """[reqs + 1] int32: request ``i`` owns the tokens ``query_start_loc[i]:[i + 1]``."""
    seq_lens: Array
    """[reqs] int32: context length including this step's tokens."""
    block_table: Array
    """[reqs, max blocks] int32."""
    slot_mapping: Array
    """[tokens] int64: flat KV-cache slot of each token (-1: write nothing)."""
    input_ids: Array
    """[tokens] int64; a token sampled by the step still in flight is patched in on the device."""
    positions: Array
    """[tokens] int64, or [3, tokens] M-RoPE positions."""
    logits_indices: Array
    """[sampled rows] int64: the token whose hidden state gives each sampled row's logits."""
    unsaved_tokens: Array
    """Indices into ``input_ids`` of the tokens sampled by the step still in flight."""
    unsaved_rows: Array
    """For each of those, its row in that step's sampled ids."""
    length_codes: Array
    """[sampled rows] int32: ``StopCode.LENGTH`` where the row's new token reaches max_tokens or
    max_model_len, else ``RUNNING`` (known before sampling, see :func:`length_stop_codes`)."""
    mask_offsets: Array | None = None
    """[tokens] int32 attention-mask offsets (bidirectional multimodal items), or None."""

    def upload(self, device: torch.device) -> StepArrays[torch.Tensor]:
        """The arrays as tensors on ``device``, views of one buffer copied at once (:func:`upload`)."""
        present = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        present = {name: array for name, array in present.items() if array is not None}
        return StepArrays(**dict(zip(present, upload(list(present.values()), device))))


@dataclass
class StepInputs:
    """What ``ModelRunner._prepare_inputs`` gives the forward pass and the step's later stages."""

    tensors: StepArrays[torch.Tensor]
    """The model inputs on the device."""
    attn_metadata: AttentionMetadata
    inputs_embeds: torch.Tensor | None
    """Token embeddings with multimodal features placed in (vision-language models), or None."""
    sample_slots: np.ndarray
    """Batch slots that sample a token this step, in row order."""
    num_tokens_after: np.ndarray
    """Per sampled row, the request's token count once it has this step's token."""
    scheduled_slots: np.ndarray
    """Slots of every scheduled request: ``scheduled_slots[i]`` owns the hidden rows
    ``query_start_loc_cpu[i]:[i + 1]`` (for prompt logprobs)."""
    query_start_loc_cpu: np.ndarray
    """[reqs + 1] int64."""


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
    length_codes: torch.Tensor | None = None
    """[rows] int32 on the device: the stop code by length alone (uploaded with the inputs)."""
    logits: torch.Tensor | None = None
    """[rows, vocab] float32 logits, until sampled."""
    greedy_tokens: torch.Tensor | None = None
    """[rows] argmax of ``logits`` when the decode graph computed it, until sampled."""
    prompt_logprobs: dict[str, list] | None = None
    pooled: dict[str, bytes] | None = None
    """Pooling runner: the pooled vectors of the requests whose prompt ended this step."""
    token_ids_host: torch.Tensor | None = None
    """Pinned host copy of the sampled ids; valid once ``event`` has completed."""
    logprobs: LogprobsTensors | None = None
    stop_codes: torch.Tensor | None = None
    """[rows] int32 :class:`StopCode` on the device: whether (and why) the request ends with this token."""
    stop_codes_host: torch.Tensor | None = None
    """Pinned host copy of ``stop_codes``; valid once ``event`` has completed."""
    event: Any = None
    """CUDA event recorded after the device-to-host copies (None on a CPU: already done)."""


def length_stop_codes(
    batch: InputBatch, slots: np.ndarray, num_tokens_after: np.ndarray, max_model_len: int
) -> np.ndarray:
    """Per sampled row (slot ``slots[i]``, ``num_tokens_after[i]`` tokens once it has its new one),
    int32 ``StopCode.LENGTH`` where the request ends by length with that token, else ``RUNNING``.

    Known on the host before sampling, so it travels with the step's inputs.
    """
    num_output_after = num_tokens_after - batch.num_prompt_tokens[slots]
    ends = reaches_length_limit(num_output_after, num_tokens_after, batch.max_tokens[slots], max_model_len)
    return np.where(ends, StopCode.LENGTH, StopCode.RUNNING).astype(np.int32)


def device_stop_codes(
    batch: InputBatch,
    slots: np.ndarray,
    sampled: torch.Tensor,
    length_codes: torch.Tensor,
    num_tokens_after: np.ndarray,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> torch.Tensor:
    """Per sampled row, the int32 :class:`StopCode` of its token: the one stop decision the engine acts on.

    A stop id (``EOS``, else ``STOP_TOKEN``) once ``min_tokens`` are out, else
    ``length_codes`` (the device copy of :func:`length_stop_codes`). Token comparisons happen
    on the device, so the sampled ids never travel to the host for this.
    """
    cached = batch.per_composition("stop_ids", slots, lambda: _stop_id_rows(batch, slots, to_device))
    if cached is None:
        return length_codes
    rows, owners, rows_dev, tokens_dev, codes_dev = cached
    hits = torch.where(sampled[rows_dev] == tokens_dev, codes_dev, 0)
    gated = batch.min_tokens[owners] > 0
    if gated.any():  # stop ids count only once min_tokens are out
        num_output_after = num_tokens_after - batch.num_prompt_tokens[slots]
        eligible = num_output_after[rows] >= batch.min_tokens[owners]
        hits = hits * to_device(eligible.astype(np.int32))
    # a row's stop ids are distinct, so at most one hits: the sum is its code
    by_id = torch.zeros(len(slots), dtype=torch.int32, device=sampled.device).index_add_(0, rows_dev, hits)
    return torch.where(by_id > 0, by_id, length_codes)


def _stop_id_rows(batch: InputBatch, slots: np.ndarray, to_device: Callable[[np.ndarray], torch.Tensor]):
    """(rows, owning slots, rows, stop ids and their codes on the device) of every stop id of the
    sampled rows, or None when none has any."""
    stop_slots, stop_tokens, stop_codes = batch.sparse_entries()["stop_ids"]
    rows = batch.rows_of(slots)[stop_slots]
    keep = rows >= 0
    rows, tokens, codes, owners = rows[keep], stop_tokens[keep], stop_codes[keep], stop_slots[keep]
    if not len(rows):
        return None
    return rows, owners, to_device(rows), to_device(tokens), to_device(codes)
