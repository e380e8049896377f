"""Data-parallel routing: which engine core (rank) serves each new request.

:func:`choose_rank` is the least-loaded choice; :class:`Router` adds the bookkeeping
(who owns which request, for aborts) and prefix-aware routing; :class:`SharedRankLoads` lets
several API server processes balance together.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class RankLoad:
    """What the API server knows of one data-parallel rank's load."""

    num_requests: int = 0
    """Engine requests (sequences) routed to the rank and not finished yet, counted here."""
    kv_cache_usage: float = 0.0
    """The fraction of its KV cache the rank last reported in use (0 to 1)."""


def choose_rank(loads: Sequence[RankLoad]) -> int:
    """The rank for a new request: the fewest unfinished requests, then the least KV cache in use, then
    the lowest rank (so that equal ranks are chosen the same way every time)."""
    return min(
        range(len(loads)), key=lambda rank: (loads[rank].num_requests, loads[rank].kv_cache_usage, rank)
    )


class SharedRankLoads:
    """Every API server's count of unfinished requests per rank, in one small file all of them map.

    Each API server writes only its own row and reads the column sums, so a request goes to the
    rank with the fewest unfinished requests across all API servers. Balanced alone, each API
    server split its own requests evenly, but the odd one of each went to the same rank (ties go to
    the lowest), and a burst of exactly ``ranks x max_num_seqs`` requests left one request waiting
    for a whole generation (docs/benchmarks.md, fifteenth session). Reads are not synchronised
    with other processes' writes: a count may be a request behind, which routing tolerates.
    """

    def __init__(self, path: str, num_clients: int, client_index: int, num_ranks: int):
        size = num_clients * num_ranks * 8
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # (every API server may get here first: same size)
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.table = np.frombuffer(self._map, dtype=np.int64).reshape(num_clients, num_ranks)
        """[API server, rank] unfinished requests (zero-filled when the file is created)."""
        self.client_index = client_index

    def publish(self, loads: Sequence[RankLoad]) -> None:
        """Write this API server's counts."""
        self.table[self.client_index] = [load.num_requests for load in loads]

    def totals(self) -> list[int]:
        """Unfinished requests per rank, over all API servers."""
        return self.table.sum(axis=0).tolist()

    def close(self) -> None:
        del self.table
        self._map.close()


PREFIX_ROUTING_SLACK = 2
"""A request whose prompt prefix a rank served last goes to that rank (its prefix cache likely holds
the prefix) unless the rank has more than this many unfinished requests over the least-loaded one."""
PREFIX_ROUTING_ENTRIES = 1 << 16
"""Prompt blocks the router remembers (least recently routed forgotten first), each with its rank."""
PREFIX_ROUTING_MAX_BLOCKS = 256
"""Leading blocks of a prompt the router hashes (bounds its work per request on the event loop)."""


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """A hash per full block of ``token_ids``, each of the whole prefix up to the block's end (as the
    engine's prefix cache hashes blocks), so prompts with a common prefix share their leading hashes."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Route:
    """Where one request went: its rank and how many engine requests (``n`` choices) it added there."""

    rank: int
    num_requests: int


class Router:
    """Sends each new request to the least-loaded data-parallel rank and remembers which rank owns it.

    With ``prefix_block_size`` (prefix caching on, several ranks) a prompt whose longest known
    prefix a rank served last goes to that rank instead, unless the rank is more than
    :data:`PREFIX_ROUTING_SLACK` requests busier than the least-loaded one. Aborts go to the
    owning rank; :meth:`release` (when the request has finished, failed or been aborted)
    forgets it and takes its load off the rank.
    """

    def __init__(
        self, num_ranks: int, prefix_block_size: int | None = None, shared: SharedRankLoads | None = None
    ):
        self.loads = [RankLoad() for _ in range(num_ranks)]
        """This API server's own requests per rank."""
        self.shared = shared
        """The other API servers' counts too (several API server processes), else None."""
        self._routes: dict[str, Route] = {}
        self._prefix_block_size = prefix_block_size if num_ranks > 1 else None
        self._prefix_owners: OrderedDict[int, int] = OrderedDict()
        """Prefix block hash → the rank that last served a prompt with that prefix."""

    def __len__(self) -> int:
        """Requests routed and not yet released."""
        return len(self._routes)

    def route(self, request_id: str, num_requests: int, prompt_token_ids: Sequence[int] = ()) -> Route:
        """Choose the rank for a request of ``num_requests`` engine requests and count them there."""
        loads = self._global_loads()
        rank = choose_rank(loads)
        if self._prefix_block_size:
            size = self._prefix_block_size
            hashes = prefix_block_hashes(prompt_token_ids[: PREFIX_ROUTING_MAX_BLOCKS * size], size)
            owner = self._owner_of_longest_prefix(hashes)
            if owner is not None and (
                loads[owner].num_requests <= loads[rank].num_requests + PREFIX_ROUTING_SLACK
            ):
                rank = owner
            self._remember(hashes, rank)
        route = Route(rank, num_requests)
        self.loads[rank].num_requests += num_requests
        self._routes[request_id] = route
        if self.shared is not None:
            self.shared.publish(self.loads)
        return route

    def _global_loads(self) -> list[RankLoad]:
        """The loads to choose by: this API server's, or with :attr:`shared` every API server's
        request counts (the KV-cache usage is the one this API server last heard of)."""
        if self.shared is None:
            return self.loads
        totals = self.shared.totals()
        return [RankLoad(total, load.kv_cache_usage) for total, load in zip(totals, self.loads)]

    def _owner_of_longest_prefix(self, hashes: list[int]) -> int | None:
        owner = None
        for block_hash in hashes:
            rank = self._prefix_owners.get(block_hash)
            if rank is None:
                break
            owner = rank
        return owner

    def _remember(self, hashes: list[int], rank: int) -> None:
        for block_hash in hashes:
            self._prefix_owners[block_hash] = rank
            self._prefix_owners.move_to_end(block_hash)
        while len(self._prefix_owners) > PREFIX_ROUTING_ENTRIES:
            self._prefix_owners.popitem(last=False)

    def rank_of(self, request_id: str) -> int | None:
        """The rank that owns an unreleased request, else None."""
        route = self._routes.get(request_id)
        return None if route is None else route.rank

    def release(self, request_id: str, route: Route) -> None:
        """The request is over: take its load off its rank and forget it (once per :meth:`route`)."""
        self.loads[route.rank].num_requests -= route.num_requests
        if self._routes.get(request_id) is route:  # not a later request that reused the id
            del self._routes[request_id]
        if self.shared is not None:
            self.shared.publish(self.loads)

    def on_kv_cache_usage(self, rank: int, usage: float) -> None:
        """Record the KV-cache usage a rank reported (the tie-break between equally loaded ranks)."""
        self.loads[rank].kv_cache_usage = usage
