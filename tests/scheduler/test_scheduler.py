"""Scheduler driven by a fake executor: budgets, chunked prefill, FCFS, preemption, stops, aborts."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from worker_stop import worker_output

from fastdeploy.config import EngineConfig
from fastdeploy.core.request import EngineCoreOutput, EngineCoreRequest, Request, RequestStatus
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.step_io import ModelRunnerOutput, SchedulerOutput, StopCode
from fastdeploy.scheduler.scheduler import Scheduler

VOCAB = 1000
EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    config = EngineConfig.from_kwargs(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    return Scheduler(config, num_blocks, max_model_len)


def make_request(sched: Scheduler, req_id: str, prompt: list[int], **sp) -> Request:
    sp.setdefault("temperature", 0.0)
    sp.setdefault("max_tokens", 8)
    core = EngineCoreRequest(req_id, list(prompt), SamplingParams(**sp), eos_token_ids=[EOS])
    request = Request(core, sched.block_size)
    sched.add_request(request)
    return request


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def hash_sampler(request: Request) -> int:
    """A deterministic 'model': the next token is a function of the whole sequence, never EOS."""
    h = 0
    for t in request.all_token_ids:
        h = (h * 1000003 + t) % 2_147_483_647
    return 3 + h % (VOCAB - 3)


class FakeWorker:
    """Mirrors what a worker learns from SchedulerOutputs and checks it against the scheduler."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.new_req_tokens: dict[str, list[list[int]]] = {}

    def apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            assert rid in self.blocks, f"worker told to drop {rid} it does not hold"
            del self.blocks[rid], self.computed[rid]
        for new in so.new_reqs:
            assert new.req_id not in self.blocks, f"{new.req_id} re-sent without being dropped first"
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.new_req_tokens.setdefault(new.req_id, []).append(list(new.token_ids))
        cached = so.cached_reqs
        for rid, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            assert rid in self.blocks
            assert num_computed == self.computed[rid]
            self.blocks[rid].extend(block_ids)
        block_size = self.sched.block_size
        for rid, n in so.num_scheduled_tokens.items():
            assert n > 0
            assert self.blocks[rid] == self.sched.kv.block_ids(rid), rid
            self.computed[rid] += n
            assert self.computed[rid] == self.sched.requests[rid].num_computed_tokens
            assert self.computed[rid] <= len(self.blocks[rid]) * block_size


def step(
    sched: Scheduler,
    sampler: Callable[[Request], int] = hash_sampler,
    worker: FakeWorker | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert set(so.num_scheduled_tokens) <= {r.request_id for r in sched.running}
    if worker is not None:
        worker.apply(so)
    outputs = sched.update_from_output(worker_output(sched, so, sampler))
    return so, outputs


def run_to_completion(sched: Scheduler, sampler=hash_sampler, worker=None, max_steps: int = 10_000):
    """Step until every request ended; returns {req_id: final EngineCoreOutput-derived info}."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, tuple[str, object]] = {}
    steps = 0
    while sched.has_unfinished_requests():
        _, outputs = step(sched, sampler, worker)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = (out.finish_reason, out.stop_reason)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    assert sched.kv.pool.num_used_blocks == 0
    assert not sched.running and not sched.waiting and not sched.requests
    return tokens, finish


# ---- budgets ---------------------------------------------------------------------------


def test_token_budget_and_max_num_seqs_every_step():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=200, max_num_seqs=3, max_num_batched_tokens=24)
    worker = FakeWorker(sched)
    reqs = [
        make_request(sched, f"r{i}", rand_prompt(rng, rng.randint(1, 50)), max_tokens=rng.randint(1, 10))
        for i in range(10)
    ]
    max_running_seen = 0
    while sched.has_unfinished_requests():
        so, _ = step(sched, worker=worker)
        assert so.total_num_scheduled_tokens <= 24
        assert len(so.num_scheduled_tokens) <= 3
        max_running_seen = max(max_running_seen, len(sched.running))
    assert max_running_seen == 3
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert all(r.finish_reason.value == "length" for r in reqs)
    assert sched.kv.pool.num_used_blocks == 0


def test_chunked_prefill_of_a_long_prompt():
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32)
    req = make_request(sched, "long", rand_prompt(rng, 100), max_tokens=3)
    chunks, sampled_at = [], []
    for i in range(4):
        so, outputs = step(sched)
        chunks.append(so.num_scheduled_tokens["long"])
        if outputs:
            sampled_at.append(i)
    assert chunks == [32, 32, 32, 4]
    assert sampled_at == [3]  # no token until the whole prompt is computed
    assert req.num_output_tokens == 1
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"long": 1}


def test_decodes_first_then_prefill_chunks_share_the_budget():
    rng = random.Random(2)
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=16)
    make_request(sched, "a", rand_prompt(rng, 5), max_tokens=50)
    step(sched)  # a prefilled
    make_request(sched, "b", rand_prompt(rng, 40), max_tokens=2)
    chunks = []
    while sched.requests["b"].num_output_tokens == 0:
        so, _ = step(sched)
        assert so.num_scheduled_tokens["a"] == 1
        chunks.append(so.num_scheduled_tokens["b"])
    assert chunks == [15, 15, 10]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_fits():
    rng = random.Random(3)
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=32, enable_chunked_prefill=False)
    make_request(sched, "a", rand_prompt(rng, 20), max_tokens=4)
    make_request(sched, "b", rand_prompt(rng, 20), max_tokens=4)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 20}  # b would need to be split
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20}


# ---- order ----------------------------------------------------------------------------


def test_fcfs_order():
    rng = random.Random(4)
    sched = make_scheduler(num_blocks=128, max_num_seqs=2, max_num_batched_tokens=64)
    ids = [f"r{i}" for i in range(6)]
    for rid in ids:
        make_request(sched, rid, rand_prompt(rng, rng.randint(3, 20)), max_tokens=rng.randint(2, 6))
    admitted, finished = [], []
    while sched.has_unfinished_requests():
        so, outputs = step(sched)
        admitted.extend(n.req_id for n in so.new_reqs)
        finished.extend(o.request_id for o in outputs if o.finish_reason)
        # running requests keep their arrival order
        order = [ids.index(r.request_id) for r in sched.running]
        assert order == sorted(order)
    assert admitted == ids
    assert sorted(finished, key=ids.index) == ids


# ---- preemption ------------------------------------------------------------------------


def test_preemption_newest_first_recompute_and_same_tokens():
    rng = random.Random(5)
    prompts = [rand_prompt(rng, 8) for _ in range(3)]
    # reference: a cache big enough that nothing is preempted
    ref = make_scheduler(num_blocks=100, block_size=4, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        make_request(ref, f"r{i}", p, max_tokens=12)
    ref_tokens, ref_finish = run_to_completion(ref, worker=FakeWorker(ref))

    # 3 requests of 8 + 12 tokens need 15 blocks of 4; only 10 exist
    sched = make_scheduler(num_blocks=10, block_size=4, enable_prefix_caching=False)
    worker = FakeWorker(sched)
    reqs = [make_request(sched, f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {}
    preempted_events = []
    while sched.has_unfinished_requests():
        running_before = [r.request_id for r in sched.running]
        so, outputs = step(sched, worker=worker)
        victims = [
            r.request_id
            for r in reqs
            if r.request_id in so.finished_req_ids and r.status != RequestStatus.FINISHED
        ]
        if victims:
            preempted_events.append((running_before, victims, [r.request_id for r in sched.waiting]))
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert sched.kv.pool.num_used_blocks <= 10

    assert preempted_events, "the workload must have preempted a request"
    for running_before, victims, waiting_after in preempted_events:
        # the newest running requests are the victims, and they wait at the front of the queue
        assert victims == running_before[len(running_before) - len(victims) :]
        assert waiting_after[: len(victims)] == victims
    assert sum(r.num_preemptions for r in reqs) >= 1
    # a resumed request is re-sent with its prompt plus the tokens generated before preemption
    for r in reqs:
        sends = worker.new_req_tokens[r.request_id]
        assert len(sends) == r.num_preemptions + 1
        assert sends[0] == r.prompt_token_ids
        for sent in sends[1:]:
            assert sent[: r.num_prompt_tokens] == r.prompt_token_ids
            assert sent == r.all_token_ids[: len(sent)]
    assert tokens == ref_tokens
    assert all(ref_finish[r.request_id] == ("length", None) for r in reqs)
    assert sched.kv.pool.num_used_blocks == 0
    assert sched.make_stats().num_preemptions == sum(r.num_preemptions for r in reqs)


def test_preempted_request_goes_to_front_of_waiting():
    rng = random.Random(6)
    # 6 blocks of 4 hold one sequence of max_model_len (as the engine core guarantees), not two
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=24
    )
    make_request(sched, "a", rand_prompt(rng, 8), max_tokens=16)
    make_request(sched, "b", rand_prompt(rng, 8), max_tokens=16)
    make_request(sched, "c", rand_prompt(rng, 4), max_tokens=2)
    step(sched)  # a and b prefilled: 4 blocks; c waits for a seat
    assert [r.request_id for r in sched.waiting] == ["c"]
    so = None
    for _ in range(20):
        so, _ = step(sched)
        if "b" in so.finished_req_ids:
            break
    assert so is not None and "b" in so.finished_req_ids
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert [r.request_id for r in sched.running] == ["a"]
    assert sched.requests["b"].num_computed_tokens == 0
    assert "b" not in sched.kv.req_to_blocks
    run_to_completion(sched)


def test_preemption_of_the_only_request_it_is_resumed():
    """A lone request that outgrows a tiny budget of blocks is preempted by itself and resumed."""
    rng = random.Random(7)
    sched = make_scheduler(
        num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32
    )
    worker = FakeWorker(sched)
    make_request(sched, "a", rand_prompt(rng, 10), max_tokens=20)
    make_request(sched, "b", rand_prompt(rng, 10), max_tokens=20)
    tokens, finish = run_to_completion(sched, worker=worker)
    assert len(tokens["a"]) == 20 and len(tokens["b"]) == 20
    assert finish["a"] == ("length", None)


# ---- stop conditions -------------------------------------------------------------------


def scripted(script: dict[str, list[int]]) -> Callable[[Request], int]:
    return lambda request: script[request.request_id][request.num_output_tokens]


def test_stop_conditions():
    rng = random.Random(8)
    sched = make_scheduler()
    body = [rng.randrange(3, VOCAB) for _ in range(10)]
    stop_tok = body[3] + 1 if body[3] + 1 < VOCAB else 5
    body = [t for t in body if t != stop_tok]
    script = {
        "len": body * 3,
        "eos": body[:3] + [EOS] + body,
        "ignore": body[:3] + [EOS] + body,
        "stop_id": body[:2] + [stop_tok] + body,
        "min": [EOS, EOS] + body[:2] + [EOS] + body,
        "min_eq": [body[0], EOS] + body,
    }
    make_request(sched, "len", rand_prompt(rng, 5), max_tokens=7)
    make_request(sched, "eos", rand_prompt(rng, 5), max_tokens=20)
    make_request(sched, "ignore", rand_prompt(rng, 5), max_tokens=6, ignore_eos=True)
    make_request(sched, "stop_id", rand_prompt(rng, 5), max_tokens=20, stop_token_ids=[stop_tok])
    make_request(sched, "min", rand_prompt(rng, 5), max_tokens=20, min_tokens=3)
    make_request(sched, "min_eq", rand_prompt(rng, 5), max_tokens=20, min_tokens=2)
    tokens, finish = run_to_completion(sched, scripted(script))
    assert tokens["len"] == script["len"][:7] and finish["len"] == ("length", None)
    assert tokens["eos"] == script["eos"][:4] and finish["eos"] == ("stop", None)
    assert tokens["ignore"] == script["ignore"][:6] and finish["ignore"] == ("length", None)
    assert tokens["stop_id"] == script["stop_id"][:3] and finish["stop_id"] == ("stop", stop_tok)
    # EOS before min_tokens outputs does not stop; the first EOS at or after it does
    assert tokens["min"] == script["min"][:5] and finish["min"] == ("stop", None)
    assert tokens["min_eq"] == script["min_eq"][:2] and finish["min_eq"] == ("stop", None)


def test_max_model_len_ends_with_length():
    rng = random.Random(9)
    sched = make_scheduler(max_model_len=20)
    make_request(sched, "a", rand_prompt(rng, 15), max_tokens=None)
    tokens, finish = run_to_completion(sched)
    assert len(tokens["a"]) == 5 and finish["a"] == ("length", None)


def runner_output(so: SchedulerOutput, rows: dict[str, tuple[int, StopCode]]) -> ModelRunnerOutput:
    """A worker's output for ``so``: ``{req_id: (token, stop code)}``."""
    return ModelRunnerOutput(
        so.step_id, list(rows), [token for token, _ in rows.values()], [code for _, code in rows.values()]
    )


def test_the_worker_stop_codes_alone_finish_requests():
    """The scheduler acts on the worker's decision and re-checks nothing (EOS, stop ids, max_tokens)."""
    rng = random.Random(11)
    sched = make_scheduler()
    for req_id in ("length", "eos_ignored", "stop_token", "eos"):
        make_request(sched, req_id, rand_prompt(rng, 5), max_tokens=2)
    so = sched.schedule()
    rows = {
        "length": (5, StopCode.LENGTH),  # one token of two: the host would have gone on
        "eos_ignored": (EOS, StopCode.RUNNING),  # the host would have stopped on EOS
        "stop_token": (6, StopCode.STOP_TOKEN),
        "eos": (7, StopCode.EOS),
    }
    outputs = sched.update_from_output(runner_output(so, rows))
    finish = {out.request_id: (out.finish_reason, out.stop_reason) for out in outputs}
    assert finish == {
        "length": ("length", None),
        "eos_ignored": (None, None),
        "stop_token": ("stop", 6),
        "eos": ("stop", None),
    }
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"eos_ignored": 1}
    assert sorted(so.finished_req_ids) == ["eos", "length", "stop_token"]
    # at max_tokens the request still runs on while the worker says so
    (out,) = sched.update_from_output(runner_output(so, {"eos_ignored": (8, StopCode.RUNNING)}))
    assert out.finish_reason is None and sched.requests["eos_ignored"].output_token_ids == [EOS, 8]
    (out,) = sched.update_from_output(runner_output(sched.schedule(), {"eos_ignored": (9, StopCode.LENGTH)}))
    assert out.finish_reason == "length" and not sched.requests
    assert sched.kv.pool.num_used_blocks == 0


def test_async_scheduling_drops_the_in_flight_token_of_a_request_the_worker_ended():
    rng = random.Random(12)
    sched = make_scheduler()
    sched.async_scheduling = True
    make_request(sched, "a", rand_prompt(rng, 6), max_tokens=20)
    make_request(sched, "b", rand_prompt(rng, 6), max_tokens=20)
    first = sched.schedule()
    second = sched.schedule()  # before the first step's tokens are back: a placeholder each
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    outputs = sched.update_from_output(
        runner_output(first, {"a": (EOS, StopCode.EOS), "b": (9, StopCode.RUNNING)})
    )
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "stop"), ("b", None)]
    outputs = sched.update_from_output(
        runner_output(second, {"a": (10, StopCode.RUNNING), "b": (11, StopCode.RUNNING)})
    )
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("b", [11])]  # a ended with its first token
    third = sched.schedule()
    assert third.finished_req_ids == ["a"] and third.num_scheduled_tokens == {"b": 1}
    assert sched.requests["b"].output_token_ids == [9, 11]


def test_async_scheduling_schedules_nothing_past_the_length_limit():
    rng = random.Random(13)
    sched = make_scheduler(max_model_len=12)
    sched.async_scheduling = True
    make_request(sched, "tokens", rand_prompt(rng, 5), max_tokens=2)
    make_request(sched, "model_len", rand_prompt(rng, 10), max_tokens=None)
    steps = [sched.schedule() for _ in range(3)]
    assert [sorted(so.num_scheduled_tokens) for so in steps] == [["model_len", "tokens"]] * 2 + [[]]


# ---- aborts ----------------------------------------------------------------------------


def test_abort_waiting_and_running_frees_blocks():
    rng = random.Random(10)
    sched = make_scheduler(num_blocks=40, max_num_seqs=2, max_num_batched_tokens=64)
    worker = FakeWorker(sched)
    for rid in "abc":
        make_request(sched, rid, rand_prompt(rng, 10), max_tokens=30)
    step(sched, worker=worker)
    step(sched, worker=worker)
    assert [r.request_id for r in sched.running] == ["a", "b"]
    used = sched.kv.pool.num_used_blocks
    blocks_of_a = len(sched.kv.block_ids("a"))
    assert blocks_of_a > 0
    outs = sched.abort_requests(["a", "c", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort"), ("c", "abort")]
    assert sched.kv.pool.num_used_blocks == used - blocks_of_a
    assert [r.request_id for r in sched.running] == ["b"] and not sched.waiting
    so, _ = step(sched, worker=worker)
    assert so.finished_req_ids == ["a"]  # c never reached the worker
    sched.abort_requests(["b"])
    assert sched.kv.pool.num_used_blocks == 0
    assert not sched.has_unfinished_requests()
    so, _ = step(sched, worker=worker)
    assert so.finished_req_ids == ["b"] and so.total_num_scheduled_tokens == 0


def test_abort_a_preempted_request_and_mid_prefill():
    rng = random.Random(11)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    worker = FakeWorker(sched)
    make_request(sched, "a", rand_prompt(rng, 12), max_tokens=40)
    make_request(sched, "b", rand_prompt(rng, 12), max_tokens=40)
    make_request(sched, "long", rand_prompt(rng, 30), max_tokens=4)
    preempted = None
    for _ in range(60):
        step(sched, worker=worker)
        preempted = next((r for r in sched.waiting if r.status == RequestStatus.PREEMPTED), None)
        if preempted:
            break
    assert preempted is not None
    sched.abort_requests([preempted.request_id])
    for _ in range(3):
        step(sched, worker=worker)
    sched.abort_requests(list(sched.requests))
    assert sched.kv.pool.num_used_blocks == 0
    step(sched, worker=worker)
    assert worker.blocks == {}


def test_random_workload_leaves_zero_blocks_in_use():
    """Arrivals, aborts and preemptions at random, with shared prefixes and prefix caching on."""
    rng = random.Random(12)
    sched = make_scheduler(
        num_blocks=24, block_size=4, max_num_seqs=5, max_num_batched_tokens=20, max_model_len=64
    )
    worker = FakeWorker(sched)
    prefixes = [rand_prompt(rng, rng.randint(4, 16)) for _ in range(3)]
    n = 0
    preemptions = 0
    aborted = 0
    for _ in range(300):
        if rng.random() < 0.3 and n < 60:
            prompt = rng.choice(prefixes) + rand_prompt(rng, rng.randint(1, 12))
            make_request(sched, f"r{n}", prompt, max_tokens=rng.randint(1, 30))
            n += 1
        if rng.random() < 0.05 and sched.requests:
            sched.abort_requests([rng.choice(list(sched.requests))])
            aborted += 1
        step(sched, worker=worker)
        preemptions += sched.make_stats().num_preemptions
        referenced = {b for rid in sched.kv.req_to_blocks for b in sched.kv.block_ids(rid)}
        assert sched.kv.pool.num_used_blocks == len(referenced)
    run_to_completion(sched, worker=worker)
    step(sched, worker=worker)  # deliver the last drops to the worker
    assert worker.blocks == {}
    assert sched.kv.pool.num_used_blocks == 0
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert preemptions > 0 and aborted > 0


# ---- prefix cache statistics ----------------------------------------------------------


def test_prefix_cache_hit_stats():
    rng = random.Random(13)
    sched = make_scheduler(num_blocks=64, block_size=4)
    prefix = rand_prompt(rng, 12)
    make_request(sched, "a", prefix + rand_prompt(rng, 3), max_tokens=2)
    run_to_completion(sched)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (15, 0)
    again = sched.make_stats()
    assert (again.prefix_cache_queries, again.prefix_cache_hits) == (0, 0)
    make_request(sched, "b", prefix + rand_prompt(rng, 5), max_tokens=2)
    first_outputs = []
    while sched.has_unfinished_requests():
        _, outs = step(sched)
        first_outputs.extend(outs)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (17, 12)
    assert first_outputs[0].num_cached_tokens == 12
    assert sched.kv.pool.num_used_blocks == 0


def test_stats_snapshot_counts_running_and_waiting():
    rng = random.Random(14)
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(5):
        make_request(sched, f"r{i}", rand_prompt(rng, 6), max_tokens=5)
    step(sched)
    stats = sched.make_stats()
    assert stats.num_running == 2 and stats.num_waiting == 3
    assert stats.kv_cache_usage == pytest.approx(sched.kv.pool.num_used_blocks / 64)
    assert stats.kv_cache_usage > 0
    sched.abort_requests(list(sched.requests))
    assert sched.make_stats().kv_cache_usage == 0


class RecordingGrammar:
    """A ``GrammarState`` that keeps the tokens it was given."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def accept_token(self, token_id: int) -> None:
        self.tokens.append(token_id)


def test_grammar_tokens_go_to_running_requests_with_a_grammar_only():
    """``accept_grammar_tokens`` gives each running request with a grammar its sampled token (not a
    request without one, not one aborted meanwhile), and once no request has a grammar left it
    does nothing at all."""
    rng = random.Random(5)
    sched = make_scheduler()
    grammar, other_grammar = RecordingGrammar(), RecordingGrammar()
    for req_id, g in (("json", grammar), ("plain", None), ("aborted", other_grammar)):
        core = EngineCoreRequest(
            req_id, rand_prompt(rng, 5), SamplingParams(max_tokens=4), eos_token_ids=[EOS]
        )
        request = Request(core, sched.block_size)
        request.grammar = g
        sched.add_request(request)
    so = sched.schedule()
    sched.abort_requests(["aborted"])
    rows = {r: (t, StopCode.RUNNING) for r, t in (("json", 11), ("plain", 12), ("aborted", 13))}
    sched.accept_grammar_tokens(runner_output(so, rows))
    sched.update_from_output(runner_output(so, rows))
    assert grammar.tokens == [11] and other_grammar.tokens == []
    sched.abort_requests(["json"])
    sched.accept_grammar_tokens(runner_output(sched.schedule(), {"json": (14, StopCode.RUNNING)}))
    assert grammar.tokens == [11] and sched._num_with_grammar == 0
