"""FP8 weights through the whole engine on a GPU: the decode steps run the w8a16 GEMV (with its
norm prologue for qkv / gate_up and its SiLU prologue for down_proj), inside CUDA graphs as
eagerly, with the same greedy tokens."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.mark.gpu
def test_fp8_decode_runs_the_gemv_and_graphs_give_the_eager_tokens(default_model_path):
    """Default model, ``quantization="fp8"`` (128 x 128 blocks; hidden 576 leaves a partial K
    block), batches of one and two. Eager decode and graph replays run the same FP8 kernels (the
    GEMV up to ``FD_FP8_SMALL_M_MAX`` rows in both), so their greedy tokens agree; 20 tokens,
    as in test_cuda_graphs (bf16 near-ties may flip later)."""
    from fastdeploy import LLM, SamplingParams
    from fastdeploy.ops import triton_fp8_gemv
    from fastdeploy.ops._ext import has_cuda_ops

    if not has_cuda_ops() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs the compiled fastdeploy_ops and compute capability 8.9")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    batches = [["The capital of France is"], ["def add(a, b):", "Once upon a time"]]
    results = {}
    for eager in (True, False):
        triton_fp8_gemv._warmed.clear()
        llm = LLM(
            model=default_model_path, dtype="bfloat16", device="cuda", quantization="fp8", enforce_eager=eager, max_num_seqs=4,
            gpu_memory_utilization=0.3,
        )  # fmt: skip
        results[eager] = [[o.outputs[0].token_ids for o in llm.generate(b, params)] for b in batches]
        warmed = set(triton_fp8_gemv._warmed)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        assert any(key[0] == 1 and key[-2] == "" for key in warmed), warmed  # plain GEMV at 1 row (o_proj)
        assert any(key[0] == 1 and key[-2] == "silu" for key in warmed), warmed  # down_proj with SiLU
        assert any(key[0] == 1 and key[-2] == "norm-add" for key in warmed), (
            warmed
        )  # qkv / gate_up with the norm
    assert results[False] == results[True]
