"""Async scheduling and the overlapped runner (seed 004) give the plain path's outputs.

The engine schedules step N+1 before step N's tokens reach the host; decode inputs
then come from the previous step's ids on the device, and the runner returns step
N-1's output while N runs. On a CPU nothing overlaps in time, but the order of the
stages and the bookkeeping are the same as on a GPU, so outputs must be identical.
"""

from __future__ import annotations

import pytest

from fastdeploy import LLM, SamplingParams

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


def test_device_stop_flags_agree_with_the_scheduler():
    llm = LLM(dtype="float32", num_threads=1)
    runner = llm.engine.core.executor.worker.runner
    seen: list[tuple[str, bool]] = []
    original = runner._save_model_output

    def spy(state):
        output = original(state)
        seen.extend(zip(output.req_ids, output.stopped or []))
        return output

    runner._save_model_output = spy
    try:
        params = [
            SamplingParams(temperature=0, max_tokens=5),
            SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[13, 198]),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        ]
        outputs = llm.generate(PROMPTS[:3], params)
    finally:
        llm.shutdown()
    for i, output in enumerate(outputs):
        flags = [stopped for req_id, stopped in seen if req_id == output.request_id]
        assert len(flags) == len(output.outputs[0].token_ids)
        assert flags[-1] and not any(flags[:-1]), (i, flags)
