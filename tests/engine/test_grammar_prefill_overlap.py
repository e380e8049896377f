"""A structured-output request's prompt is prefilled while its grammar compiles: all of it but the
last token, whose step samples the first output token under the grammar. The compile is held open
here (the manager's future), so the test sees the prefill done and nothing sampled before it
ends, then the same tokens as a request whose grammar was ready; a failed compile aborts the
half-prefilled request with the compile's message and frees its blocks."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0}},
    "required": ["name", "n"],
}
PROMPT = list(range(200, 290))  # 90 tokens: three steps of the 32-token budget


def _params() -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )


def _hold_compiles(llm: LLM, monkeypatch) -> tuple[Future, list[Future]]:
    """Make the manager hand out one future (the gate) for every constraint; the real compiles go on."""
    manager = llm.engine.core._new_structured_manager()
    llm.engine.core.structured = manager
    gate: Future = Future()
    real: list[Future] = []
    submit = manager.submit
    monkeypatch.setattr(manager, "submit", lambda constraint: real.append(submit(constraint)) or gate)
    return gate, real


def _finish(llm: LLM, request_id: str) -> list[int]:
    engine = llm.engine
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return list(output.outputs[0].token_ids)
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_prompt_is_prefilled_while_the_grammar_compiles(async_scheduling, monkeypatch):
    llm = LLM(
        dtype="float32",
        num_threads=1,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    try:
        expected = list(llm.generate([PROMPT], _params())[0].outputs[0].token_ids)
        gate, real = _hold_compiles(llm, monkeypatch)
        core = llm.engine.core
        llm.engine.add_request("held", PROMPT, _params())
        for _ in range(8):  # more steps than the prefill takes
            llm.engine.step()
        request = core.scheduler.requests["held"]
        assert request.awaiting_grammar and request.grammar is None
        assert request.num_computed_tokens == len(PROMPT) - 1
        assert request.output_token_ids == [] and request.num_output_placeholders == 0
        gate.set_result(real[0].result())
        assert _finish(llm, "held") == expected
        assert core.grammar_ready_waits.count == 2 and core.scheduler.kv.usage() == 0
    finally:
        llm.shutdown()


def test_a_failed_compile_aborts_the_half_prefilled_request(monkeypatch):
    llm = LLM(dtype="float32", num_threads=1, max_num_batched_tokens=32)
    try:
        gate, _ = _hold_compiles(llm, monkeypatch)
        core = llm.engine.core
        core.add_request(llm.engine.input_processor.make_core_requests("bad", PROMPT, _params(), 0.0)[0])
        outputs = []
        for _ in range(4):
            outputs += core.step().outputs
        assert not outputs and core.scheduler.requests["bad"].num_computed_tokens == len(PROMPT) - 1
        gate.set_exception(ValueError("no such grammar"))
        outputs = core.step().outputs
        assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", "abort")]
        assert "could not be compiled: no such grammar" in outputs[0].error
        assert not core.has_unfinished_requests() and core.scheduler.kv.usage() == 0
    finally:
        llm.shutdown()


def test_a_request_the_scheduler_dropped_gets_no_matcher(monkeypatch):
    """A failed step aborts its requests in the scheduler alone (``EngineCore.step``): one whose
    grammar was still compiling then gets no matcher, and leaves nothing unfinished."""
    llm = LLM(dtype="float32", num_threads=1, max_num_batched_tokens=32)
    try:
        gate, real = _hold_compiles(llm, monkeypatch)
        core = llm.engine.core
        core.add_request(llm.engine.input_processor.make_core_requests("dropped", PROMPT, _params(), 0.0)[0])
        core.step()
        request = core.scheduler.requests["dropped"]
        assert [o.request_id for o in core.scheduler.abort_requests(["dropped"])] == ["dropped"]
        gate.set_result(real[0].result())
        assert not core.step().outputs
        assert request.grammar is None and core.grammar_ready_waits.count == 0
        assert not core.has_unfinished_requests() and core.scheduler.kv.usage() == 0
    finally:
        llm.shutdown()
