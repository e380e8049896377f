"""Async scheduling and the overlapped runner (seed 004) give the plain path's outputs.

The engine schedules step N+1 before step N's tokens reach the host; decode inputs
then come from the previous step's ids on the device, and the runner returns step
N-1's output while N runs. On a CPU nothing overlaps in time, but the order of the
stages and the bookkeeping are the same as on a GPU, so outputs must be identical.
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.step_io import StopCode
from fastdeploy.worker import model_runner

PROMPTS = [
    "The quick brown fox jumps over",
    "Once upon a time, there",
    "List three facts about Mars:",
    "def fibonacci(n):",
    "The capital of France is",
]


def _params() -> list[SamplingParams]:
    """A mixed batch: greedy, stop ids, penalties, min_tokens, a seeded sample, different lengths."""
    return [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[13]),
        SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=15, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=1),
    ]


def _run(async_scheduling: bool, **kwargs) -> tuple[list, LLM]:
    llm = LLM(dtype="float32", num_threads=1, async_scheduling=async_scheduling, **kwargs)
    try:
        outputs = llm.generate(PROMPTS, _params())
        runner = llm.engine.core.executor.worker.runner
        assert runner._pending is None  # every launched step was saved
        assert llm.engine.core.scheduler.kv.usage() == 0  # every block came back
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs], llm
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefill: decodes mixed with prompt chunks
        {"block_size": 4, "num_gpu_blocks_override": 24, "max_model_len": 40, "max_num_batched_tokens": 64},
    ],
    ids=["plain", "chunked-prefill", "preemption"],
)
def test_async_scheduling_gives_the_same_outputs(kwargs):
    sync, _ = _run(False, **kwargs)
    overlapped, llm = _run(True, **kwargs)
    assert llm.engine.core.async_scheduling
    assert overlapped == sync
    assert {reason for _, reason in sync} <= {"stop", "length"}


def test_overlap_saves_the_previous_step_while_the_next_one_runs(monkeypatch):
    monkeypatch.setenv("FD_STEP_TRACE", "1")
    llm = LLM(dtype="float32", num_threads=1, async_scheduling=True)
    try:
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6))
        trace = llm.engine.core.executor.worker.runner.trace
    finally:
        llm.shutdown()
    stages = [(stage, step) for stage, step, _ in trace]
    times = [t for _, _, t in trace]
    assert times == sorted(times)
    # for every step N > first: execute_start(N) < save_start(N-1) < save_end(N-1) < postprocess_end(N)
    checked = 0
    for index, (stage, step) in enumerate(stages):
        if stage != "execute_start" or ("save_start", step - 1) not in stages:
            continue
        after = stages[index:]
        save_prev = after.index(("save_start", step - 1))
        if ("postprocess_end", step) in after:
            assert save_prev < after.index(("postprocess_end", step))
            checked += 1
    assert checked >= 3


def _worker_stops_every_request_at(monkeypatch, n: int) -> None:
    """Make the worker's stop check end every request with its ``n``-th output (a stop token id,
    whatever the token): a decision the engine cannot make from the request's parameters."""
    original = model_runner.device_stop_codes

    def stop_at_n(batch, slots, sampled, length_codes, num_tokens_after, to_device):
        codes = original(batch, slots, sampled, length_codes, num_tokens_after, to_device)
        nth = num_tokens_after - batch.num_prompt_tokens[slots] == n
        return torch.where(torch.from_numpy(nth).to(codes.device), int(StopCode.STOP_TOKEN), codes)

    monkeypatch.setattr(model_runner, "device_stop_codes", stop_at_n)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_engine_finishes_requests_from_the_worker_stop_codes(monkeypatch, async_scheduling):
    _worker_stops_every_request_at(monkeypatch, 3)
    llm = LLM(dtype="float32", num_threads=1, async_scheduling=async_scheduling)
    runner = llm.engine.core.executor.worker.runner
    skipped = []
    original_skip = runner._skip_sampling
    runner._skip_sampling = lambda state: (skipped.append(list(state.req_ids)), original_skip(state))
    try:
        params = [
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=12, min_tokens=2),
        ]
        outputs = llm.generate(PROMPTS[:2], params)
        while llm.engine.has_unfinished_requests():  # async: the step launched after the last one
            assert llm.engine.step() == []
        assert runner._pending is None and llm.engine.core.scheduler.kv.usage() == 0
    finally:
        llm.shutdown()
    for output in outputs:
        choice = output.outputs[0]
        assert len(choice.token_ids) == 3 and choice.finish_reason == "stop"
        assert choice.stop_reason == choice.token_ids[-1]
    # with async scheduling both requests were scheduled once more before their third tokens came
    # back; the device flag said nothing ran on, so that step sampled nothing
    assert skipped == ([[o.request_id for o in outputs]] if async_scheduling else [])
