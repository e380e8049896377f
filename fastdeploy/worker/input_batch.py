"""The persistent batch: per-slot request state kept across steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastdeploy.scheduler.output import NewRequestData
from fastdeploy.worker.block_table import BlockTable


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
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.max_tokens = np.full(max_num_reqs, np.iinfo(np.int64).max, dtype=np.int64)
        """Output tokens allowed per slot (no limit: int64 max)."""
        self.stop_ids: dict[int, list[int]] = {}
        """Slot → token ids that stop it once ``min_tokens`` are out (EOS unless ignored, stop_token_ids)."""
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """Top logprobs wanted per token; -1: no logprobs."""
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """Top logprobs wanted per prompt token; -1: no prompt logprobs."""
        self.logit_bias: dict[int, dict[int, float]] = {}
        self.min_tokens_stop_ids: dict[int, list[int]] = {}
        """Slot → EOS and stop token ids to suppress until ``min_tokens`` outputs exist."""
        self.static_bans: dict[int, list[int]] = {}
        """Slot → single-token bad words (always banned)."""
        self.bad_word_seqs: dict[int, list[list[int]]] = {}
        """Slot → multi-token bad words (banned when the preceding output tokens match)."""
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
        s = req.sampling
        self.temperature[slot] = s["temperature"]
        self.top_p[slot] = s["top_p"]
        self.top_k[slot] = s["top_k"] if s["top_k"] > 0 else 0
        self.min_p[slot] = s["min_p"]
        if s.get("seed") is not None:
            self.generators[slot] = torch.Generator(device=self.device).manual_seed(s["seed"])
        self.repetition_penalty[slot] = s.get("repetition_penalty", 1.0)
        self.presence_penalty[slot] = s.get("presence_penalty", 0.0)
        self.frequency_penalty[slot] = s.get("frequency_penalty", 0.0)
        self.min_tokens[slot] = s.get("min_tokens", 0)
        if s.get("max_tokens") is not None:
            self.max_tokens[slot] = s["max_tokens"]
        if s.get("stop_ids"):
            self.stop_ids[slot] = list(s["stop_ids"])
        self.num_logprobs[slot] = -1 if s.get("logprobs") is None else s["logprobs"]
        self.num_prompt_logprobs[slot] = -1 if s.get("prompt_logprobs") is None else s["prompt_logprobs"]
        if s.get("logit_bias"):
            self.logit_bias[slot] = {int(k): float(v) for k, v in s["logit_bias"].items()}
        if s.get("min_tokens", 0) > 0 and s.get("min_tokens_stop_ids"):
            self.min_tokens_stop_ids[slot] = list(s["min_tokens_stop_ids"])
        words = s.get("bad_words_token_ids") or []
        if singles := [w[0] for w in words if len(w) == 1]:
            self.static_bans[slot] = singles
        if multi := [list(w) for w in words if len(w) > 1]:
            self.bad_word_seqs[slot] = multi
        self._sparse = None
        self.version += 1
        return slot

    def remove_request(self, req_id: str) -> None:
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is None:
            return
        self.req_ids[slot] = None
        self.block_table.clear_row(slot)
        self.generators.pop(slot, None)
        self.repetition_penalty[slot] = 1.0
        self.presence_penalty[slot] = self.frequency_penalty[slot] = 0.0
        self.min_tokens[slot] = 0
        self.max_tokens[slot] = np.iinfo(np.int64).max
        self.num_logprobs[slot] = -1
        self.num_prompt_logprobs[slot] = -1
        for per_slot in (
            self.logit_bias,
            self.min_tokens_stop_ids,
            self.static_bans,
            self.bad_word_seqs,
            self.stop_ids,
        ):
            per_slot.pop(slot, None)
        self._sparse = None
        self.version += 1
        self._free_slots.append(slot)

    def sparse_entries(self) -> dict[str, tuple[np.ndarray, ...]]:
        """Per-slot token lists flattened to (slots, token ids[, values]) arrays.

        Rebuilt only when a request joins or leaves; each step then selects its
        rows from these arrays with vectorised indexing.
        """
        if self._sparse is None:
            self._sparse = {
                "logit_bias": _flatten({s: list(b.items()) for s, b in self.logit_bias.items()}, pairs=True),
                "min_tokens": _flatten(self.min_tokens_stop_ids),
                "static_bans": _flatten(self.static_bans),
                "stop_ids": _flatten(self.stop_ids),
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


def _flatten(per_slot: dict[int, list], pairs: bool = False) -> tuple[np.ndarray, ...]:
    """``{slot: [token, ...]}`` (or ``[(token, value), ...]``) → flat slot / token (/ value) arrays."""
    slots = [s for s, items in per_slot.items() for _ in items]
    if pairs:
        tokens = [t for items in per_slot.values() for t, _ in items]
        values = [v for items in per_slot.values() for _, v in items]
        return (np.array(slots, np.int64), np.array(tokens, np.int64), np.array(values, np.float32))
    tokens = [t for items in per_slot.values() for t in items]
    return (np.array(slots, np.int64), np.array(tokens, np.int64))
