"""The engine core's encoder cache and the worker's feature store stay in step.

Scheduler outputs are applied to a real worker-side ``MultimodalBatchState``,
which raises when it is told to use features it was never sent.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from worker_stop import worker_output

from fastdeploy.config import EngineConfig
from fastdeploy.core.mm_item import MMItem
from fastdeploy.core.request import EngineCoreRequest, Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.step_io import ModelRunnerOutput
from fastdeploy.scheduler.scheduler import Scheduler
from fastdeploy.transformers_utils.config import MultimodalArchConfig
from fastdeploy.worker.mm_state import MultimodalBatchState

IMG = 90
MM = MultimodalArchConfig(IMG, 91, 92, 93, spatial_merge_size=2, mrope_section=[2, 3, 3])
ROWS, HIDDEN = 4, 8
ITEM_BYTES = ROWS * HIDDEN * 4


def make_scheduler(
    encoder_items: float, num_blocks: int = 64, bidirectional: bool = False, **kw
) -> Scheduler:
    config = EngineConfig.from_kwargs(
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 32),
        encoder_cache_memory=encoder_items * ITEM_BYTES / 2**30,
        mm_bidirectional_attention=bidirectional,
        **kw,
    )
    return Scheduler(config, num_blocks, max_model_len=128)


def features_of(name: str) -> torch.Tensor:
    return torch.full((ROWS, HIDDEN), float(sum(map(ord, name))))


def add(sched: Scheduler, req_id: str, images: list[str], max_tokens: int = 2) -> Request:
    """A prompt ``[1, 2, (IMG x 4, 3) per image]`` with the named images (name = mm_hash)."""
    ids, items = [1, 2], []
    for name in images:
        items.append(MMItem("image", len(ids), ROWS, (1, 2, 8), name, features_of(name)).to_wire())
        ids += [IMG] * ROWS + [3]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = Request(EngineCoreRequest(req_id, ids, params, mm_items=items), sched.block_size)
    sched.add_request(request)
    return request


def step(sched: Scheduler, worker: MultimodalBatchState) -> dict:
    """One scheduler step applied to the worker state, in the runner's order; returns the new requests' wires."""
    so = sched.schedule()
    for req_id in so.finished_req_ids:
        worker.remove_request(req_id)
    worker.evict(so.evicted_mm_hashes)
    for new in so.new_reqs:
        worker.add_request(new)  # raises if the features it needs were never sent
    for req_id in so.num_scheduled_tokens:  # the worker uses exactly the features the request names
        for item in worker.items.get(req_id, []):
            assert torch.equal(item.features, features_of(item.mm_hash))
    sched.update_from_output(worker_output(sched, so, lambda request: 7))
    return {new.req_id: new.mm_items for new in so.new_reqs}


def test_features_are_sent_once_and_evictions_reach_the_worker():
    sched = make_scheduler(encoder_items=1)
    worker = MultimodalBatchState(MM, torch.device("cpu"), torch.float32)
    add(sched, "a", ["cat", "cat"])
    sent = step(sched, worker)["a"]
    assert sent[0]["features"] is not None and sent[0]["cached"]
    assert sent[1]["features"] is None  # the same image twice in one prompt: sent once
    assert sched.make_stats().encoder_cache_hits == 1
    while sched.has_unfinished_requests():
        step(sched, worker)
    assert "cat" in worker.store.entries  # cached after the request

    add(sched, "b", ["cat"])
    assert step(sched, worker)["b"][0]["features"] is None  # a repeated item is not re-sent
    while sched.has_unfinished_requests():
        step(sched, worker)
    add(sched, "c", ["dog"])  # the budget holds one item: cat is evicted, on both sides
    assert step(sched, worker)["c"][0]["cached"]
    assert set(worker.store.entries) == {"dog"}
    stats = sched.make_stats()
    assert (stats.encoder_cache_hits, stats.encoder_cache_misses) == (1, 1)


def test_random_traffic_with_evictions_and_preemptions_keeps_both_sides_in_step():
    rng = random.Random(0)
    sched = make_scheduler(encoder_items=3, num_blocks=8, max_num_batched_tokens=12)
    worker = MultimodalBatchState(MM, torch.device("cpu"), torch.float32)
    pool = [f"img{i}" for i in range(6)]
    for i in range(40):
        add(sched, f"r{i}", rng.sample(pool, rng.randint(0, 2)), max_tokens=rng.randint(1, 12))
    hits = preemptions = 0
    while sched.has_unfinished_requests():
        step(sched, worker)
        cached = {h for h, e in worker.store.entries.items() if e.cached}
        assert cached == set(sched.encoder_cache.cache._entries)
        stats = sched.make_stats()
        hits, preemptions = hits + stats.encoder_cache_hits, preemptions + stats.num_preemptions
    assert hits > 0 and preemptions > 0
    for req_id in sched.schedule().finished_req_ids:  # the last finished requests reach the worker
        worker.remove_request(req_id)
    assert not worker.items and all(not e.users and e.cached for e in worker.store.entries.values())


def test_positions_and_rows_of_a_chunk_that_cuts_an_image():
    """The runner's view of a 6-token chunk starting inside the first image."""
    sched = make_scheduler(encoder_items=4)
    worker = MultimodalBatchState(MM, torch.device("cpu"), torch.float32)
    request = add(sched, "a", ["cat", "dog"])  # tokens: 1 2 [4 x cat] 3 [4 x dog] 3
    step(sched, worker)
    inputs = worker.prepare(["a"], np.array([6]), np.arange(4, 10))
    assert inputs.embed_index.tolist() == [0, 1, 3, 4, 5]  # cat's rows 2-3, then dog's rows 0-2
    rows = torch.cat(inputs.embed_rows)
    assert torch.equal(rows[:2], features_of("cat")[2:]) and torch.equal(rows[2:], features_of("dog")[:3])
    assert inputs.mask_offsets is None
    full, delta = worker.mrope["a"]
    np.testing.assert_array_equal(inputs.positions, full[:, 4:10])
    decode = worker.prepare(["a"], np.array([1]), np.array([request.num_prompt_tokens]))
    assert decode.positions[:, 0].tolist() == [request.num_prompt_tokens + delta] * 3


def test_bidirectional_items_are_not_cut_by_chunks_and_get_key_limits():
    sched = make_scheduler(encoder_items=4, bidirectional=True, max_num_batched_tokens=5)
    worker = MultimodalBatchState(MM, torch.device("cpu"), torch.float32, bidirectional=True)
    add(sched, "a", ["cat"])  # 1 2 [4 x cat] 3: a 5-token chunk would end inside the image
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 2}
    worker.add_request(so.new_reqs[0])
    sched.update_from_output(ModelRunnerOutput(so.step_id, [], [], []))
    assert sched.schedule().num_scheduled_tokens == {"a": 5}
    inputs = worker.prepare(["a"], np.array([5]), np.arange(2, 7))
    assert inputs.mask_offsets.tolist() == [6, 6, 6, 6, 7]  # the image's tokens see up to its end
