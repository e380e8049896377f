"""The worker's multimodal state: held features, per-request items and M-RoPE positions.

Per step it turns the scheduled tokens into what a Qwen2-VL style model needs:

- 3-row M-RoPE positions for every token (prompt tokens from the request's
  table, generated tokens at ``index + delta``; text-only requests get three
  equal rows);
- the feature rows that replace placeholder embeddings: only the rows of the
  tokens this step computes, so a prefill chunk that starts or ends inside an
  item (chunked prefill, or a prefix-cache hit that covers part of it) takes
  just its share, and nothing is recomputed;
- optionally (``--mm-bidirectional-attention``) per-token attention limits that
  let the tokens of one item attend to each other (``attn_mask_offsets``).

Features arrive once per content hash (see ``scheduler/encoder_sync.py``) and are
kept while a request uses them or the engine core's encoder cache lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fastdeploy.core.mm_item import MMItem
from fastdeploy.core.step_io import NewRequestData
from fastdeploy.multimodal.positions import mrope_positions
from fastdeploy.transformers_utils.config import MultimodalArchConfig


@dataclass
class _Held:
    features: torch.Tensor
    users: set[str] = field(default_factory=set)
    cached: bool = False
    """Listed by the engine core's encoder cache: kept after its users finish, until evicted."""


class FeatureStore:
    """Feature tensors by ``mm_hash``: alive while used by a request or cached."""

    def __init__(self) -> None:
        self.entries: dict[str, _Held] = {}

    def add(self, mm_hash: str, features: torch.Tensor | None, cached: bool, user: str) -> torch.Tensor:
        """Register ``user`` of ``mm_hash`` (storing ``features`` if sent) and return the tensor."""
        entry = self.entries.get(mm_hash)
        if features is not None:
            if entry is None:
                entry = self.entries[mm_hash] = _Held(features)
            entry.features = features
        elif entry is None:
            raise RuntimeError(f"the worker holds no features for multimodal item {mm_hash[:16]}")
        entry.cached = entry.cached or cached
        entry.users.add(user)
        return entry.features

    def release(self, user: str, mm_hashes: list[str]) -> None:
        """``user`` finished: drop entries nobody uses that are not cached."""
        for mm_hash in mm_hashes:
            entry = self.entries.get(mm_hash)
            if entry is not None:
                entry.users.discard(user)
                if not entry.users and not entry.cached:
                    del self.entries[mm_hash]

    def evict(self, mm_hashes: list[str]) -> None:
        """The engine core evicted these: no longer cached; dropped once unused."""
        for mm_hash in mm_hashes:
            entry = self.entries.get(mm_hash)
            if entry is not None:
                entry.cached = False
                if not entry.users:
                    del self.entries[mm_hash]


@dataclass
class MMStepInputs:
    """Multimodal inputs of one step."""

    positions: np.ndarray
    """[3, T] int64 M-RoPE positions."""
    embed_index: np.ndarray
    """Flat token indices whose embeddings are replaced by feature rows."""
    embed_rows: list[torch.Tensor]
    """The feature rows, concatenated in the order of ``embed_index``."""
    mask_offsets: np.ndarray | None
    """[T] int32 exclusive key limits, or None (causal)."""


class MultimodalBatchState:
    """Multimodal items and positions of the requests in the persistent batch."""

    def __init__(
        self, mm: MultimodalArchConfig, device: torch.device, dtype: torch.dtype, bidirectional: bool = False
    ):
        self.mm = mm
        self.device = device
        self.dtype = dtype
        self.bidirectional = bidirectional
        self.store = FeatureStore()
        self.items: dict[str, list[MMItem]] = {}
        self.mrope: dict[str, tuple[np.ndarray, int]] = {}
        """req_id → (prompt positions [3, P], delta); text-only requests have no entry."""

    def add_request(self, req: NewRequestData) -> None:
        """Take a new request's items (storing the features sent with it) and compute its positions."""
        if not req.mm_items:
            return
        items = []
        for wire in req.mm_items:
            item = MMItem.from_wire(wire)
            features = None
            if item.features is not None:
                features = item.features.to(device=self.device, dtype=self.dtype)
            item.features = self.store.add(item.mm_hash, features, bool(wire.get("cached")), req.req_id)
            items.append(item)
        self.items[req.req_id] = items
        table, delta = mrope_positions(
            req.num_prompt_tokens, items, self.mm.spatial_merge_size, self.mm.tokens_per_second
        )
        self.mrope[req.req_id] = (table, delta)

    def remove_request(self, req_id: str) -> None:
        """The request finished or was preempted: release its features."""
        items = self.items.pop(req_id, None)
        self.mrope.pop(req_id, None)
        if items:
            self.store.release(req_id, [item.mm_hash for item in items])

    def evict(self, mm_hashes: list[str]) -> None:
        """Apply the engine core's encoder cache evictions."""
        self.store.evict(mm_hashes)

    def prepare(self, req_ids: list[str], counts: np.ndarray, positions: np.ndarray) -> MMStepInputs:
        """Inputs of a step whose requests ``req_ids`` compute ``counts`` tokens each at ``positions``.

        ``positions`` are the flattened tokens' absolute indices in their sequences
        (each request's tokens consecutive, requests in ``req_ids`` order).
        """
        total = len(positions)
        rope = np.broadcast_to(positions, (3, total)).copy()
        limits = positions + 1 if self.bidirectional else None
        embed_index: list[np.ndarray] = []
        embed_rows: list[torch.Tensor] = []
        base = 0
        for req_id, count in zip(req_ids, counts.tolist()):
            entry = self.mrope.get(req_id)
            if entry is not None:
                start, end = int(positions[base]), int(positions[base]) + count
                table, delta = entry
                cols = rope[:, base : base + count]
                in_prompt = min(max(table.shape[1] - start, 0), count)
                cols[:, :in_prompt] = table[:, start : start + in_prompt]
                cols[:, in_prompt:] += delta
                for item in self.items[req_id]:
                    first, last = max(start, item.offset), min(end, item.end)
                    if first >= last:
                        continue
                    index = np.arange(first - start, last - start) + base
                    embed_index.append(index)
                    assert item.features is not None
                    embed_rows.append(item.features[first - item.offset : last - item.offset])
                    if limits is not None:
                        limits[index] = item.end
            base += count
        index_array = np.concatenate(embed_index) if embed_index else np.zeros(0, dtype=np.int64)
        mask = None
        if limits is not None and embed_index:
            mask = limits.astype(np.int32)
        return MMStepInputs(rope, index_array, embed_rows, mask)

    def inputs_embeds(
        self, model: torch.nn.Module, input_ids: torch.Tensor, step: MMStepInputs
    ) -> torch.Tensor | None:
        """Token embeddings with this step's feature rows scattered in, or None when it has none."""
        if not step.embed_rows:
            return None
        embeds = model.embed_input_ids(input_ids)
        index = torch.from_numpy(step.embed_index).to(embeds.device)
        embeds[index] = torch.cat(step.embed_rows).to(embeds.dtype)
        return embeds
