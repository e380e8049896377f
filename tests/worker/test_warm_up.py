"""Start-up kernel warm-up (``fastdeploy.worker.warm_up``, ``ModelRunner.warm_up_kernels``): it writes nothing and changes no output.

On a GPU the engine runs it after the KV cache is allocated, so that Triton and
FlashInfer compile their kernel variants then and not in the first requests' steps. On a
CPU it is called here by hand: the same prefills run through the same metadata path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.worker import warm_up
from fastdeploy.worker.warm_up import WARM_UP_QUERY_LENS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpubench.measure import random_prompts  # noqa: E402
from gpubench.settings import MODEL_1B, TINY_OVERRIDES  # noqa: E402

ENGINE = dict(
    model=MODEL_1B, load_format="dummy", skip_tokenizer_init=True, hf_config_overrides=TINY_OVERRIDES,
    dtype="float32", device="cpu", num_threads=1, max_num_seqs=4, max_model_len=96, seed=0,
    max_num_batched_tokens=128,  # (the warm-up runs steps up to it: small for the interpreter)
)  # fmt: skip
PROMPTS = random_prompts(3, 20, TINY_OVERRIDES["vocab_size"], seed=3)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


CPU_TRITON = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the triton backend on a CPU runs in the interpreter only",
)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=CPU_TRITON)])
def test_warm_up_writes_no_cache_and_changes_no_output(backend):
    reference = LLM(attention_backend=backend, **ENGINE)
    try:
        expected = _tokens(reference)
    finally:
        reference.shutdown()

    llm = LLM(attention_backend=backend, **ENGINE)
    try:
        runner = llm.engine.core.executor.worker.runner
        assert runner.attn_backend.name == backend
        assert all(not k.any() and not v.any() for k, v in runner.kv_caches)  # a fresh cache is zeros
        runner.warm_up_kernels()
        assert all(not k.any() and not v.any() for k, v in runner.kv_caches)  # and still is
        assert _tokens(llm) == expected
        assert llm.engine.core.scheduler.kv.usage() == 0
    finally:
        llm.shutdown()


def test_warm_up_lengths_cover_each_block_class_and_respect_the_limits(monkeypatch):
    seen: list[int] = []
    monkeypatch.setattr(warm_up, "warm_up_prefill", lambda runner, n: seen.append(n) or torch.randn(1, 64))
    llm = LLM(**{**ENGINE, "max_model_len": 48, "max_num_batched_tokens": 300})
    try:
        llm.engine.core.executor.worker.runner.warm_up_kernels()
    finally:
        llm.shutdown()
    # up to the step token budget (which is warmed too), each size once
    assert seen == [2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert max(WARM_UP_QUERY_LENS) >= 128  # a prompt long enough for the largest query block


def test_warm_up_compiles_the_grammar_mask_kernel(monkeypatch):
    """The start-up warm-up applies an all-allowing grammar bitmask to scratch logits of the step's
    width, for 1, 2 and 16 rows (the row counts xgrammar's Triton kernel is specialized on), so that
    it compiles then, not in the first structured-output steps."""
    calls = []
    monkeypatch.setattr(
        warm_up, "apply_token_bitmask", lambda logits, mask, rows: calls.append((logits, mask, rows))
    )
    step_logits = torch.randn(3, 100)
    warm_up.warm_up_grammar_mask(step_logits)
    assert [rows.tolist() for _, _, rows in calls] == [[0], [0, 1], list(range(16))]
    for logits, mask, _ in calls:
        assert logits.shape == (16, 100) and logits.data_ptr() != step_logits.data_ptr()
        assert mask.shape == (16, 4) and (mask == -1).all()


def test_a_warm_up_step_past_max_model_len_is_several_requests():
    from fastdeploy.worker.warm_up import warm_up_request_lens

    assert warm_up_request_lens(32, 48) == [32]
    assert warm_up_request_lens(300, 48) == [48] * 6 + [12]
    assert warm_up_request_lens(96, 48) == [48, 48]


def test_warm_up_of_a_step_of_several_requests_writes_no_cache():
    """A warm-up step larger than max_model_len runs as several requests and leaves the cache empty."""
    llm = LLM(**{**ENGINE, "max_model_len": 48, "max_num_batched_tokens": 200})
    try:
        runner = llm.engine.core.executor.worker.runner
        warm_up.warm_up_prefill(runner, 200)
        assert all(not k.any() and not v.any() for k, v in runner.kv_caches)
    finally:
        llm.shutdown()


def _compile_log(monkeypatch) -> list[str]:
    """The names of the Triton kernels compiled from now on (skips without triton's JIT hooks)."""
    triton = pytest.importorskip("triton")
    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip("this triton has no JIT hooks (triton.knobs)")
    compiled: list[str] = []
    monkeypatch.setattr(
        triton.knobs.runtime, "jit_post_compile_hook", lambda *a, **kw: compiled.append(kw.get("repr", ""))
    )
    return compiled


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_first_requests_compile_no_attention_kernel_on_a_gpu(enforce_eager, monkeypatch):
    """After start-up, prompts and decode batches of new sizes find their kernels compiled."""
    compiled = _compile_log(monkeypatch)
    llm = LLM(**{**ENGINE, "device": "cuda", "dtype": "bfloat16", "attention_backend": "triton",
                 "enforce_eager": enforce_eager, "max_num_seqs": 8})  # fmt: skip
    try:
        compiled.clear()  # what start-up compiled (nothing if an earlier engine of this process did)
        for batch in (1, 3, 8):
            llm.generate(random_prompts(batch, 40, TINY_OVERRIDES["vocab_size"], seed=batch), GREEDY)
        attention = [name for name in compiled if "_unified_kernel" in name or "_decode" in name]
        assert attention == []
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_moe_steps_past_max_model_len_compile_nothing_after_start_up(monkeypatch):
    """A MoE engine whose max_model_len is below its token budget: a burst that fills whole steps
    of several requests compiles no kernel after start-up (the warm-up runs steps up to the budget;
    before, the expert sort's larger chunk class compiled in the first requests' steps)."""
    compiled = _compile_log(monkeypatch)
    vocab = 1024
    llm = LLM(
        model=str(ROOT / "benchmarks" / "configs" / "qwen3-30b-a3b"), load_format="dummy",
        skip_tokenizer_init=True, hf_config_overrides={"num_hidden_layers": 2, "vocab_size": vocab},
        device="cuda", dtype="bfloat16", max_model_len=256, max_num_batched_tokens=4096, max_num_seqs=64,
        seed=0,
    )  # fmt: skip
    try:
        compiled.clear()
        prompts = random_prompts(48, 200, vocab, seed=5)  # 9,600 prompt tokens: whole 4,096-token steps
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert compiled == []
    finally:
        llm.shutdown()


def test_profile_run_covers_the_whole_token_budget(monkeypatch):
    """The memory profile runs the whole step budget, past max_model_len as several prompts whose
    positions stay inside the context (a CUDA-only call at start-up; here called directly)."""
    llm = LLM(**{**ENGINE, "max_model_len": 48, "max_num_batched_tokens": 200})
    try:
        runner = llm.engine.core.executor.worker.runner
        seen = []

        class Spy:  # the model, recording the positions of each forward
            def __init__(self, model):
                self.model = model

            def __call__(self, ids, positions):
                seen.append(positions)
                return self.model(ids, positions)

            def __getattr__(self, name):
                return getattr(self.model, name)

        monkeypatch.setattr(runner, "model", Spy(runner.model))
        runner.profile_run()
        (positions,) = seen
        assert len(positions) == 200 and int(positions.max()) == 47
        assert positions.tolist()[:50] == list(range(48)) + [0, 1]
    finally:
        llm.shutdown()
