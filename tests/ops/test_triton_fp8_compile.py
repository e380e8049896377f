"""The FP8 linear's Triton kernels compile for Hopper (sm_90) without spilling registers, on any machine.

The CPU interpreter accepts code the compiler rejects (type changes across branches, dot
shapes, fp8 conversions), so this compiles, in a subprocess without ``TRITON_INTERPRET`` and
with Triton's bundled ptxas, every configuration the w8a16 GEMV autotunes over at the largest
row count each may get (and the SiLU prologue, per-channel and fp32 variants), the w8a8 GEMM's
tables (block-scaled and per-channel), and the activation quantization kernels (the norm + quantization one too); then reads the register and stack usage with
the bundled ``cuobjdump`` (as tests/ops/test_triton_attention_compile.py does). No GPU needed.
"""

from __future__ import annotations

import json

import pytest
from sm90_compile import compile_sm90 as _compile
from sm90_compile import run_compile_script, spills


def _gemv_cases():
    """(name, x dtype, M_PAD, (GROUP_N, GROUP_K), prologue, config) to compile."""
    from fastdeploy.ops import triton_fp8_gemv as g

    cases = []
    for config in g._CONFIGS:
        kw = config.kwargs
        name = f"{'dot' if kw['DOT'] else 'bc'}{kw['BLOCK_N']}x{kw['BLOCK_K']}w{config.num_warps}s{config.num_stages}"
        if kw["DOT"]:
            cases.append((name, "bf16", g.MAX_M, (128, kw["BLOCK_K"]), None, config))
        else:
            m_pad = max(m for m in (1, 2, 4) if g.config_fits(kw, m, 128, 128))
            cases.append((name, "bf16", m_pad, (128, 128), None, config))
            if g.config_fits(kw, g.SILU_FUSE_MAX_M, 128, 128, silu_mul=True):
                cases.append((name + "-silu", "bf16", g.SILU_FUSE_MAX_M, (128, 128), "silu", config))
            if g.config_fits(kw, g.NORM_FUSE_MAX_M, 128, 128, norm=True):
                cases.append((name + "-norm", "bf16", g.NORM_FUSE_MAX_M, (128, 128), "norm", config))
    cases.append(("bc-channel", "fp16", 1, (1, 0), None, g.BROADCAST_CONFIGS[0]))
    cases.append(("bc-channel-norm", "fp16", 2, (1, 0), "norm", g.BROADCAST_CONFIGS[0]))
    cases.append(("dot-channel-fp32", "fp32", 16, (1, 0), None, g.DOT_CONFIGS[1]))
    return cases


def _compile_all() -> dict[str, dict[str, int]]:
    from fastdeploy.ops import triton_fp8_gemm as gm
    from fastdeploy.ops import triton_fp8_gemv as g
    from fastdeploy.ops import triton_fp8_quant as q

    results = {}
    for name, xt, m_pad, (gn, gk), prologue, config in _gemv_cases():
        constexprs = dict(config.kwargs, M_PAD=m_pad, GROUP_N=gn, GROUP_K=gk, HAS_BIAS=True,
                          SILU_MUL=prologue == "silu", NORM=prologue == "norm", HAS_RES=prologue == "norm",
                          DOT_FP32=xt == "fp32", EVEN_K=True, USE_PDL=True,
                          BLOCK_M=g._block_m({"M_PAD": m_pad}))  # fmt: skip
        types = {"x_ptr": f"*{xt}", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": f"*{xt}", "out_ptr": f"*{xt}",
                 "r_ptr": f"*{xt}", "r_out_ptr": f"*{xt}", "nw_ptr": f"*{xt}", "eps": "fp32"}  # fmt: skip
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        results[f"gemv-{name}-m{m_pad}"] = _compile(g._fp8_gemv_kernel, types, constexprs, options)
    tables = [("block", False, 128, most, c) for most, c in gm.CONFIGS]
    tables += [("channel", True, 1, most, c) for most, c in gm.CHANNEL_CONFIGS]
    for name, channel, group, most, c in tables:
        types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
                 "b_scale_ptr": "*fp32", "bias_ptr": "*bf16"}  # fmt: skip
        constexprs = dict(GROUP_N=group, GROUP_K=group, CHANNEL=channel, HAS_BIAS=True, DOT_FP32=False,
                          EVEN_K=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                          GROUP_M=c.group_m, USE_PDL=True)  # fmt: skip
        options = {"num_warps": c.num_warps, "num_stages": c.num_stages}
        results[f"{name}-gemm-m{min(most, 1 << 20)}"] = _compile(
            gm._fp8_block_gemm_kernel, types, constexprs, options
        )
    quant_types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    limits = dict(FP8_MAX_C=448.0, MIN_AMAX_C=1e-12, USE_PDL=True)
    results["quant-token"] = _compile(
        q._token_quant_kernel, quant_types, dict(BLOCK=q.TOKEN_BLOCK, **limits), {"num_warps": 4}
    )
    results["quant-group"] = _compile(
        q._group_quant_kernel, quant_types, dict(GROUP=128, BLOCK=128, **limits), {"num_warps": 4}
    )
    norm_types = {**quant_types, "r_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "eps": "fp32"}
    for k in (2048, 4096):  # the Qwen3-30B-A3B and Llama-3.1-8B hidden sizes
        for store in (False, True):  # (True: a MoE block's, the normalized rows kept for the router)
            results[f"norm-quant-{k}{'-normed' if store else ''}"] = _compile(
                q._add_rms_norm_quant_kernel, norm_types,
                dict(HAS_RESIDUAL=True, STORE_NORMED=store, BLOCK=k, **limits),
                {"num_warps": 4 if k <= 2048 else 8},
            )  # fmt: skip
    return results


@pytest.mark.slow
def test_fp8_kernels_compile_for_sm90_without_spills():
    results = run_compile_script(__file__, timeout=600)
    assert len(results) >= 20
    assert not spills(results), f"register spills on sm_90: {spills(results)}"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
