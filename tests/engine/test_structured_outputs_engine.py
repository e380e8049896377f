"""Structured outputs through the offline engine: every answer parses and validates against its JSON
schema (several schemas and prompts, greedy and sampled, n=2, logprobs, chunked prefill), and async
scheduling (grammar rows sampled once the previous token advanced their matcher) gives the same
greedy tokens as the plain path."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.sampling_params import StructuredOutputsParams

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "sunny": {"type": "boolean"},
            "temps": {
                "type": "array",
                "items": {"type": "integer", "minimum": -50, "maximum": 50},
                "maxItems": 3,
            },
        },
        "required": ["city", "sunny", "temps"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 12},
            "rating": {"type": "integer", "minimum": 0, "maximum": 5},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 2},
        },
        "required": ["title", "rating"],
    },
]
PROMPTS = [
    "Describe a person as JSON.",
    "Give me the weather as JSON.",
    "Review a movie in JSON.",
]


def _requests() -> tuple[list[list[dict]], list[SamplingParams]]:
    messages, params = [], []
    for i, (schema, prompt) in enumerate(zip(SCHEMAS, PROMPTS)):
        for sampled in (False, True):
            messages.append([{"role": "user", "content": prompt}])
            params.append(
                SamplingParams(
                    temperature=0.9 if sampled else 0,
                    seed=i if sampled else None,
                    n=2 if sampled else 1,
                    max_tokens=120,
                    logprobs=2 if i == 0 else None,
                    structured_outputs=StructuredOutputsParams(json=schema),
                )
            )
    return messages, params


def _run(async_scheduling: bool, **kwargs) -> list:
    llm = LLM(
        dtype="float32", num_threads=1, async_scheduling=async_scheduling, max_num_batched_tokens=32, **kwargs
    )
    try:
        messages, params = _requests()
        outputs = llm.chat(messages, params)  # one batch: different schemas, greedy and sampled rows
        core = llm.engine.core
        assert core.async_scheduling == async_scheduling
        assert core.structured.num_compiles == len(SCHEMAS)  # one compile per distinct schema
        assert core.scheduler.kv.usage() == 0
        return outputs, params
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def sync_run():
    return _run(False)


def _check_valid(outputs, params):
    for output, sp in zip(outputs, params):
        assert len(output.outputs) == sp.n
        for choice in output.outputs:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), sp.structured_outputs.json)
            if sp.logprobs is not None:
                assert len(choice.logprobs) == len(choice.token_ids)


@pytest.mark.slow
def test_json_schema_outputs_validate(sync_run):
    outputs, params = sync_run
    _check_valid(outputs, params)


@pytest.mark.slow
def test_async_scheduling_gives_the_same_structured_outputs(sync_run):
    outputs, params = _run(True)
    _check_valid(outputs, params)
    sync_outputs, _ = sync_run
    for mine, theirs, sp in zip(outputs, sync_outputs, params):
        if sp.temperature == 0:
            assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids


@pytest.mark.slow
def test_async_scheduling_over_two_worker_processes(sync_run):
    """Tensor parallel 2: worker processes, each given the bitmask without the engine waiting
    for their replies (read with the next step); greedy rows equal the plain path's."""
    outputs, params = _run(True, tensor_parallel_size=2)
    _check_valid(outputs, params)
    sync_outputs, _ = sync_run
    for mine, theirs, sp in zip(outputs, sync_outputs, params):
        if sp.temperature == 0:
            assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids


def test_choice_regex_and_grammar(monkeypatch):
    """(With the engine's GIL switch interval set: ``FD_SWITCH_INTERVAL_MS``, for the mask threads.)"""
    monkeypatch.setenv("FD_SWITCH_INTERVAL_MS", "0.5")
    interval = sys.getswitchinterval()
    llm = LLM(dtype="float32", num_threads=1)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        prompts = ["The sky is", "My number is", "Answer yes or no:"]
        params = [
            SamplingParams(
                temperature=1.0,
                seed=3,
                n=2,
                max_tokens=8,
                structured_outputs=StructuredOutputsParams(choice=["blue", "green", "red"]),
            ),
            SamplingParams(
                temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}")
            ),
            SamplingParams(
                temperature=0,
                max_tokens=8,
                structured_outputs=StructuredOutputsParams(grammar='root ::= "yes" | "no"'),
            ),
        ]
        outputs = llm.generate(prompts, params)
        waits = llm.engine.core.grammar_ready_waits  # each sequence (n=2: two) waited once for its grammar
        assert waits.count == sum(sp.n for sp in params) and 0 < waits.total_s <= waits.count * waits.max_s
    finally:
        llm.shutdown()
        sys.setswitchinterval(interval)
    assert {c.text for c in outputs[0].outputs} <= {"blue", "green", "red"}
    assert re.fullmatch(r"\d{3}-\d{4}", outputs[1].outputs[0].text)
    assert outputs[2].outputs[0].text in ("yes", "no")
    assert all(c.finish_reason == "stop" for o in outputs for c in o.outputs)


def test_grammar_processes_give_the_same_outputs(monkeypatch):
    """``FD_GRAMMAR_PROCESSES=2``: the grammars compiled and the masks made in two helper processes;
    greedy outputs equal those of the engine's own threads, with async scheduling."""
    messages, params = _requests()
    greedy = [(m, p) for m, p in zip(messages, params) if p.temperature == 0]
    outputs = {}
    for processes in ("0", "2"):
        monkeypatch.setenv("FD_GRAMMAR_PROCESSES", processes)
        llm = LLM(dtype="float32", num_threads=1, async_scheduling=True, max_num_batched_tokens=32)
        try:
            # started with the engine and running before the first structured request
            started = llm.engine.core.structured
            assert (started is not None and started._processes is not None) == (processes == "2")
            outputs[processes] = llm.chat([m for m, _ in greedy], [p for _, p in greedy])
            manager = llm.engine.core.structured
            assert (manager._processes is not None) == (processes == "2")
        finally:
            llm.shutdown()
    _check_valid(outputs["2"], [p for _, p in greedy])
    for mine, theirs in zip(outputs["2"], outputs["0"]):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids


def test_a_crashed_grammar_process_starts_again(monkeypatch):
    """Grammar processes killed (as a crash would) between two batches: the second batch's cached
    grammars are compiled again in the processes' new starts, and its greedy outputs equal the
    first's (nothing reused from the dead processes, no mask lifted)."""
    messages, params = _requests()
    greedy = [(m, p) for m, p in zip(messages, params) if p.temperature == 0]
    monkeypatch.setenv("FD_GRAMMAR_PROCESSES", "2")
    llm = LLM(dtype="float32", num_threads=1, async_scheduling=True, max_num_batched_tokens=32)
    try:
        first = llm.chat([m for m, _ in greedy], [p for _, p in greedy])
        pool = llm.engine.core.structured.processes()
        for proc in pool._procs:
            proc.kill_and_wait()
        again = llm.chat([m for m, _ in greedy], [p for _, p in greedy])
        assert pool.generations == [1, 1]
    finally:
        llm.shutdown()
    _check_valid(again, [p for _, p in greedy])
    for mine, theirs in zip(again, first):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
