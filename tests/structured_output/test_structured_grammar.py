"""Constraint → grammar mapping, the compile cache, matchers, and the sampler's bitmask application
(against a per-token reference and xgrammar's own kernel, on random logits)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
import xgrammar as xgr

from fastdeploy.core.sampling_params import SamplingParamsError, StructuredOutputsParams
from fastdeploy.model_executor.sampler import Sampler, SamplingTensors, apply_token_bitmask
from fastdeploy.structured_output.grammar import (
    build_grammar,
    constraint_key,
    reasoning_prefix_ebnf,
    validate_structured_outputs,
)
from fastdeploy.structured_output.manager import StructuredOutputManager, bitmask_words

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}


def test_equal_constraints_have_one_key():
    assert constraint_key(StructuredOutputsParams(json=SCHEMA)) == constraint_key(
        StructuredOutputsParams(json=json.loads(json.dumps(SCHEMA, indent=2)))
    )
    # the order of properties is the order of the output's keys: another constraint
    reordered = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert constraint_key(StructuredOutputsParams(json=SCHEMA)) != constraint_key(
        StructuredOutputsParams(json=reordered)
    )
    assert constraint_key(StructuredOutputsParams(json=SCHEMA)) != constraint_key(
        StructuredOutputsParams(json={"type": "object"})
    )
    assert constraint_key(StructuredOutputsParams(choice=["x", "y"])) == ("choice", '["x", "y"]', "")


def test_keys_come_in_the_schema_order(tokenizer):
    """The grammar of ``{"b": .., "a": ..}`` (both required) accepts b first, not a."""
    schema = {
        "type": "object",
        "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
        "required": ["b", "a"],
    }
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_grammar(
        build_grammar(*constraint_key(StructuredOutputsParams(json=schema)))
    )
    assert xgr.GrammarMatcher(compiled).accept_string('{"b": 1, "a": 2}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"a": 2, "b": 1}')


@pytest.mark.parametrize(
    ("params", "field", "says"),
    [
        (
            StructuredOutputsParams(json={"type": "foo"}),
            "response_format.json_schema.schema",
            "Unsupported type",
        ),
        (StructuredOutputsParams(json="{not json"), "guided_json", "invalid JSON"),
        (StructuredOutputsParams(regex="[a-"), "guided_regex", "Unclosed"),
        (StructuredOutputsParams(grammar="root ::= foo"), "guided_grammar", 'Rule "foo" is not defined'),
    ],
)
def test_invalid_constraints_name_the_field_and_the_problem(params, field, says):
    with pytest.raises(SamplingParamsError) as info:
        validate_structured_outputs(params, field)
    assert info.value.param == field
    assert says in str(info.value)
    assert ".cc:" not in str(info.value)  # no C++ source location


def test_lengths_xgrammar_would_drop_are_a_400_naming_where(monkeypatch):
    """xgrammar 0.2 compiles a string's maxLength beside its pattern or format with a warning and does
    not enforce the length (answers broke the schema, e.g. pydantic's constr(pattern=..., max_length=4)):
    a 400 saying where, unless llguidance (which enforces it) is the backend."""
    code = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}
    schema = {
        "type": "object",
        "properties": {
            "format": {"type": "string"},
            "maxLength": {"type": "integer"},
            "items": {"$ref": "#/$defs/C"},
        },
        "$defs": {"C": {"type": "array", "items": {"anyOf": [{"type": "null"}, code]}}},
    }
    with pytest.raises(SamplingParamsError) as info:
        validate_structured_outputs(
            StructuredOutputsParams(json=schema), "response_format.json_schema.schema"
        )
    assert info.value.param == "response_format.json_schema.schema"
    assert "at $.$defs.C.items.anyOf[1], minLength / maxLength together with pattern" in str(info.value)
    email = {"type": "string", "format": "email", "minLength": 3}
    with pytest.raises(SamplingParamsError, match=r"at \$,"):
        validate_structured_outputs(StructuredOutputsParams(json=email), "guided_json")
    # properties named like keywords are not keywords; a length alone or a pattern alone is enforced
    names_only = {"type": "object", "properties": {"format": {"type": "string", "maxLength": 3}}}
    validate_structured_outputs(StructuredOutputsParams(json=names_only), "guided_json")
    validate_structured_outputs(
        StructuredOutputsParams(json={"type": "string", "pattern": "^a+$"}), "guided_json"
    )
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "guidance")
    validate_structured_outputs(StructuredOutputsParams(json=code), "guided_json")


def test_exactly_one_constraint():
    with pytest.raises(SamplingParamsError):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError):
        StructuredOutputsParams(regex="a", choice=["a"])


def _string_matches(kind: str, text: str, prefix: str, candidate: str) -> bool:
    """Whether ``candidate`` is a complete sentence of the constraint (byte-level matcher, no tokenizer)."""
    info = xgr.TokenizerInfo([chr(i) for i in range(128)])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(build_grammar(kind, text, prefix)))
    return matcher.accept_string(candidate) and matcher.is_completed()


def test_grammar_mapping():
    assert _string_matches(*constraint_key(StructuredOutputsParams(choice=["red", 'say "hi"'])), 'say "hi"')
    assert not _string_matches(*constraint_key(StructuredOutputsParams(choice=["red", "blue"])), "green")
    assert _string_matches(*constraint_key(StructuredOutputsParams(regex=r"\d{2}-x")), "42-x")
    assert _string_matches(*constraint_key(StructuredOutputsParams(json_object=True)), '{"k": [1, 2]}')
    assert not _string_matches(*constraint_key(StructuredOutputsParams(json_object=True)), "[1]")
    assert _string_matches(
        *constraint_key(StructuredOutputsParams(json=SCHEMA)), json.dumps({"a": 1, "b": "x"})
    )
    assert not _string_matches(*constraint_key(StructuredOutputsParams(json=SCHEMA)), json.dumps({"b": "x"}))


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from fastdeploy.config import EngineConfig
    from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

    config = EngineConfig()
    return load_tokenizer(config.model, resolve_model(config.model))


def test_cache_compiles_each_constraint_once(tokenizer, monkeypatch):
    monkeypatch.setenv("FD_GRAMMAR_CACHE_SIZE", "2")
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    manager = StructuredOutputManager(lambda: tokenizer, 49152 + 64, [tokenizer.eos_token_id])
    try:
        first = manager.submit(StructuredOutputsParams(json=SCHEMA))
        again = manager.submit(StructuredOutputsParams(json=json.loads(json.dumps(SCHEMA))))
        assert again is first
        first.result(timeout=60)
        assert manager.num_compiles == 1
        manager.submit(StructuredOutputsParams(regex="a+")).result(timeout=60)
        manager.submit(StructuredOutputsParams(regex="b+")).result(timeout=60)  # evicts SCHEMA (LRU of 2)
        assert manager.num_compiles == 3
        assert manager.submit(StructuredOutputsParams(json=SCHEMA)) is not first
        bad = manager.submit(StructuredOutputsParams(regex="[a-"))
        with pytest.raises(ValueError):
            bad.result(timeout=60)
    finally:
        manager.shutdown()


def test_compiler_freezes_the_tokenizer_heap(tokenizer, monkeypatch):
    """The compiler and the tokenizer it reads, built at the first constraint (after the engine core
    froze its start-up heap), leave the collector's scans: a full scan stalls the engine loop."""
    import gc

    monkeypatch.setenv("FD_GC_FREEZE", "1")
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    manager = StructuredOutputManager(lambda: tokenizer, 49152, [tokenizer.eos_token_id])
    gc.unfreeze()
    try:
        manager.compiler()
        assert gc.get_freeze_count() > 10_000
    finally:
        manager.shutdown()
        gc.unfreeze()


@pytest.mark.parametrize("cache_mb", [0, 64])
def test_xgrammar_rule_cache_is_bounded_and_switchable(tokenizer, cache_mb, monkeypatch):
    """Distinct schemas share their rules' token masks through xgrammar's cache (what makes the
    benchmark's 128 schemas cheap), within ``FD_XGRAMMAR_CACHE_MB``; 0 turns it off."""
    monkeypatch.setenv("FD_XGRAMMAR_CACHE_MB", str(cache_mb))
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    manager = StructuredOutputManager(lambda: tokenizer, 49152, [tokenizer.eos_token_id])
    try:
        for i in range(2):
            schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 5}}}
            manager.submit(StructuredOutputsParams(json=schema)).result(timeout=60)
        held = manager.compiler().get_cache_size_bytes()
    finally:
        manager.shutdown()
    assert (held > 0) == (cache_mb > 0)
    assert held <= cache_mb << 20


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_matchers_and_bitmask_with_a_padded_vocabulary(tokenizer, backend, monkeypatch):
    if backend == "guidance":
        pytest.importorskip("llguidance")
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", backend)
    vocab = len(tokenizer) + 64  # an LM head padded past the tokenizer
    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager(lambda: tokenizer, vocab, [eos])
    try:
        compiled = manager.submit(StructuredOutputsParams(choice=["yes", "no"])).result(timeout=60)
        grammars = [manager.new_request_grammar(compiled, [eos]) for _ in range(2)]
        for token in tokenizer.encode("yes", add_special_tokens=False):
            grammars[1].accept_token(token)
        mask = manager.bitmask(["a", "b"], grammars)
    finally:
        manager.shutdown()
    assert mask.words == bitmask_words(vocab)
    array = mask.array()
    allowed = [[t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1] for row in array]
    assert set(allowed[1]) == {eos}  # "yes" is complete: only EOS
    texts = {tokenizer.decode([t]) for t in allowed[0]}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert all(t < len(tokenizer) for t in allowed[0])  # the padded ids are never allowed


def _reference_mask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = token // 32
            if word >= bitmask.shape[1] or not (int(bitmask[i, word]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize(
    "vocab", [100, 128, 130]
)  # narrower than, equal to, wider than the bitmask (4 words)
def test_apply_token_bitmask_matches_a_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen, dtype=torch.float32)
    rows = [0, 3, 4]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), generator=gen, dtype=torch.int32)
    bitmask[3] = -1  # all allowed
    expected = _reference_mask(logits, rows, bitmask[rows].numpy())
    for given in (rows, torch.tensor(rows)):  # the rows as a list, or a tensor (as the worker gives them)
        got = logits.clone()
        apply_token_bitmask(got, bitmask, given)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_sampler_samples_only_allowed_tokens():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 6, 200
    logits = torch.randn(rows, vocab, generator=gen)
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    for r in range(rows):
        allowed[r, torch.randperm(vocab, generator=gen)[:3]] = True
    padded = torch.nn.functional.pad(allowed, (0, 224 - vocab))  # 200 tokens → 7 words of 32 bits
    words = (padded.view(rows, 7, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    bitmask = words.to(torch.int64).apply_(lambda w: w - (1 << 32) if w >= 1 << 31 else w).to(torch.int32)
    for temperature in (0.0, 1.0):
        params = SamplingTensors(
            temperature=torch.full((rows,), temperature),
            top_p=torch.ones(rows),
            top_k=torch.zeros(rows, dtype=torch.int64),
            min_p=torch.zeros(rows),
            generators={},
            all_greedy=temperature == 0,
            token_bitmask=(bitmask, list(range(rows))),
        )
        for _ in range(5):
            tokens = Sampler()(logits, params).token_ids
            assert allowed[torch.arange(rows), tokens].all()
        if temperature == 0:
            expected = logits.masked_fill(~allowed, float("-inf")).argmax(-1)
            assert torch.equal(tokens, expected)


def test_bitmask_travels_in_the_scheduler_output():
    from fastdeploy.core.step_io import CachedRequestData, GrammarBitmask, SchedulerOutput
    from fastdeploy.engine.ipc import decode, encode

    mask = np.arange(-6, 6, dtype=np.int32).reshape(2, 6)
    out = SchedulerOutput(
        1,
        [],
        CachedRequestData(),
        {"a": 1, "b": 1},
        2,
        [],
        structured_req_ids=["a", "b"],
        grammar=GrammarBitmask(["b", "a"], mask.tobytes(), 6),
    )
    back = SchedulerOutput.from_wire(decode(encode(out.to_wire())))
    assert back.structured_req_ids == ["a", "b"]
    assert back.grammar.req_ids == ["b", "a"]
    np.testing.assert_array_equal(back.grammar.array(), mask)


def test_worker_lays_the_grammar_rows_into_the_batch():
    """Rows map by request id (in any order; a request no longer in the batch is dropped); the
    other rows allow every token."""
    from types import SimpleNamespace

    from fastdeploy.core.step_io import GrammarBitmask
    from fastdeploy.worker.model_runner import ModelRunner

    received = np.arange(9, dtype=np.int32).reshape(3, 3)
    grammar = GrammarBitmask(["c", "gone", "a"], received.tobytes(), 3)
    runner = SimpleNamespace(device=torch.device("cpu"))
    mask, rows = ModelRunner._token_bitmask(runner, ["a", "b", "c"], grammar)
    assert rows.tolist() == [2, 0]
    np.testing.assert_array_equal(mask.numpy(), [received[2], [-1, -1, -1], received[0]])
    assert ModelRunner._token_bitmask(runner, ["b"], grammar) is None


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)
def test_worker_takes_a_mask_filled_in_its_process_as_it_is(device):
    """A mask made in the worker's own process (offline) comes with its host tensor (pinned on a GPU):
    the worker copies it as it is when its rows are in order, and the batch's mask is the same as
    from the bytes a worker process receives."""
    from types import SimpleNamespace

    from fastdeploy.core.step_io import GrammarBitmask
    from fastdeploy.worker.model_runner import ModelRunner

    tensor = torch.empty((2, 3), dtype=torch.int32, pin_memory=device == "cuda")
    tensor.copy_(torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int64).to(torch.int32))
    in_process = GrammarBitmask(["a", "c"], tensor.numpy(), 3, tensor=tensor)
    received = GrammarBitmask(["a", "c"], tensor.numpy().tobytes(), 3)
    runner = SimpleNamespace(device=torch.device(device))
    for batch in (["a", "b", "c"], ["c", "a"], ["c"]):  # the mask's rows all taken, then one left out
        mask, rows = ModelRunner._token_bitmask(runner, batch, in_process)
        expected_mask, expected_rows = ModelRunner._token_bitmask(runner, batch, received)
        assert rows.tolist() == expected_rows.tolist()
        assert torch.equal(mask.cpu(), expected_mask.cpu())


@pytest.mark.parametrize("threaded_fill", [False, True], ids=["slice-fills", "threaded-fill"])
def test_matchers_advance_in_parallel_slices_like_one_by_one(tokenizer, monkeypatch, threaded_fill):
    """The manager advances and fills many matchers at once, in slices on several threads (each slice
    filling its rows), or in one task (one advance of them all, then xgrammar's threaded fill): each row's mask equals that of a matcher
    advanced alone; a refused token lifts only its own row's mask."""
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    monkeypatch.setenv("FD_GRAMMAR_MASK_THREADS", "3")
    monkeypatch.setattr(StructuredOutputManager, "SLICE_ROWS", 4)
    monkeypatch.setattr(StructuredOutputManager, "THREADED_FILL", threaded_fill)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager(lambda: tokenizer, vocab, [eos])
    words = ["alpha", "bravo", "charlie", "delta"]
    try:
        compiled = manager.submit(StructuredOutputsParams(choice=words)).result(timeout=60)
        grammars = [manager.new_request_grammar(compiled, [eos]) for _ in range(20)]
        paths = [tokenizer.encode(words[i % 4], add_special_tokens=False)[: 1 + i % 2] for i in range(20)]
        for grammar, path in zip(grammars, paths):
            for token in path:
                grammar.accept_token(token)
        refused = tokenizer.encode(" zebra", add_special_tokens=False)[0]
        grammars[7].accept_token(refused)
        mask = manager.bitmask([str(i) for i in range(20)], grammars).array()
    finally:
        manager.shutdown()
    reference = xgr.allocate_token_bitmask(1, vocab)
    for i, path in enumerate(paths):
        if i == 7:
            assert grammars[7].failed and (mask[7] == -1).all()
            continue
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos])
        assert all(matcher.accept_token(t) for t in path)
        matcher.fill_next_token_bitmask(reference)
        np.testing.assert_array_equal(mask[i], reference[0].numpy(), err_msg=f"row {i}")
        assert not grammars[i].failed


def test_an_ended_grammar_lets_only_its_stop_tokens_through(tokenizer, monkeypatch):
    """After the grammar took its stop token (sampling goes on with ``ignore_eos``), the row allows
    exactly the request's stop tokens (63: the top bit of a word)."""
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer), [eos])
    try:
        compiled = manager.submit(StructuredOutputsParams(choice=["yes"])).result(timeout=60)
        grammar = manager.new_request_grammar(compiled, [eos, 63])
        for token in [*tokenizer.encode("yes", add_special_tokens=False), 63, eos]:
            grammar.accept_token(token)
        row = manager.bitmask(["a"], [grammar]).array()[0]
    finally:
        manager.shutdown()
    allowed = [t for t in range(len(tokenizer)) if (int(row[t // 32]) >> (t % 32)) & 1]
    assert allowed == sorted([eos, 63]) and not grammar.failed


SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("starts_inside", [True, False])
def test_reasoning_prefix_leaves_the_thinking_free_and_constrains_the_answer(starts_inside):
    """With a reasoning prefix the constraint applies after the first end tag: any reasoning (tags'
    look-alikes included), then whitespace, then the answer; the key tells the two apart."""
    prefix = reasoning_prefix_ebnf("<think>", "</think>", starts_inside)
    key = constraint_key(StructuredOutputsParams(json=SMALL, reasoning_prefix=prefix))
    assert key[2] == prefix and key != constraint_key(StructuredOutputsParams(json=SMALL))
    opened = "" if starts_inside else "<think>"
    thoughts = 'Let me see: a < b, </th is not the end, {"a": "x"} nor </thinking is. Done!'
    assert _string_matches(*key, f'{opened}{thoughts}</think>\n\n{{"a": 3}}')
    assert _string_matches(*key, f'{opened}</think>{{"a": 3}}')
    assert not _string_matches(
        *key, f'{opened}{thoughts}</think>\n\n{{"a": "x"}}'
    )  # the answer follows the schema
    assert not _string_matches(*key, f'{opened}{thoughts}</think> sure: {{"a": 3}}')
    assert not _string_matches(*key, f"{opened}{thoughts}")  # it must end its reasoning
    # without a reasoning block: the answer at once, where the output does not start inside one
    assert _string_matches(*key, '{"a": 3}') is not starts_inside


def test_the_mask_is_made_in_the_pool_threads_while_the_caller_goes_on(tokenizer, monkeypatch):
    """``start_bitmask`` returns before any matcher advances: the advance and the fill run in the
    manager's threads (the engine loop meanwhile hands out outputs and schedules), and ``result``
    gives the same rows as matchers advanced one by one."""
    import threading

    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer), [eos])
    release = threading.Event()
    threads: list[str] = []
    accept = xgr.BatchGrammarMatcher.batch_accept_token

    def held_accept(matchers, tokens):
        threads.append(threading.current_thread().name)
        assert release.wait(30)
        return accept(matchers, tokens)

    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_accept_token", staticmethod(held_accept))
    try:
        compiled = manager.submit(StructuredOutputsParams(choice=["alpha", "bravo"])).result(timeout=60)
        grammars = [manager.new_request_grammar(compiled, [eos]) for _ in range(3)]
        first = tokenizer.encode("alpha", add_special_tokens=False)[0]
        for grammar in grammars:
            grammar.accept_token(first)
        pending = manager.start_bitmask(["a", "b", "c"], grammars)  # returns with the accept held
        assert not grammars[0].failed and grammars[0].unseen == []
        release.set()
        mask = pending.result().array()
    finally:
        manager.shutdown()
    assert threads and all(name.startswith("fd-grammar-mask") for name in threads)
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos])
    assert matcher.accept_token(first)
    reference = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(reference)
    for row in mask:
        np.testing.assert_array_equal(row, reference[0].numpy())


def test_compiles_run_at_a_lower_cpu_priority(tokenizer, monkeypatch):
    """A burst of new schemas must not take cores from the engine loop: the compile threads run
    ``FD_GRAMMAR_COMPILE_NICE`` lower; the engine loop's thread keeps its priority."""
    from fastdeploy.platforms.thread_priority import nice_is_permitted, thread_nice
    from fastdeploy.structured_output import manager as manager_module

    if not nice_is_permitted():
        pytest.skip("per-thread nice needs Linux, where setpriority is permitted")
    monkeypatch.setenv("FD_GRAMMAR_COMPILE_NICE", "4")
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    seen: list[int | None] = []
    real_build = manager_module.build_grammar

    def recording_build(*args, **kwargs):
        seen.append(thread_nice())
        return real_build(*args, **kwargs)

    monkeypatch.setattr(manager_module, "build_grammar", recording_build)
    loop_nice = thread_nice()
    manager = StructuredOutputManager(lambda: tokenizer, 49152, [tokenizer.eos_token_id])
    try:
        manager.submit(StructuredOutputsParams(regex="[0-9]+")).result(timeout=60)
    finally:
        manager.shutdown()
    assert seen == [min(19, loop_nice + 4)]
    assert thread_nice() == loop_nice


def _compile_seconds(manager: StructuredOutputManager, schema: dict) -> float:
    """Seconds ``manager`` takes to compile ``schema``, after its priming (if any) has ended."""
    manager.compiler()
    if manager.primed is not None:
        manager.primed.result(timeout=300)
    start = time.perf_counter()
    manager.submit(StructuredOutputsParams(json=schema)).result(timeout=120)
    return time.perf_counter() - start


def test_priming_caches_the_rules_of_shorter_bounded_strings(tokenizer, monkeypatch):
    """With ``FD_GRAMMAR_PRIME_LENGTH=N`` the compiler, once made, compiles a string of up to N
    characters in the background: a schema whose strings have a shorter ``maxLength`` then finds
    their unrolled rules' token masks in xgrammar's cache and compiles many times faster (~2 against
    ~60 ms on the CI CPU) than on an unprimed compiler, which computes them all."""
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "city": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "city"],
    }
    seconds = {}
    for length in (0, 24):
        monkeypatch.setenv("FD_GRAMMAR_PRIME_LENGTH", str(length))
        manager = StructuredOutputManager(lambda: tokenizer, 49152, [tokenizer.eos_token_id])
        try:
            seconds[length] = _compile_seconds(manager, schema)
            assert (manager.primed is None) == (length == 0)
        finally:
            manager.shutdown()
    assert seconds[24] < seconds[0] / 3, seconds
