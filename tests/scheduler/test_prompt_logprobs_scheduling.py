"""Prompt logprobs and ``max_tokens == 0`` in the scheduler: no prefix-cache reads, one delivery."""

from __future__ import annotations

from worker_stop import worker_output

from fastdeploy.config import EngineConfig
from fastdeploy.core.prompt_logprobs import PromptLogprobsBuffer, to_prompt_logprobs
from fastdeploy.core.request import EngineCoreRequest, Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.scheduler.scheduler import Scheduler

BLOCK = 4
PROMPT = list(range(10, 30))  # 20 tokens: 4 full blocks are cacheable (the last token is always computed)


def make_scheduler(budget: int = 64) -> Scheduler:
    config = EngineConfig.from_kwargs(
        block_size=BLOCK, max_num_batched_tokens=budget, enable_prefix_caching=True
    )
    return Scheduler(config, 64, 256)


def add(sched: Scheduler, req_id: str, **sp) -> Request:
    params = SamplingParams(temperature=0.0, **{"max_tokens": 2, **sp})
    request = Request(EngineCoreRequest(req_id, list(PROMPT), params, eos_token_ids=[2]), BLOCK)
    sched.add_request(request)
    return request


def entry(index: int) -> list:
    """A fake prompt-logprobs entry that encodes which prompt index it belongs to."""
    return [[index], [-0.5], -float(index), index]


def run(sched: Scheduler) -> dict[str, list]:
    """Drive the scheduler like a worker would, reporting prompt logprobs for every prefill chunk."""
    outputs: dict[str, list] = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        prompt_lps = {}
        for req_id, n in so.num_scheduled_tokens.items():
            request = sched.requests[req_id]
            start = request.num_computed_tokens - n
            end = min(request.num_computed_tokens, request.num_prompt_tokens - 1)
            if request.needs_prompt_logprobs and end > start:
                prompt_lps[req_id] = [start + 1, [entry(i) for i in range(start + 1, end + 1)]]
        result = worker_output(sched, so, lambda request: 7, prompt_logprobs=prompt_lps)
        for out in sched.update_from_output(result):
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_prompt_logprobs_request_reads_no_cached_prefix_but_others_do():
    sched = make_scheduler()
    add(sched, "warm")
    run(sched)
    asks = add(sched, "asks", prompt_logprobs=1)
    so = sched.schedule()
    assert so.num_scheduled_tokens["asks"] == len(PROMPT)  # nothing skipped
    assert asks.num_cached_tokens == 0
    sched.abort_requests(["asks"])
    plain = add(sched, "plain")
    sched.schedule()
    assert plain.num_cached_tokens == 16  # the cache is still filled and used by others


def test_chunked_prompt_logprobs_arrive_complete_with_the_first_token():
    sched = make_scheduler(budget=6)
    add(sched, "a", prompt_logprobs=2, max_tokens=3)
    outputs = run(sched)["a"]
    assert len(outputs) == 3
    first, *rest = outputs
    assert first.prompt_logprobs == [entry(i) for i in range(1, len(PROMPT))]
    assert all(out.prompt_logprobs is None for out in rest)


def test_max_tokens_zero_finishes_after_prefill_without_a_token():
    sched = make_scheduler(budget=8)
    add(sched, "score", prompt_logprobs=0, max_tokens=0)
    (out,) = run(sched)["score"]
    assert out.new_token_ids == [] and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == len(PROMPT) - 1
    assert out.queue_time is not None
    assert sched.kv.pool.num_used_blocks == 0


def test_buffer_skips_recomputed_entries_and_is_taken_once():
    buf = PromptLogprobsBuffer(6)
    buf.add(1, [entry(1), entry(2)])
    assert buf.needed
    buf.add(1, [entry(1), entry(2), entry(3)])  # recomputed after a preemption
    buf.add(5, [entry(5)])  # a gap: dropped, never misaligned
    buf.add(4, [entry(4), entry(5)])
    assert buf.complete and not buf.needed
    assert buf.take() == [entry(i) for i in range(1, 6)]
    assert buf.take() is None and not buf.needed


def test_front_end_list_is_aligned_with_the_prompt():
    prompt = [5, 6, 7]
    wire = [[[9, 6], [-0.1, -2.0], -2.0, 2], [[7], [-0.3], -0.3, 1]]
    lps = to_prompt_logprobs(prompt, wire, tokenizer=None)
    assert lps[0] is None
    assert set(lps[1]) == {6, 9} and lps[1][6].rank == 2 and lps[1][9].rank == 1
    assert set(lps[2]) == {7} and lps[2][7].logprob == -0.3
