"""BlockPool: allocation, reference counts, the LRU free queue and the prefix-cache map."""

from __future__ import annotations

import random

import pytest

from fastdeploy.scheduler.block_pool import BlockPool


def _hash(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def test_allocate_takes_blocks_in_order_with_ref_count_one():
    pool = BlockPool(8, enable_caching=True)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert pool.usage() == pytest.approx(3 / 8)
    more = pool.allocate(5)
    assert {b.block_id for b in more} == {3, 4, 5, 6, 7}
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4, enable_caching=True)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match="cannot allocate 2 blocks"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)


def test_free_returns_blocks_only_when_unreferenced():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 4


def test_double_free_raises():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_free_queue_is_lru_least_recently_freed_first():
    rng = random.Random(1)
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.allocate(6)
    order = list(range(6))
    rng.shuffle(order)
    for i in order:
        pool.free([blocks[i]])
    again = pool.allocate(6)
    assert [b.block_id for b in again] == order


def test_touch_revives_a_free_cached_block():
    rng = random.Random(2)
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(2)
    h = _hash(rng)
    pool.cache(blocks[1], h)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    hit = pool.lookup(h)
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 3
    # a revived block is no longer in the free queue: allocating the rest never hands it out
    rest = pool.allocate(3)
    assert hit not in rest
    assert pool.lookup(h) is hit and hit.block_hash == h


def test_freed_cached_block_is_evicted_only_when_reallocated():
    rng = random.Random(3)
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.allocate(3)
    hashes = [_hash(rng) for _ in blocks]
    for b, h in zip(blocks, hashes):
        pool.cache(b, h)
    pool.free([blocks[2], blocks[0], blocks[1]])  # LRU order: 2, 0, 1
    assert all(pool.lookup(h) is not None for h in hashes)
    (first,) = pool.allocate(1)
    assert first is blocks[2]
    assert pool.lookup(hashes[2]) is None and first.block_hash is None
    assert pool.lookup(hashes[0]) is blocks[0] and pool.lookup(hashes[1]) is blocks[1]
    (second,) = pool.allocate(1)
    assert second is blocks[0] and pool.lookup(hashes[0]) is None


def test_cache_keeps_first_copy_of_duplicate_content():
    rng = random.Random(4)
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    h = _hash(rng)
    pool.cache(a, h)
    pool.cache(b, h)
    assert pool.lookup(h) is a and b.block_hash is None
    # evicting the duplicate does not remove the first copy's mapping
    pool.free([b])
    pool.allocate(3)
    assert pool.lookup(h) is a


def test_no_caching_when_disabled():
    rng = random.Random(5)
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    h = _hash(rng)
    pool.cache(a, h)
    assert pool.lookup(h) is None and a.block_hash is None


def test_reset_prefix_cache():
    rng = random.Random(6)
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(2)
    hashes = [_hash(rng) for _ in blocks]
    for b, h in zip(blocks, hashes):
        pool.cache(b, h)
    assert pool.reset_prefix_cache() is False  # blocks still in use
    assert pool.lookup(hashes[0]) is blocks[0]
    pool.free(blocks)
    assert pool.reset_prefix_cache() is True
    assert all(pool.lookup(h) is None for h in hashes)
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 4


def test_random_alloc_free_keeps_counts_consistent():
    rng = random.Random(7)
    pool = BlockPool(16, enable_caching=True)
    held: list = []
    for _ in range(300):
        if held and (rng.random() < 0.5 or pool.num_free_blocks == 0):
            block = held.pop(rng.randrange(len(held)))
            pool.free([block])
        elif rng.random() < 0.3 and held:
            block = rng.choice(held)
            pool.touch([block])
            held.append(block)
        else:
            held.extend(pool.allocate(rng.randint(1, min(3, pool.num_free_blocks))))
        distinct = {id(b) for b in held}
        assert pool.num_used_blocks == len(distinct)
        for b in pool.blocks:
            assert b.ref_cnt == sum(1 for x in held if x is b)
    pool.free(held)
    assert pool.num_used_blocks == 0
