"""Small non-decode steps padded to a captured token size (``--cuda-graph-max-tokens``).

On a CPU nothing is captured: :class:`MixedStepGraphs` runs the same padded forward eagerly, with
the Triton attention backend in Triton's interpreter, so the padding (extra tokens owned by an
empty request, request slots past the step's) is checked here against plain eager steps; on a
GPU the replayed graphs are checked against eager mode (the ``gpu`` test below).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
from fastdeploy.worker import forward_stats
from fastdeploy.worker.mixed_graphs import MixedStepGraphs, mixed_token_sizes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpubench.measure import random_prompts  # noqa: E402
from gpubench.settings import MODEL_1B, TINY_OVERRIDES  # noqa: E402

ENGINE = dict(
    model=MODEL_1B, load_format="dummy", skip_tokenizer_init=True, hf_config_overrides=TINY_OVERRIDES,
    dtype="float32", device="cpu", num_threads=1, max_num_seqs=4, max_model_len=96, seed=0,
    max_num_batched_tokens=48, attention_backend="triton",
)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

CPU_TRITON = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the triton backend on a CPU runs in the interpreter only",
)


def test_forward_stats_count_paths_and_log_once_a_minute(monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr(forward_stats.time, "monotonic", lambda: clock[0])
    stats = forward_stats.ForwardStats()
    with caplog.at_level(logging.INFO, logger=forward_stats.__name__):
        stats.note("decode_graph", 8)
        stats.note("eager", 600)
        assert not caplog.records  # not a minute yet
        clock[0] += 61
        stats.note("mixed_graph", 20)
        clock[0] += 61
        stats.note("decode_graph", 8)
    assert stats.steps == {"decode_graph": 2, "mixed_graph": 1, "eager": 1}
    assert stats.tokens == {"decode_graph": 16, "mixed_graph": 20, "eager": 600}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == (
        "forward passes since start: decode_graph 1 (8 tokens), mixed_graph 1 (20 tokens), eager 1 (600 tokens)"
    )


def test_token_sizes_double_to_256_then_grow_by_128_up_to_the_maximum():
    assert mixed_token_sizes(512) == [16, 32, 64, 128, 256, 384, 512]
    assert mixed_token_sizes(1000) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1000]
    assert mixed_token_sizes(100) == [16, 32, 64, 100]
    assert mixed_token_sizes(16) == [16]
    assert mixed_token_sizes(8) == [8]


def _prompts() -> list[list[int]]:
    """Three prompts of 20 tokens, then one that shares 16 of the first one's (a prefix-cache hit)
    and one of 70 tokens (prefilled in chunks of the 48-token budget, beside decodes)."""
    base = random_prompts(3, 20, TINY_OVERRIDES["vocab_size"], seed=3)
    longer = random_prompts(1, 70, TINY_OVERRIDES["vocab_size"], seed=4)
    return [*base, base[0][:16] + [7, 8, 9, 10, 11], *longer]


def _run(llm: LLM) -> tuple[list[list[int]], list[tuple[torch.Tensor, torch.Tensor]]]:
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), GREEDY)]
    caches = [(k.clone(), v.clone()) for k, v in llm.engine.core.executor.worker.runner.kv_caches]
    return tokens, caches


@CPU_TRITON
def test_padded_steps_give_the_eager_tokens_and_write_only_their_own_slots(monkeypatch):
    reference = LLM(**ENGINE)
    try:
        expected, expected_caches = _run(reference)
    finally:
        reference.shutdown()

    llm = LLM(**ENGINE, cuda_graph_max_tokens=32)
    try:
        runner = llm.engine.core.executor.worker.runner
        assert runner.mixed_graphs is None  # nothing is captured on a CPU
        runner.mixed_graphs = runner.new_mixed_graphs()
        assert runner.mixed_graphs.sizes == [16, 32] and runner.mixed_graphs.max_reqs == 4
        served: list[tuple[int, int, int]] = []
        run = MixedStepGraphs.run

        def counting(self, input_ids, positions, common, size):
            served.append((common.num_actual_tokens, common.num_reqs, size))
            return run(self, input_ids, positions, common, size)

        monkeypatch.setattr(MixedStepGraphs, "run", counting)
        tokens, caches = _run(llm)
        stats = runner.forward_stats
    finally:
        llm.shutdown()
    assert tokens == expected
    # the runner's counts of its forward paths agree with what the graphs served (no decode
    # graphs on a CPU: decode steps are small steps too) and the steps over 32 tokens ran eagerly
    assert stats.steps["mixed_graph"] == len(served) and stats.steps["decode_graph"] == 0
    assert stats.tokens["mixed_graph"] == sum(t for t, _, _ in served)
    assert stats.steps["eager"] > 0 and stats.tokens["eager"] > 32 * stats.steps["eager"] - 1
    # prefills, chunks beside decodes and decodes went through the padded forward, at both sizes,
    # and steps over 32 tokens did not
    assert {size for _, _, size in served} == {16, 32}
    assert any(t < size for t, _, size in served)  # padding tokens
    assert any(reqs > 1 and t > reqs for t, reqs, _ in served)  # a prompt beside decodes
    for (k, v), (ek, ev) in zip(caches, expected_caches):
        assert torch.equal(k != 0, ek != 0) and torch.equal(v != 0, ev != 0)  # no padding writes
        torch.testing.assert_close(k, ek, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ev, rtol=1e-5, atol=1e-5)


@CPU_TRITON
def test_steps_that_do_not_fit_are_refused():
    llm = LLM(**ENGINE, cuda_graph_max_tokens=32)
    try:
        graphs = llm.engine.core.executor.worker.runner.new_mixed_graphs()
    finally:
        llm.shutdown()
    width = graphs.block_table.shape[1]

    def step(tokens: int, reqs: int, blocks: int = width, mask: bool = False) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=reqs, num_actual_tokens=tokens, query_start_loc=torch.zeros(reqs + 1, dtype=torch.int32),
            seq_lens=torch.zeros(reqs, dtype=torch.int32), block_table=torch.zeros(reqs, blocks, dtype=torch.int32),
            slot_mapping=torch.zeros(tokens, dtype=torch.int64), query_start_loc_cpu=None, seq_lens_cpu=None,
            max_query_len=tokens, max_seq_len=tokens, block_size=16,
            attn_mask_offsets=torch.zeros(tokens, dtype=torch.int32) if mask else None,
        )  # fmt: skip

    assert graphs.padded_size(step(1, 1)) == 16
    assert graphs.padded_size(step(17, 2)) == 32
    assert graphs.padded_size(step(33, 2)) is None  # too many tokens
    assert graphs.padded_size(step(8, 5)) is None  # more requests than slots
    assert graphs.padded_size(step(8, 1, blocks=width + 1)) is None
    assert graphs.padded_size(step(8, 1, mask=True)) is None  # bidirectional image tokens


def test_no_graphs_unless_asked_for_and_the_backend_allows():
    llm = LLM(**{**ENGINE, "attention_backend": "torch"}, cuda_graph_max_tokens=32)
    try:
        assert llm.engine.core.executor.worker.runner.new_mixed_graphs() is None  # host-sliced attention
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_mixed_graphs_give_the_eager_tokens():
    """Llama-3.2-1B's shape with dummy weights in float32 on the GPU (where the tile configuration of
    a padded step changes sums at 1e-7, far below the gaps between dummy logits): greedy tokens with
    the small steps' graphs replayed equal those of eager small steps (decode graphs in both)."""
    from fastdeploy.ops._ext import has_cuda_ops

    if not has_cuda_ops():
        pytest.skip("CUDA graphs need the compiled fastdeploy_ops")
    prompts = [p for n in (5, 20, 60, 200, 7) for p in random_prompts(1, n, 30000, seed=n)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for max_tokens in (0, 128):
        llm = LLM(
            model=str(ROOT / "benchmarks/configs/llama-3.2-1b"), load_format="dummy", skip_tokenizer_init=True,
            dtype="float32", device="cuda", attention_backend="triton", max_num_seqs=8,
            max_num_batched_tokens=256, max_model_len=512, gpu_memory_utilization=0.3,
            cuda_graph_max_tokens=max_tokens,
        )  # fmt: skip
        runner = llm.engine.core.executor.worker.runner
        assert (runner.mixed_graphs is None) == (max_tokens == 0)
        if runner.mixed_graphs is not None:
            assert sorted(runner.mixed_graphs.graphs) == [16, 32, 64, 128]
        results[max_tokens] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        llm.shutdown()
        del llm, runner  # the runner holds the weights and the KV cache
        gc.collect()
        torch.cuda.empty_cache()
    assert results[128] == results[0]


@CPU_TRITON
def test_a_failed_capture_leaves_the_steps_eager(monkeypatch):
    llm = LLM(**ENGINE, cuda_graph_max_tokens=32)
    try:
        graphs = llm.engine.core.executor.worker.runner.new_mixed_graphs()
    finally:
        llm.shutdown()

    def refuse(self, pool=None):
        self.graphs[16] = ("a graph", None)  # half-way through
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(MixedStepGraphs, "capture", refuse)
    assert graphs.try_capture() is False and graphs.graphs == {}
