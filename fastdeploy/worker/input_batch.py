"""The persistent batch: per-slot request state kept across steps."""

from __future__ import annotations

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
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size), device)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

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
        return slot

    def remove_request(self, req_id: str) -> None:
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is None:
            return
        self.req_ids[slot] = None
        self.block_table.clear_row(slot)
        self.generators.pop(slot, None)
        self._free_slots.append(slot)

    def append_token(self, slot: int, token_id: int) -> None:
        n = self.num_tokens[slot]
        if n < self.max_model_len:
            self.token_ids[slot, n] = token_id
        self.num_tokens[slot] = n + 1
