"""Send each multimodal feature tensor from the front end to the engine core once.

Both processes keep a :class:`FeatureMirror`: an LRU of content hashes within a
byte budget, updated by the same operations in the same order (the front end
when it sends a request, the engine core when it receives it; one ZMQ socket
keeps the order). An item whose hash the front end's mirror holds is sent
without its features, and the engine core's mirror, in the same state, holds
the tensor. Requests keep their own reference to their tensors, so an eviction
never takes features from a request that has them.

With data parallelism every engine core has its own mirror, and so the front end
keeps one per engine core (``AsyncLLM``): a feature sent to rank 0 is not held by
rank 1, and each pair sees the requests of its own socket in order.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from fastdeploy.core.mm_item import MMItem
from fastdeploy.multimodal.encoder_cache import GIB


class FeatureMirror:
    """The shared LRU state; the engine core's side also stores the tensors."""

    def __init__(self, budget_gib: float):
        self.budget_bytes = int(budget_gib * GIB)
        self._entries: OrderedDict[str, tuple[int, torch.Tensor | None]] = OrderedDict()
        self._used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _admit(self, mm_hash: str, nbytes: int, features: torch.Tensor | None) -> None:
        """Record a newly seen item, evicting least recently used ones (nothing if it cannot fit)."""
        if nbytes > self.budget_bytes:
            return
        while self._used + nbytes > self.budget_bytes:
            _, (evicted, _) = self._entries.popitem(last=False)
            self._used -= evicted
        self._entries[mm_hash] = (nbytes, features)
        self._used += nbytes

    def strip(self, wires: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Front end: the items to send, without the features the engine core already holds."""
        if not wires:
            return wires
        out = []
        for wire in wires:
            if wire["mm_hash"] in self._entries:
                self._entries.move_to_end(wire["mm_hash"])
                wire = {**wire, "features": None}
            else:
                self._admit(wire["mm_hash"], len(wire["features"]["data"]), None)
            out.append(wire)
        return out

    def resolve(self, wires: list[dict[str, Any]] | None) -> list[MMItem]:
        """Engine core: the received items with features, from the request or from this mirror."""
        items = []
        for wire in wires or []:
            mm_hash = wire["mm_hash"]
            if wire.get("features") is None:
                entry = self._entries.get(mm_hash)
                if entry is None or entry[1] is None:  # a refused request, never an engine crash
                    raise ValueError(
                        f"multimodal item {mm_hash[:16]} arrived without features the engine lacks"
                    )
                self._entries.move_to_end(mm_hash)
                item = MMItem.from_wire(wire)
                item.features = entry[1]
            elif mm_hash in self._entries:  # sent again (the sender's mirror had evicted it)
                self._entries.move_to_end(mm_hash)
                item = MMItem.from_wire(wire)
            else:
                item = MMItem.from_wire(wire)
                self._admit(mm_hash, len(wire["features"]["data"]), item.features)
            items.append(item)
        return items
