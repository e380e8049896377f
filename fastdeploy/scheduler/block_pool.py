"""KV cache blocks: reference counts, an LRU free queue and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of the paged KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    """Set once the block is full and cached; kept after freeing until evicted."""


class BlockPool:
    """Owns every block; hands them out and takes them back.

    Free blocks sit in an LRU queue (least recently freed first). A freed block
    keeps its hash and can be revived by a prefix-cache hit until allocation
    evicts it for new content.
    """

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        """The cached block holding this content, if any (free or in use)."""
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached content."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix-cache hit), reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free queue tail.

        Pass blocks in eviction order: callers give a request's blocks last-first
        so that a prefix's tail is evicted before its head.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than referenced")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Record that ``block`` holds the full content identified by ``block_hash``."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:  # same content computed twice: keep the first copy
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True
