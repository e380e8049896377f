"""The MoE, FP8 quantization and FP8 linear kernels of a batch-256 decode step compile for Hopper
(sm_90) with programmatic dependent launch and without spilling registers, on any machine
(:mod:`sm90_compile`; ``test_triton_fp8_compile.py``, a slow test, compiles every FP8 linear
configuration, this one the step's in a few seconds).
"""

from __future__ import annotations

import json

from sm90_compile import compile_sm90, run_compile_script, spills

I32, I64, BF16, FP8, FP32 = "*i32", "*i64", "*bf16", "*fp8e4nv", "*fp32"
QUANT = dict(FP8_MAX_C=448.0, MIN_AMAX_C=1e-12, USE_PDL=True)

# (module, kernel, pointer types, constexprs, warps, stages): the shapes of Qwen3-30B-A3B's decode batch
CASES = [
    ("triton_moe_align_atomic", "_rank_kernel", dict(ids_ptr=I64, counts_ptr=I32, ranks_ptr=I32),
     dict(BLOCK=1024, USE_PDL=True), 8, 3),
    ("triton_moe_align_atomic", "_layout_kernel",
     dict(counts_ptr=I32, starts_ptr=I32, sorted_ptr=I32, expert_ids_ptr=I32, num_padded_ptr=I32, ids_ptr=I64,
          ranks_ptr=I32),
     dict(BLOCK_E=128, BLOCK_M=64, PLACE=True, BLOCK=1024, USE_PDL=True), 8, 3),
    ("triton_moe_align_atomic", "_place_kernel", dict(ids_ptr=I64, ranks_ptr=I32, starts_ptr=I32, sorted_ptr=I32),
     dict(BLOCK=1024, USE_PDL=True), 8, 3),
    ("triton_moe_routing", "_align_kernel",
     dict(ids_ptr=I64, sorted_ptr=I32, expert_ids_ptr=I32, num_padded_ptr=I32),
     dict(SUB=32, BLOCK_E=128, BLOCK_M=16, USE_PDL=True), 4, 3),
    ("triton_moe_routing", "_topk_softmax_kernel",
     dict(logits_ptr=BF16, bias_ptr=BF16, weights_ptr=BF16, ids_ptr=I64, counts_ptr=I64, pair_counts_ptr=I32,
          ranks_ptr=I32),
     dict(SPLITS=1, ROUND_TO="bfloat16", TOP_K=8, BLOCK_K=8, BLOCK_E=128, HAS_BIAS=False, RENORMALIZE=True,
          HAS_COUNTS=True, HAS_RANKS=True, USE_PDL=True), 1, 3),
    ("triton_fp8_quant", "_token_quant_kernel", dict(x_ptr=BF16, q_ptr=FP8, s_ptr=FP32), dict(BLOCK=1024, **QUANT),
     4, 3),
    ("triton_fp8_quant", "_group_quant_kernel", dict(x_ptr=BF16, q_ptr=FP8, s_ptr=FP32),
     dict(GROUP=128, BLOCK=128, **QUANT), 4, 3),
    ("triton_fp8_quant", "_add_rms_norm_quant_kernel",
     dict(x_ptr=BF16, r_ptr=BF16, w_ptr=BF16, q_ptr=FP8, s_ptr=FP32, y_ptr=BF16, eps="fp32"),
     dict(HAS_RESIDUAL=True, STORE_NORMED=True, BLOCK=2048, **QUANT), 4, 3),
    ("triton_moe_act", "_silu_mul_quant_kernel", dict(gu_ptr=BF16, ids_ptr=I64, q_ptr=FP8, s_ptr=FP32),
     dict(WIDTH=768, BLOCK=1024, SKIP=False, **QUANT), 4, 3),
    ("triton_moe_act", "_sum_pairs_kernel", dict(x_ptr=BF16, ids_ptr=I64, out_ptr=BF16),
     dict(TOP_K=8, BLOCK=1024, SKIP=True, USE_PDL=True), 4, 3),
    ("triton_moe_act", "_silu_and_mul_pairs_kernel", dict(gu_ptr=BF16, ids_ptr=I64, out_ptr=BF16),
     dict(BLOCK=1024, USE_PDL=True), 4, 3),
    ("triton_fp8_gemm", "_fp8_block_gemm_kernel",
     dict(a_ptr=FP8, b_ptr=FP8, c_ptr=BF16, a_scale_ptr=FP32, b_scale_ptr=FP32, bias_ptr=BF16),
     dict(GROUP_N=1, GROUP_K=1, CHANNEL=True, HAS_BIAS=False, DOT_FP32=False, EVEN_K=True, BLOCK_M=64,
          BLOCK_N=64, BLOCK_K=256, GROUP_M=8, USE_PDL=True), 4, 4),
    ("triton_fp8_gemv", "_fp8_gemv_kernel",  # the w8a16 dot form at a decode batch's 256 rows
     dict(x_ptr=BF16, w_ptr=FP8, s_ptr=FP32, b_ptr=BF16, out_ptr=BF16, r_ptr=BF16, r_out_ptr=BF16, nw_ptr=BF16,
          eps="fp32"),
     dict(M_PAD=256, GROUP_N=1, GROUP_K=0, HAS_BIAS=False, SILU_MUL=False, NORM=False, HAS_RES=False, BLOCK_N=128,
          BLOCK_K=128, DOT=True, STAGES=4, BLOCK_M=64, DOT_FP32=False, EVEN_K=True, USE_PDL=True), 4, 4),
]  # fmt: skip


def _compile_all() -> dict[str, dict[str, int]]:
    """Compiles every case for sm_90 (run without the interpreter): ``{case: usage}``."""
    import importlib

    import triton.language as tl

    results = {}
    for module, name, pointers, constexprs, warps, stages in CASES:
        kernel = getattr(importlib.import_module(f"fastdeploy.ops.{module}"), name)
        constexprs = {k: getattr(tl, v) if k == "ROUND_TO" else v for k, v in constexprs.items()}
        options = dict(num_warps=warps, num_stages=stages, launch_pdl=True)
        results[f"{module}.{name}"] = compile_sm90(kernel, pointers, constexprs, options)
    return results


def test_kernels_compile_for_sm90():
    results = run_compile_script(__file__, timeout=300)
    assert len(results) == len(CASES)
    assert not spills(results), f"register spills on sm_90: {spills(results)}"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
