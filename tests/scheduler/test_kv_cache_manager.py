"""KVCacheManager: per-request allocation, prefix caching, hash chaining and counters."""

from __future__ import annotations

import random

import pytest

from fastdeploy.core.request import EngineCoreRequest, Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.scheduler.block_hash import ROOT_HASH, hash_block
from fastdeploy.scheduler.kv_cache_manager import KVCacheManager

BS = 16
VOCAB = 32000


def make_request(req_id: str, token_ids: list[int], block_size: int = BS) -> Request:
    core = EngineCoreRequest(
        req_id, list(token_ids), SamplingParams(temperature=0, max_tokens=64), eos_token_ids=[2]
    )
    return Request(core, block_size)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None):
    """What the scheduler does for a waiting request: look up hits, allocate, advance."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit_tokens
    new = kv.allocate_slots(request, num_new, hits)
    if new is not None:
        request.num_computed_tokens = num_hit_tokens + num_new
    return hits, num_hit_tokens, new


def test_prefill_and_decode_block_counts():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    req = make_request("a", rand_tokens(rng, 37))
    _, hit_tokens, new = admit(kv, req)
    assert hit_tokens == 0
    assert len(new) == 3  # ceil(37 / 16)
    assert kv.num_free_blocks == 7
    # decode: tokens 38..48 fit the third block; the 49th needs a fourth
    for step in range(12):
        req.append_output_token(rng.randrange(3, VOCAB))
        new = kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        expected_new = 1 if req.num_tokens == 49 else 0
        assert len(new) == expected_new, (step, req.num_tokens)
    assert len(kv.block_ids("a")) == 4
    assert kv.num_free_blocks == 6
    kv.free(req)
    assert kv.num_free_blocks == 10 and kv.pool.num_used_blocks == 0
    assert kv.block_ids("a") == []


def test_chunked_prefill_allocates_incrementally():
    rng = random.Random(1)
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    req = make_request("a", rand_tokens(rng, 70))
    sizes = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(20, req.num_tokens - req.num_computed_tokens)
        new = kv.allocate_slots(req, n)
        req.num_computed_tokens += n
        sizes.append(len(new))
    # computed 20, 40, 60, 70 tokens → 2, 3, 4, 5 blocks in total
    assert sizes == [2, 1, 1, 1]
    assert len(kv.block_ids("a")) == 5


def test_prefix_sharing_between_requests():
    rng = random.Random(2)
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_caching=True)
    prefix = rand_tokens(rng, 2 * BS + 5)
    a = make_request("a", prefix + rand_tokens(rng, 9))
    b = make_request("b", prefix + rand_tokens(rng, 11))
    admit(kv, a)
    a_blocks = kv.req_to_blocks["a"]
    free_before = kv.num_free_blocks
    hits, hit_tokens, new = admit(kv, b)
    assert hit_tokens == 2 * BS
    assert hits == a_blocks[:2]
    assert kv.req_to_blocks["b"][:2] == a_blocks[:2]
    assert all(blk.ref_cnt == 2 for blk in a_blocks[:2])
    assert a_blocks[2].ref_cnt == 1  # the partial third block is not shared
    assert kv.req_to_blocks["b"][2] is not a_blocks[2]
    # b has 2*16+5+11 = 48 tokens → 3 blocks, 2 of them shared
    assert len(new) == 1 and kv.num_free_blocks == free_before - 1
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in a_blocks[:2])
    kv.free(b)
    assert kv.num_free_blocks == 12 and kv.pool.num_used_blocks == 0


def test_freed_prefix_is_revived_from_free_queue():
    rng = random.Random(3)
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    tokens = rand_tokens(rng, 3 * BS + 1)
    a = make_request("a", tokens)
    admit(kv, a)
    a_blocks = list(kv.req_to_blocks["a"])
    kv.free(a)
    assert kv.pool.num_used_blocks == 0
    b = make_request("b", tokens)
    hits, hit_tokens, _ = admit(kv, b)
    assert hit_tokens == 3 * BS
    assert hits == a_blocks[:3]
    assert all(blk.ref_cnt == 1 for blk in hits)
    kv.free(b)
    assert kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("num_blocks_of_prompt", [1, 2, 3])
def test_hits_leave_at_least_one_token_to_compute(num_blocks_of_prompt):
    rng = random.Random(4)
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    tokens = rand_tokens(rng, num_blocks_of_prompt * BS)  # exactly full blocks
    a = make_request("a", tokens)
    admit(kv, a)
    b = make_request("b", tokens)
    hits, hit_tokens, new = admit(kv, b)
    assert hit_tokens == (num_blocks_of_prompt - 1) * BS
    assert len(hits) == num_blocks_of_prompt - 1
    assert hit_tokens < b.num_tokens
    # the last block is recomputed into a new block of its own
    assert len(new) == 1
    assert len(kv.req_to_blocks["b"]) == num_blocks_of_prompt


def test_block_hashes_are_chained():
    rng = random.Random(5)
    shared_block = rand_tokens(rng, BS)
    p1, p2 = rand_tokens(rng, BS), rand_tokens(rng, BS)
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_request("a", p1 + shared_block + [7])
    b = make_request("b", p2 + shared_block + [7])
    admit(kv, a)
    _, hit_tokens, _ = admit(kv, b)
    assert hit_tokens == 0  # same second block, different parent
    assert a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[0] == hash_block(ROOT_HASH, p1)
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], shared_block)
    assert kv.req_to_blocks["a"][1] is not kv.req_to_blocks["b"][1]


def test_hash_block_depends_on_every_input():
    rng = random.Random(6)
    tokens = rand_tokens(rng, BS)
    base = hash_block(ROOT_HASH, tokens)
    assert hash_block(ROOT_HASH, list(tokens)) == base
    changed = list(tokens)
    changed[rng.randrange(BS)] += 1
    assert hash_block(ROOT_HASH, changed) != base
    assert hash_block(b"other-parent", tokens) != base
    assert hash_block(ROOT_HASH, tokens, ("mm-a",)) != base
    assert hash_block(ROOT_HASH, tokens, ("mm-a",)) != hash_block(ROOT_HASH, tokens, ("mm-b",))


def test_extra_keys_separate_equal_tokens_with_different_mm_items():
    rng = random.Random(7)
    tokens = rand_tokens(rng, 3 * BS + 3)
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a = make_request("a", tokens)
    a.mm_extra_keys = [(BS + 2, BS + 10, "image-hash-1")]  # inside block 1
    b = make_request("b", tokens)
    b.mm_extra_keys = [(BS + 2, BS + 10, "image-hash-2")]
    c = make_request("c", tokens)
    c.mm_extra_keys = [(BS + 2, BS + 10, "image-hash-1")]
    admit(kv, a)
    _, hit_b, _ = admit(kv, b)
    assert hit_b == BS  # block 0 has no image; block 1 differs, so the chain stops
    assert a.block_hashes[0] == b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[2] != b.block_hashes[2]  # chained through block 1
    _, hit_c, _ = admit(kv, c)
    assert hit_c == 3 * BS  # same image: full reuse
    assert kv.req_to_blocks["c"][:3] == kv.req_to_blocks["a"][:3]


def test_prefix_cache_counters():
    rng = random.Random(8)
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    prefix = rand_tokens(rng, 2 * BS)
    a = make_request("a", prefix + rand_tokens(rng, 4))
    b = make_request("b", prefix + rand_tokens(rng, 6))
    admit(kv, a)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (a.num_tokens, 0)
    admit(kv, b)
    assert kv.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert kv.prefix_cache_hits == 2 * BS


def test_no_prefix_caching_means_no_hits_and_no_counting():
    rng = random.Random(9)
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    tokens = rand_tokens(rng, 3 * BS)
    a, b = make_request("a", tokens), make_request("b", tokens)
    admit(kv, a)
    _, hit_tokens, _ = admit(kv, b)
    assert hit_tokens == 0
    assert set(kv.block_ids("a")).isdisjoint(kv.block_ids("b"))
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0


def test_allocation_failure_returns_none_and_changes_nothing():
    rng = random.Random(10)
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True)
    prefix = rand_tokens(rng, 2 * BS)
    a = make_request("a", prefix + [5])
    admit(kv, a)  # 3 blocks
    kv.free(a)  # blocks 0,1 stay cached in the free queue
    filler = make_request("filler", rand_tokens(rng, BS))
    admit(kv, filler)  # takes the LRU head: a's partial third block
    assert kv.num_free_blocks == 4
    big = make_request("big", prefix + rand_tokens(rng, 4 * BS))
    hits, hit_tokens = kv.get_computed_blocks(big)
    assert hit_tokens == 2 * BS and all(blk.ref_cnt == 0 for blk in hits)
    snapshot = [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in kv.pool.blocks]
    free_before = kv.num_free_blocks
    # needs 6 blocks, 2 of them revived hits: 4 new ones, but only 2 remain besides the hits
    assert kv.allocate_slots(big, big.num_tokens - hit_tokens, hits) is None
    assert kv.num_free_blocks == free_before
    assert [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in kv.pool.blocks] == snapshot
    assert "big" not in kv.req_to_blocks
    assert kv.block_ids("big") == []
    # a running request that cannot grow keeps its blocks
    grow = kv.allocate_slots(filler, 10 * BS)
    assert grow is None and len(kv.block_ids("filler")) == 1
    kv.free(filler)
    assert kv.num_free_blocks == 5


def test_free_returns_everything_after_random_workload():
    rng = random.Random(11)
    num_blocks = 40
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_caching=True)
    prefixes = [rand_tokens(rng, rng.randint(BS, 3 * BS)) for _ in range(3)]
    live: list[Request] = []
    for i in range(60):
        if live and (rng.random() < 0.4 or kv.num_free_blocks < 6):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            req = make_request(f"r{i}", rng.choice(prefixes) + rand_tokens(rng, rng.randint(1, 20)))
            _, _, new = admit(kv, req)
            if new is not None:
                live.append(req)
        referenced = {blk.block_id for r in live for blk in kv.req_to_blocks[r.request_id]}
        assert kv.pool.num_used_blocks == len(referenced)
    for req in live:
        kv.free(req)
    assert kv.num_free_blocks == num_blocks and kv.pool.num_used_blocks == 0
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.req_to_blocks == {}


def test_free_releases_tail_first():
    rng = random.Random(12)
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request("a", rand_tokens(rng, 3 * BS + 1))
    admit(kv, a)
    ids = kv.block_ids("a")
    assert len(ids) == 4
    kv.free(a)
    # a's blocks join the LRU free queue tail first, so the prefix head is evicted last
    assert [blk.block_id for blk in kv.pool.allocate(4)] == list(reversed(ids))
