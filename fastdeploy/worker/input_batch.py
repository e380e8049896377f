"""The persistent batch: per-slot request state kept across steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastdeploy.core.step_io import NewRequestData, StopCode, WorkerSamplingParams
from fastdeploy.worker.block_table import BlockTable

NO_MAX_TOKENS = np.iinfo(np.int64).max
"""``max_tokens`` of a request without a limit."""

_NO_SAMPLING = WorkerSamplingParams()
"""What an empty slot holds."""


class InputBatch:
    """Token ids, progress, block table and sampling parameters of every running request.

    A request keeps its slot from admission until it finishes or is preempted;
    only deltas arrive from the scheduler. Per-step inputs are gathered from
    these arrays with vectorised numpy, never by rebuilding Python lists.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size))
        # per-slot sampling and stop controls, written by _set_sampling (the defaults for empty slots)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}
        self.repetition_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.max_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        """Output tokens allowed per slot (no limit: :data:`NO_MAX_TOKENS`)."""
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """Top logprobs wanted per token; -1: no logprobs."""
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """Top logprobs wanted per prompt token; -1: no prompt logprobs."""
        self.logit_bias: dict[int, dict[int, float]] = {}
        self.stop_ids: dict[int, dict[int, StopCode]] = {}
        """Slot → the token ids that end it once ``min_tokens`` are out, each with its stop code
        (EOS unless ignored, then ``stop_token_ids``); banned until then."""
        self.static_bans: dict[int, list[int]] = {}
        """Slot → single-token bad words (always banned)."""
        self.bad_word_seqs: dict[int, list[list[int]]] = {}
        """Slot → multi-token bad words (banned when the preceding output tokens match)."""
        for slot in range(max_num_reqs):
            self._set_sampling(slot, _NO_SAMPLING)
        self._sparse: dict[str, tuple[np.ndarray, ...]] | None = None
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.version = 0
        """Bumped whenever a request joins or leaves: keys caches of per-row device tensors."""
        self._composition_cache: dict[str, tuple[tuple, Any]] = {}
        """name → ((version, slots), value): see :meth:`per_composition`."""

    @property
    def num_slots(self) -> int:
        """One past the highest slot in use (slots below may be empty)."""
        return max(self.req_id_to_index.values(), default=-1) + 1

    def add_request(self, req: NewRequestData) -> int:
        if not self._free_slots:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} requests)")
        self._free_slots.sort(reverse=True)
        slot = self._free_slots.pop()
        n = len(req.token_ids)
        if n > self.max_model_len:
            raise ValueError(f"request {req.req_id} has {n} tokens, above max_model_len {self.max_model_len}")
        self.req_ids[slot] = req.req_id
        self.req_id_to_index[req.req_id] = slot
        self.token_ids[slot, :n] = req.token_ids
        self.num_tokens[slot] = n
        self.num_prompt_tokens[slot] = req.num_prompt_tokens
        self.num_computed_tokens[slot] = req.num_computed_tokens
        self.block_table.set_row(slot, req.block_ids)
        self._set_sampling(slot, req.sampling)
        self._sparse = None
        self.version += 1
        return slot

    def remove_request(self, req_id: str) -> None:
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is None:
            return
        self.req_ids[slot] = None
        self.block_table.clear_row(slot)
        self._set_sampling(slot, _NO_SAMPLING)
        self._sparse = None
        self.version += 1
        self._free_slots.append(slot)

    def _set_sampling(self, slot: int, s: WorkerSamplingParams) -> None:
        """Write the sampling and stop controls of ``slot`` (the defaults when it is emptied)."""
        self.temperature[slot] = s.temperature
        self.top_p[slot] = s.top_p
        self.top_k[slot] = max(s.top_k, 0)  # 0: no top-k
        self.min_p[slot] = s.min_p
        self.repetition_penalty[slot] = s.repetition_penalty
        self.presence_penalty[slot] = s.presence_penalty
        self.frequency_penalty[slot] = s.frequency_penalty
        self.min_tokens[slot] = s.min_tokens
        self.max_tokens[slot] = NO_MAX_TOKENS if s.max_tokens is None else s.max_tokens
        self.num_logprobs[slot] = -1 if s.logprobs is None else s.logprobs
        self.num_prompt_logprobs[slot] = -1 if s.prompt_logprobs is None else s.prompt_logprobs
        _set_or_pop(
            self.generators,
            slot,
            None if s.seed is None else torch.Generator(device=self.device).manual_seed(s.seed),
        )
        _set_or_pop(self.logit_bias, slot, s.logit_bias)
        words = s.bad_words_token_ids or []
        _set_or_pop(self.static_bans, slot, [w[0] for w in words if len(w) == 1])
        _set_or_pop(self.bad_word_seqs, slot, [list(w) for w in words if len(w) > 1])
        stop_ids: dict[int, StopCode] = {}
        if s.max_tokens != 0:  # with max_tokens 0 the sampled token is no output: it ends by length
            stop_ids = dict.fromkeys(s.stop_token_ids, StopCode.STOP_TOKEN)
            stop_ids.update(dict.fromkeys(s.eos_token_ids, StopCode.EOS))  # an id in both counts as EOS
        _set_or_pop(self.stop_ids, slot, stop_ids)

    def sparse_entries(self) -> dict[str, tuple[np.ndarray, ...]]:
        """Per-slot token lists flattened to (slots, token ids[, values]) arrays.

        ``logit_bias``: (slots, tokens, float32 biases); ``static_bans``: (slots, tokens);
        ``stop_ids``: (slots, tokens, int32 stop codes). Rebuilt only when a request joins or
        leaves; each step then selects its rows from these arrays with vectorised indexing.
        """
        if self._sparse is None:
            self._sparse = {
                "logit_bias": _flatten(self.logit_bias, np.float32),
                "static_bans": _flatten(self.static_bans),
                "stop_ids": _flatten(self.stop_ids, np.int32),
            }
        return self._sparse

    def rows_of(self, slots: np.ndarray) -> np.ndarray:
        """``[max_num_reqs]`` int64: the row of each slot in ``slots`` order, -1 for slots not in it."""
        rows = np.full(self.max_num_reqs, -1, dtype=np.int64)
        rows[slots] = np.arange(len(slots))
        return rows

    def per_composition(self, name: str, slots: np.ndarray, build: Callable[[], Any]) -> Any:
        """``build()``'s value, reused until a request joins or leaves or the rows change order:
        per-row device tensors need building only once per batch composition."""
        key = (self.version, slots.tobytes())
        cached = self._composition_cache.get(name)
        if cached is None or cached[0] != key:
            cached = (key, build())
            self._composition_cache[name] = cached
        return cached[1]

    def append_token(self, slot: int, token_id: int) -> None:
        n = self.num_tokens[slot]
        if n < self.max_model_len:
            self.token_ids[slot, n] = token_id
        self.num_tokens[slot] = n + 1


def _set_or_pop(per_slot: dict[int, Any], slot: int, value: Any) -> None:
    """``per_slot[slot] = value``, or no entry for ``slot`` when ``value`` is empty or None."""
    if value:
        per_slot[slot] = value
    else:
        per_slot.pop(slot, None)


def _flatten(per_slot: dict[int, Any], value_dtype: type | None = None) -> tuple[np.ndarray, ...]:
    """``{slot: [token, ...]}`` → flat (slots, tokens) arrays; ``{slot: {token: value}}`` with a
    ``value_dtype`` → (slots, tokens, values)."""
    slots = np.array([s for s, items in per_slot.items() for _ in items], np.int64)
    tokens = np.array([t for items in per_slot.values() for t in items], np.int64)
    if value_dtype is None:
        return slots, tokens
    values = np.array([v for items in per_slot.values() for v in items.values()], value_dtype)
    return slots, tokens, values
