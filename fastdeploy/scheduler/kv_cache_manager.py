"""Per-request KV cache allocation on top of the block pool, with prefix caching."""

from __future__ import annotations

from fastdeploy.core.request import Request
from fastdeploy.scheduler.block_hash import extend_block_hashes, root_hash
from fastdeploy.scheduler.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives each request the blocks its tokens need and caches full blocks by content.

    Counters ``prefix_cache_queries`` / ``prefix_cache_hits`` count prompt tokens
    looked up and found; the scheduler reports and resets them each step.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold).

        At least one token is always left to compute, so the step still produces
        logits for the next token. A request that still needs prompt logprobs, or
        mean-pools its prompt, gets no hits (as in vLLM): every prompt position must
        go through the model. Its full blocks are still cached for others.
        """
        if not self.enable_caching or request.needs_every_prompt_position:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed_blocks`` are prefix-cache hits to attach first (only for a
        request being admitted). Returns the newly allocated blocks, or None —
        changing nothing — when the pool cannot supply them.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if not computed_blocks:  # the common decode step: its blocks usually have room already
            total_tokens = request.num_computed_tokens + num_new_tokens
            if total_tokens <= len(blocks) * self.block_size:
                # (a block fills once every block_size decodes: only then is there one to cache)
                known = min(total_tokens, len(request.all_token_ids))
                if self.enable_caching and known // self.block_size > self._num_cached_blocks.get(
                    request.request_id, 0
                ):
                    self._cache_full_blocks(request, blocks, known)
                return []
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = cdiv(total_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - revived:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:  # only blocks whose tokens are all known (async: not placeholders)
            self._cache_full_blocks(request, blocks, min(total_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request, num_full * self.block_size)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        if len(request.block_hashes) < num_tokens // self.block_size:
            extend_block_hashes(
                request.block_hashes,
                request.all_token_ids[:num_tokens],
                self.block_size,
                request.mm_extra_keys,
                root_hash(request.sampling_params.cache_salt if request.sampling_params else None),
            )

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so heads stay cached longest)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
