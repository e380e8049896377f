"""Preemption and aborts with the real default model: same tokens, no leaked KV blocks.

The workload is kept to a few dozen decode steps, run with one intra-op thread:
on a busy 2-core machine (pytest beside other processes) OpenMP's spin-waiting
threads made the same workload take 28 s with 2 threads against 1.1 s with one.
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.request import RequestStatus

BLOCK_SIZE = 4
NUM_BLOCKS = 10  # 40 tokens: one sequence of max_model_len fits, four growing ones do not
MAX_MODEL_LEN = 40
MAX_TOKENS = 12
PROMPTS = [
    "The quick brown fox jumps over",
    "Once upon a time, there",
    "List three facts about Mars:",
    "def fibonacci(n):",
]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank"


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    engine = LLM(
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_threads=1,
    )
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture
def recorded_requests(llm, monkeypatch):
    """Every engine-core ``Request`` the scheduler is given (they leave the scheduler when done)."""
    scheduler = llm.engine.core.scheduler
    seen = []
    original = scheduler.add_request

    def add_request(request):
        seen.append(request)
        original(request)

    monkeypatch.setattr(scheduler, "add_request", add_request)
    return seen


def _blocks_in_use(llm) -> int:
    return llm.engine.core.scheduler.kv.pool.num_used_blocks


def test_preemption_gives_the_same_tokens_as_one_at_a_time(llm, recorded_requests):
    scheduler = llm.engine.core.scheduler
    assert scheduler.kv.pool.num_blocks == NUM_BLOCKS
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    # all prompts fit at once, but their growth needs more blocks than exist
    prompt_blocks = [-(-len(tokenizer.encode(p)) // BLOCK_SIZE) for p in PROMPTS]
    full_blocks = [-(-(len(tokenizer.encode(p)) + MAX_TOKENS) // BLOCK_SIZE) for p in PROMPTS]
    assert sum(prompt_blocks) <= NUM_BLOCKS < sum(full_blocks)

    preemptions_before = llm.engine.stats.num_preemptions
    batched = llm.generate(PROMPTS, params)
    batch_requests = list(recorded_requests)
    assert len(batch_requests) == len(PROMPTS)
    assert _blocks_in_use(llm) == 0
    num_preemptions = sum(r.num_preemptions for r in batch_requests)
    assert num_preemptions >= 1, "the workload must preempt a request"
    assert llm.engine.stats.num_preemptions - preemptions_before == num_preemptions

    recorded_requests.clear()
    singles = [llm.generate(p, params)[0] for p in PROMPTS]
    assert sum(r.num_preemptions for r in recorded_requests) == 0
    assert _blocks_in_use(llm) == 0

    for b, s in zip(batched, singles):
        assert len(b.outputs[0].token_ids) == MAX_TOKENS
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        assert b.outputs[0].text == s.outputs[0].text
        assert b.outputs[0].finish_reason == "length"


def test_same_prefix_in_one_batch_hits_the_cache_and_matches(llm, recorded_requests):
    """The second copy hits blocks the first computes in the same step, and the batch also preempts."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    num_prompt = len(llm.get_tokenizer().encode(LONG_PROMPT))
    assert num_prompt >= 3 * BLOCK_SIZE + 1
    assert llm.engine.core.scheduler.kv.pool.reset_prefix_cache()
    first, second = llm.generate([LONG_PROMPT, LONG_PROMPT], params)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert _blocks_in_use(llm) == 0
    recorded_requests.clear()
    assert llm.engine.core.scheduler.kv.pool.reset_prefix_cache()
    (single,) = llm.generate([LONG_PROMPT], params)
    assert single.num_cached_tokens == 0
    assert first.outputs[0].token_ids == single.outputs[0].token_ids
    assert second.outputs[0].token_ids == single.outputs[0].token_ids
    assert _blocks_in_use(llm) == 0


def test_abort_running_and_preempted_requests_frees_every_block(llm):
    engine = llm.engine
    scheduler = engine.core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, params)
    for _ in range(10):
        engine.step()
        if any(r.status == RequestStatus.PREEMPTED for r in scheduler.waiting):
            break
    assert any(r.status == RequestStatus.PREEMPTED for r in scheduler.waiting)
    assert len(scheduler.running) >= 2

    # abort one running request: exactly its blocks come back, the others go on
    victim = scheduler.running[0].request_id
    victim_blocks = len(scheduler.kv.block_ids(victim))
    used = _blocks_in_use(llm)
    engine.abort_request(victim)
    assert _blocks_in_use(llm) == used - victim_blocks
    assert victim not in scheduler.requests and victim not in engine.output_processor.requests
    engine.step()
    assert victim not in engine.core.executor.worker.runner.batch.req_id_to_index

    # abort the rest, running and preempted alike
    for i in range(len(PROMPTS)):
        engine.abort_request(f"abort-{i}")  # unknown / already aborted ids are ignored
    assert _blocks_in_use(llm) == 0
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.requests


def test_abort_request_with_two_choices(llm):
    engine = llm.engine
    engine.add_request("n2", PROMPTS[1], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20))
    for _ in range(2):
        engine.step()
    assert set(engine.core.scheduler.requests) == {"n2#0", "n2#1"}
    assert _blocks_in_use(llm) > 0
    engine.abort_request("n2")
    assert _blocks_in_use(llm) == 0
    assert not engine.has_unfinished_requests()
