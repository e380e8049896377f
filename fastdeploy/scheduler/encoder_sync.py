"""The engine core's record of the multimodal features its worker holds (encoder cache).

The engine core keeps an :class:`EncoderCacheManager` whose entries mirror the
worker's feature store: an item whose ``mm_hash`` is cached there is sent to the
worker without its features (a hit); otherwise the features go with the request
and, if they fit the budget, are cached on both sides (a miss). A running
request pins its items (its own features never leave the worker while it
needs them); pins are released when it finishes. Entries evicted to make room
are reported in the next ``SchedulerOutput`` so that the worker drops them too.

The protocol relies on the worker applying a step's evictions before adding
the step's new requests (see :mod:`fastdeploy.worker.mm_state`).
"""

from __future__ import annotations

from typing import Any

from fastdeploy.core.request import Request
from fastdeploy.multimodal.encoder_cache import GIB, EncoderCacheManager


class WorkerEncoderCache:
    """Decides, per admitted request, which feature tensors are sent to the worker."""

    def __init__(self, budget_gib: float):
        self.cache = EncoderCacheManager(int(budget_gib * GIB), track_evictions=True)

    def items_for_worker(self, request: Request) -> list[dict[str, Any]] | None:
        """The request's items in wire form; features only where the worker lacks them.

        Each dict carries ``cached``: whether the worker keeps the features after
        the request (they are in the engine core's cache) or drops them with it.
        """
        if not request.mm_items:
            return None
        wires = []
        for item in request.mm_items:
            held = self.cache.get(item.mm_hash) is not None  # counts a hit or a miss
            if held:
                self.cache.pin(request.request_id, item.mm_hash)
                wire = item.to_wire(with_features=False)
            else:
                assert item.features is not None, "the engine core holds every live request's features"
                held = self.cache.put(item.mm_hash, item.features)
                if held:
                    self.cache.pin(request.request_id, item.mm_hash)
                wire = item.to_wire()
            wire["cached"] = held
            wires.append(wire)
        return wires

    def release(self, request_id: str) -> None:
        """The request finished: its items may be evicted again."""
        self.cache.release(request_id)

    def take_evicted(self) -> list[str]:
        """Hashes the worker must drop (evicted since the last step)."""
        return self.cache.take_evicted()

    def take_stats(self) -> tuple[int, int]:
        """``(hits, misses)`` since the last call."""
        return self.cache.take_stats()
