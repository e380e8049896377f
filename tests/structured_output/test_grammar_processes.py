"""Grammars and matchers in helper processes (``FD_GRAMMAR_PROCESSES``): the masks they fill into
shared memory equal those of matchers advanced here, refused tokens and ended grammars are
handled as in one process, an invalid constraint fails with xgrammar's message, and a process
that dies lifts only its own rows. Real processes (the engine's ``ChildProcess``), two of them."""

from __future__ import annotations

import gc
import json
import os

import numpy as np
import pytest
import xgrammar as xgr

from fastdeploy.core.sampling_params import StructuredOutputsParams
from fastdeploy.engine.ipc import ChildProcess
from fastdeploy.structured_output.grammar import build_grammar
from fastdeploy.structured_output.grammar_processes import (
    RemoteCompiled,
    RemoteGrammar,
    grammar_process_count,
)
from fastdeploy.structured_output.manager import StructuredOutputManager

WORDS = ["alpha", "bravo", "charlie", "delta"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def tokenizer(request):
    """The default model's tokenizer; on the GPU host, where the model is not carried, the copy of
    it that tools/gpu_env.sh unpacks (``TOK``)."""
    gpu_copy = os.environ.get("TOK", "")
    if gpu_copy and os.path.isdir(gpu_copy):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(gpu_copy)
    request.getfixturevalue("default_model_path")
    from fastdeploy.config import EngineConfig
    from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

    config = EngineConfig()
    return load_tokenizer(config.model, resolve_model(config.model))


def two_process_manager(tokenizer, pin_memory: bool = False) -> StructuredOutputManager:
    """A manager whose grammars and matchers live in two grammar processes (real ones)."""
    return StructuredOutputManager(
        lambda: tokenizer,
        len(tokenizer),
        [tokenizer.eos_token_id],
        pin_memory=pin_memory,
        max_rows=16,
        start_process=ChildProcess,
        num_processes=2,
    )


@pytest.fixture
def manager(tokenizer, monkeypatch):
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    manager = two_process_manager(tokenizer)
    yield manager
    manager.shutdown()


def _local_matcher(manager: StructuredOutputManager, kind: str, text: str, eos: int) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(
        manager.compiler().compile_grammar(build_grammar(kind, text)), override_stop_tokens=[eos]
    )


def test_masks_equal_matchers_advanced_here(manager, tokenizer):
    eos = tokenizer.eos_token_id
    choice = manager.submit(StructuredOutputsParams(choice=WORDS)).result(timeout=120)
    schema = manager.submit(StructuredOutputsParams(json=SCHEMA)).result(timeout=120)
    assert isinstance(choice, RemoteCompiled) and isinstance(schema, RemoteCompiled)
    answers = [tokenizer.encode(w, add_special_tokens=False) + [eos] for w in WORDS[:3]]
    answers.append(tokenizer.encode('{"n": 42}', add_special_tokens=False) + [eos])
    grammars = [manager.new_request_grammar(choice, [eos]) for _ in range(3)]
    grammars.append(manager.new_request_grammar(schema, [eos]))
    assert all(isinstance(g, RemoteGrammar) for g in grammars)
    local = [_local_matcher(manager, "choice", json.dumps(WORDS), eos) for _ in range(3)]
    local.append(_local_matcher(manager, "json", json.dumps(SCHEMA, separators=(",", ":")), eos))
    reference = xgr.allocate_token_bitmask(1, len(tokenizer))
    ids = [str(i) for i in range(4)]
    for step in range(max(len(a) for a in answers) + 1):
        mask = manager.bitmask(ids, grammars).array()
        for row, (matcher, answer) in enumerate(zip(local, answers)):
            if matcher.is_terminated():  # ended: only the stop tokens may follow
                allowed = np.flatnonzero(np.unpackbits(mask[row].view(np.uint8), bitorder="little"))
                assert allowed.tolist() == [eos] and grammars[row].ended
            else:
                matcher.fill_next_token_bitmask(reference, 0)
                assert np.array_equal(mask[row], reference[0].numpy()), (step, row)
            if step < len(answer):
                assert matcher.accept_token(answer[step])
                grammars[row].accept_token(answer[step])
    assert manager.num_compiles == 2


def test_a_refused_token_lifts_only_its_row(manager, tokenizer):
    eos = tokenizer.eos_token_id
    choice = manager.submit(StructuredOutputsParams(choice=WORDS)).result(timeout=120)
    grammars = [manager.new_request_grammar(choice, [eos]) for _ in range(2)]
    manager.bitmask(["a", "b"], grammars)
    grammars[0].accept_token(tokenizer.encode(" zebra", add_special_tokens=False)[0])
    grammars[1].accept_token(tokenizer.encode("alpha", add_special_tokens=False)[0])
    mask = manager.bitmask(["a", "b"], grammars).array()
    assert grammars[0].failed and (mask[0] == -1).all()
    assert not grammars[1].failed and not (mask[1] == -1).all()
    mask = manager.bitmask(["a", "b"], grammars).array()  # lifted from then on
    assert (mask[0] == -1).all()


def test_an_invalid_constraint_fails_with_the_message(manager):
    future = manager.submit(StructuredOutputsParams(grammar="root ::= undefined_rule"))
    with pytest.raises(ValueError, match="undefined_rule"):
        future.result(timeout=120)


def test_a_stopped_process_lifts_its_rows_and_starts_again(manager, tokenizer):
    """A grammar process that dies (a crash) lifts the masks of its requests; the next compile
    for it starts it again, and what it had compiled is compiled again there, not reused."""
    eos = tokenizer.eos_token_id
    params = StructuredOutputsParams(choice=WORDS)
    first = manager.submit(params)
    compiled = first.result(timeout=120)
    grammar = manager.new_request_grammar(compiled, [eos])
    pool = manager.processes()
    old_pid = pool._procs[compiled.process].pid
    pool._procs[compiled.process].kill_and_wait()
    mask = manager.bitmask(["a"], [grammar]).array()
    assert grammar.failed and (mask[0] == -1).all()
    assert not manager.is_usable(first)
    again = manager.submit(params)
    assert again is not first
    recompiled = again.result(timeout=120)
    assert recompiled.process == compiled.process and recompiled.generation == compiled.generation + 1
    assert pool._procs[compiled.process].pid != old_pid and manager.is_usable(again)
    assert manager.submit(params) is again  # (cached again)
    fresh = manager.new_request_grammar(recompiled, [eos])
    word = tokenizer.encode("alpha", add_special_tokens=False)
    reference = _local_matcher(manager, "choice", json.dumps(WORDS), eos)
    expected = xgr.allocate_token_bitmask(1, len(tokenizer))
    for token in word:
        mask = manager.bitmask(["b"], [fresh]).array()
        reference.fill_next_token_bitmask(expected, 0)
        assert not fresh.failed and np.array_equal(mask[0], expected[0].numpy())
        assert reference.accept_token(token)
        fresh.accept_token(token)
    # a grammar of the old start, its process running again: still lifted, the new one's not
    mask = manager.bitmask(["a", "b"], [grammar, fresh]).array()
    assert (mask[0] == -1).all() and not fresh.failed and not (mask[1] == -1).all()


def test_a_grammar_the_process_no_longer_holds_lifts_only_its_row(manager, tokenizer):
    eos = tokenizer.eos_token_id
    compiled = manager.submit(StructuredOutputsParams(choice=WORDS)).result(timeout=120)
    lost = manager.processes().new_grammar(RemoteCompiled(10**6, compiled.process), [eos])
    kept = manager.new_request_grammar(compiled, [eos])
    mask = manager.bitmask(["lost", "kept"], [lost, kept]).array()
    assert lost.failed and (mask[0] == -1).all()
    assert not kept.failed and 0 < np.unpackbits(mask[1].view(np.uint8)).sum() < len(tokenizer)


def test_finished_requests_free_their_matchers_in_the_process(manager, tokenizer):
    eos = tokenizer.eos_token_id
    compiled = manager.submit(StructuredOutputsParams(choice=WORDS)).result(timeout=120)
    pool = manager.processes()
    grammars = [manager.new_request_grammar(compiled, [eos]) for _ in range(5)]
    manager.bitmask([str(i) for i in range(5)], grammars)
    assert pool.matcher_counts[compiled.process] == 5
    kept = grammars[0]
    del grammars  # four requests end (and one that never had a mask: made and freed in one step)
    gone = manager.new_request_grammar(compiled, [eos])
    del gone
    gc.collect()
    manager.bitmask(["kept"], [kept])
    assert pool.matcher_counts[compiled.process] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("pinned_later", [False, True])
def test_page_locked_masks_for_a_worker_on_the_gpu(tokenizer, monkeypatch, pinned_later):
    """With the worker on a GPU in the engine's process, the shared mask buffers are page-locked
    (asked for at the start, or once the processes run: the engine starts them before its worker):
    the mask goes to the device as it is, and reads back the same."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    eos = tokenizer.eos_token_id
    manager = two_process_manager(tokenizer, pin_memory=not pinned_later)
    try:
        if pinned_later:
            manager.start_processes_soon().result(timeout=120)
            manager.pin_masks()
        compiled = manager.submit(StructuredOutputsParams(choice=WORDS)).result(timeout=120)
        grammars = [manager.new_request_grammar(compiled, [eos]) for _ in range(3)]
        bitmask = manager.bitmask(["a", "b", "c"], grammars)
        assert bitmask.tensor.is_pinned()
        on_device = bitmask.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), torch.from_numpy(bitmask.array().copy()))
    finally:
        manager.shutdown()


def test_processes_keep_the_engine_priority_and_lower_only_their_compiles(manager, tokenizer):
    """Each process's mask loop (on every step's path) runs at the engine's priority; only its
    compile thread runs ``FD_GRAMMAR_COMPILE_NICE`` lower (children inherit the nice value of the
    thread that starts them, so the engine must not start them from a lowered thread)."""
    from fastdeploy.envs import FD_GRAMMAR_COMPILE_NICE
    from fastdeploy.platforms.thread_priority import nice_is_permitted, thread_nice

    if not nice_is_permitted():
        pytest.skip("per-thread nice is Linux's, where setpriority is permitted")

    manager.submit(StructuredOutputsParams(json=SCHEMA)).result(timeout=120)
    engine_nice = os.getpriority(os.PRIO_PROCESS, 0)
    for proc in manager.processes()._procs:
        threads = {int(task): thread_nice(int(task)) for task in os.listdir(f"/proc/{proc.pid}/task")}
        assert threads[proc.pid] == engine_nice  # the main thread: the mask loop
        assert min(19, engine_nice + FD_GRAMMAR_COMPILE_NICE) in threads.values()  # the compile thread


def _grammar_children(before: frozenset[int] = frozenset()) -> list:
    """This process's grammar processes still running, but those whose pid is in ``before`` (another
    test's, maybe still exiting)."""
    import psutil

    kids = psutil.Process().children(recursive=True)
    return [
        p
        for p in kids
        if p.pid not in before and p.is_running() and any("fastdeploy-grammar" in a for a in _cmdline(p))
    ]


def _cmdline(proc) -> list[str]:
    import psutil

    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def test_processes_start_soon_without_a_compile(tokenizer, monkeypatch):
    """``start_processes_soon`` (the engine core calls it at start-up) starts them in the background,
    so that the first structured request does not wait seconds for them; shut down, they exit."""
    import time

    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    before = frozenset(p.pid for p in _grammar_children())
    manager = two_process_manager(tokenizer)
    try:
        manager.start_processes_soon()
        end = time.monotonic() + 120
        while len(_grammar_children(before)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(_grammar_children(before)) == 2
        assert manager.num_compiles == 0
        assert manager.submit(StructuredOutputsParams(json=SCHEMA)).result(timeout=120) is not None
    finally:
        manager.shutdown()
    end = time.monotonic() + 60
    while _grammar_children(before) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _grammar_children(before)


def test_a_shutdown_during_their_start_leaves_no_process(tokenizer, monkeypatch):
    import time

    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar")
    before = frozenset(p.pid for p in _grammar_children())
    manager = two_process_manager(tokenizer)
    started = manager.start_processes_soon()
    manager.shutdown()
    if not started.cancelled():  # (began before the shutdown: it ends by shutting its processes down)
        started.result(timeout=120)
    end = time.monotonic() + 60
    while _grammar_children(before) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _grammar_children(before)
    with pytest.raises(RuntimeError, match="shut down"):
        manager.processes()


@pytest.mark.parametrize(
    ("setting", "cores", "engines", "on_gpu", "expected"),
    [
        (2, 4, 1, False, 2),  # asked for: always
        (0, 64, 1, True, 0),
        (-3, 64, 1, True, 0),
        (None, 64, 1, False, 0),  # auto on a CPU: threads (the forward's threads take the cores)
        (None, 16, 1, True, 8),  # auto on a GPU host with cores to spare
        (None, 64, 4, True, 8),
        (None, 15, 1, True, 0),
        (None, 32, 4, True, 0),  # four replicas' engine cores share 32 cores
    ],
)
def test_how_many_grammar_processes(monkeypatch, setting, cores, engines, on_gpu, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False)
    assert grammar_process_count(setting, engines, on_gpu) == expected
