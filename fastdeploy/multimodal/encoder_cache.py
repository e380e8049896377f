"""Encoder cache: multimodal features keyed by content hash, within a byte budget.

An image or video seen before (same ``mm_hash``) is served from here instead of
being fetched and encoded again. Entries are evicted least-recently-used first
when a new one needs room; entries pinned by running requests are never evicted
(a request pins the items it still has to prefill and releases them when it
finishes). A URL index maps the source of an item (its URL) to the hash of what
was fetched from it, so a repeated URL is not even downloaded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

GIB = 1 << 30


@dataclass
class _Entry:
    features: torch.Tensor
    nbytes: int
    pinned_by: set[str] = field(default_factory=set)
    """Request ids that hold this entry."""
    sources: set[str] = field(default_factory=set)
    """URL-index keys that point at this entry (dropped with it)."""


def tensor_nbytes(features: torch.Tensor) -> int:
    """Bytes a tensor's elements take."""
    return features.numel() * features.element_size()


class EncoderCacheManager:
    """LRU cache of feature tensors keyed by ``mm_hash``, holding at most ``budget_bytes``.

    Thread-safe: the feature fetcher and the scheduler may use it from
    different threads. ``hits``/``misses`` count :meth:`get` lookups;
    :meth:`take_stats` returns them per interval, for metrics.
    """

    def __init__(self, budget_bytes: int, track_evictions: bool = False):
        if budget_bytes < 0:
            raise ValueError(f"encoder cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._sources: dict[str, str] = {}
        self._pins: dict[str, set[str]] = {}  # request id -> pinned hashes
        self._bytes_used = 0
        self._lock = threading.RLock()
        self.hits = 0
        self.misses = 0
        self._reported = (0, 0)
        self._evicted: list[str] | None = [] if track_evictions else None
        """Hashes evicted since :meth:`take_evicted` (only with ``track_evictions``)."""

    @classmethod
    def from_gib(cls, gib: float) -> EncoderCacheManager:
        """A cache whose budget is ``gib`` GiB (``CacheConfig.encoder_cache_memory``)."""
        return cls(int(gib * GIB))

    @property
    def bytes_used(self) -> int:
        """Bytes of the tensors now cached."""
        return self._bytes_used

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, mm_hash: str) -> bool:
        """Whether ``mm_hash`` is cached (does not count as a lookup or touch the LRU order)."""
        with self._lock:
            return mm_hash in self._entries

    def get(self, mm_hash: str) -> torch.Tensor | None:
        """The cached features of ``mm_hash`` (now most recently used), or None; counts a hit or miss."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(mm_hash)
            return entry.features

    def lookup_source(self, source: str) -> str | None:
        """The ``mm_hash`` last fetched from ``source`` (a URL key) if it is still cached, else None."""
        with self._lock:
            return self._sources.get(source)

    def put(self, mm_hash: str, features: torch.Tensor, source: str | None = None) -> bool:
        """Cache ``features`` under ``mm_hash``, evicting unpinned LRU entries to make room.

        Returns False when it cannot fit (larger than the budget, or the rest is
        pinned); the caller still uses its tensor, it just is not kept. ``source``
        (a URL key) is recorded in the URL index.
        """
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None:
                nbytes = tensor_nbytes(features)
                if not self._make_room(nbytes):
                    return False
                entry = self._entries[mm_hash] = _Entry(features, nbytes)
                self._bytes_used += nbytes
            self._entries.move_to_end(mm_hash)
            if source is not None:
                old = self._sources.get(source)
                if old is not None and old != mm_hash and old in self._entries:
                    self._entries[old].sources.discard(source)
                self._sources[source] = mm_hash
                entry.sources.add(source)
            return True

    def _make_room(self, nbytes: int) -> bool:
        """Evict LRU unpinned entries until ``nbytes`` more fit; evict nothing if they never can."""
        free = self.budget_bytes - self._bytes_used
        if nbytes <= free:
            return True
        evictable = [h for h, e in self._entries.items() if not e.pinned_by]
        if free + sum(self._entries[h].nbytes for h in evictable) < nbytes:
            return False
        for mm_hash in evictable:
            if nbytes <= self.budget_bytes - self._bytes_used:
                break
            self._evict(mm_hash)
        return True

    def _evict(self, mm_hash: str) -> None:
        entry = self._entries.pop(mm_hash)
        self._bytes_used -= entry.nbytes
        if self._evicted is not None:
            self._evicted.append(mm_hash)
        for source in entry.sources:
            if self._sources.get(source) == mm_hash:
                del self._sources[source]

    def pin(self, request_id: str, mm_hash: str) -> bool:
        """Keep ``mm_hash`` from eviction until :meth:`release` of ``request_id``; False if not cached."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None:
                return False
            entry.pinned_by.add(request_id)
            self._pins.setdefault(request_id, set()).add(mm_hash)
            return True

    def is_pinned(self, mm_hash: str) -> bool:
        """Whether a running request holds ``mm_hash``."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            return entry is not None and bool(entry.pinned_by)

    def release(self, request_id: str) -> None:
        """Drop every pin of ``request_id`` (call when the request finishes or is aborted)."""
        with self._lock:
            for mm_hash in self._pins.pop(request_id, ()):
                entry = self._entries.get(mm_hash)
                if entry is not None:
                    entry.pinned_by.discard(request_id)

    def take_evicted(self) -> list[str]:
        """Hashes evicted since the previous call (needs ``track_evictions``): whoever mirrors
        this cache (the worker's feature store) drops them too."""
        with self._lock:
            if self._evicted is None:
                raise RuntimeError("this cache was created without track_evictions")
            evicted, self._evicted = self._evicted, []
            return evicted

    def take_stats(self) -> tuple[int, int]:
        """``(hits, misses)`` since the previous call (per-interval counters for metrics)."""
        with self._lock:
            hits, misses = self.hits - self._reported[0], self.misses - self._reported[1]
            self._reported = (self.hits, self.misses)
            return hits, misses
