"""The Triton attention kernels compile for Hopper (sm_90) without spilling registers, on any machine.

The CPU interpreter accepts code that the compiler rejects (loop-carried type changes,
unsupported dot shapes), so this test compiles the kernels ahead of time for sm_90 with
Triton's bundled ptxas, in a subprocess without ``TRITON_INTERPRET``, and reads the
register and stack usage with the bundled ``cuobjdump``. No GPU is needed.
"""

from __future__ import annotations

import json

from sm90_compile import compile_sm90, run_compile_script, spills

PTR_TYPES = {
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_ptr": "*i32",
    "limits_ptr": "*i32",
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
}
NOT_ALIGNED = ("stride_ss", "stride_bt")
"""Integer arguments that need not be multiples of 16 (all other strides and pointers are, in practice)."""

# (kernel, query dtype, cache dtype, head_dim, group, max_query_len, NUM_SPLITS)
CASES = [
    ("unified", "bf16", "bf16", 128, 4, 512, 0),
    ("unified", "fp16", "fp8e4nv", 256, 8, 1, 0),
    ("unified", "fp32", "fp32", 64, 1, 512, 0),
    ("unified", "fp16", "fp8e4nv", 128, 4, 16, 0),
    ("unified", "bf16", "bf16", 256, 2, 512, 0),
    ("decode", "bf16", "bf16", 128, 8, 1, 8),
    ("decode", "bf16", "bf16", 128, 4, 1, 1),
    ("decode", "fp16", "fp16", 256, 4, 1, 2),
    ("decode", "bf16", "fp8e4nv", 64, 1, 1, 1),
    ("reduce", "bf16", "bf16", 128, 1, 1, 16),
]


def _compile_all() -> dict[str, dict]:
    """Compiles every case for sm_90; returns ``{case: {"regs": n, "stack": bytes}}`` (runs without the interpreter)."""
    import torch

    from fastdeploy.ops import triton_attention as ta

    torch_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    results = {}
    for kind, q_type, cache_type, head_dim, group, max_query_len, splits in CASES:
        fp8 = cache_type == "fp8e4nv"
        shared = dict(GROUP=group, HEAD_DIM=head_dim, FP8=fp8, HAS_LIMITS=True, DOT_FP32=False)
        shared["DOT_PRECISION"] = "ieee" if q_type == "fp32" else "tf32"
        if kind == "unified":
            kernel, constexprs = (
                ta._unified_kernel,
                ta.unified_config(torch_dtypes[q_type], head_dim, group, max_query_len),
            )
        elif kind == "decode":
            programs = 1 << 20 if splits == 1 else 0  # a large batch (small tiles), else a small one
            kernel, constexprs = (
                ta._decode_kernel,
                ta.decode_config(torch_dtypes[q_type], head_dim, group, programs),
            )
            constexprs["NUM_SPLITS"] = splits
        else:
            kernel, constexprs, shared = ta._decode_reduce_kernel, {"num_warps": 4}, {}
            constexprs.update(HEAD_DIM=head_dim, NUM_SPLITS=splits)
        options = {"num_warps": constexprs.pop("num_warps")}
        if "num_stages" in constexprs:
            options["num_stages"] = constexprs.pop("num_stages")
        types = {"out_ptr": f"*{q_type}", "q_ptr": f"*{q_type}", "k_cache_ptr": f"*{cache_type}"}
        types.update(v_cache_ptr=types["k_cache_ptr"], qk_scale="fp32", **PTR_TYPES)
        types.update(
            k_scale_ptr="*fp32" if fp8 else types["k_cache_ptr"],
            v_scale_ptr="*fp32" if fp8 else types["k_cache_ptr"],
        )
        for interior in (False, True) if kind != "reduce" else (None,):
            if interior is not None:  # the unmasked interior tiles (SPLIT_INTERIOR) or not
                constexprs["SPLIT_INTERIOR"] = interior
            key = f"{kind}-{q_type}-{cache_type}-d{head_dim}-g{group}-q{max_query_len}-s{splits}-i{interior}"
            results[key] = compile_sm90(kernel, types, {**shared, **constexprs}, options, NOT_ALIGNED)
    return results


def test_kernels_compile_for_sm90_without_spills():
    results = run_compile_script(__file__, timeout=300)
    assert len(results) == 2 * len(CASES) - sum(case[0] == "reduce" for case in CASES)
    assert not spills(results), f"register spills on sm_90: {spills(results)}"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
