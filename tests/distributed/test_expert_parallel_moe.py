"""The expert-parallel FusedMoE on two gloo processes.

Each case runs on two CPU processes and compares with a single-process reference: the
plain FusedMoE holding every expert, on random inputs and random routing. Layouts: DP+EP
(each rank its own tokens, one rank possibly none; padded to the most any rank has, found by
the layer itself or given by the runner as a captured graph would be) and TP+EP (both ranks
the same tokens).
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from fastdeploy import distributed as fdist
from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.quantization import Fp8Config, PtpcFp8Config

EXPERTS, HIDDEN, INTER, TOP_K = 8, 16, 12, 2
CPU = torch.device("cpu")


def expert_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full checkpoint tensors of every expert (``"{e}.{proj}"`` → tensor)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for e in range(EXPERTS):
        weights[f"{e}.gate_proj"] = torch.randn(INTER, HIDDEN, generator=gen) * 0.3
        weights[f"{e}.up_proj"] = torch.randn(INTER, HIDDEN, generator=gen) * 0.3
        weights[f"{e}.down_proj"] = torch.randn(HIDDEN, INTER, generator=gen) * 0.3
    return weights


def build_moe(fp8: bool = False, per_channel: bool = False) -> FusedMoE:
    """A FusedMoE for this process's groups, loaded through its per-expert loaders (``fp8``: its
    experts quantized at load to 128 x 128 block-scaled e4m3, as ``--quantization fp8`` does, or
    per output channel with ``per_channel``, as ``--quantization ptpc_fp8`` does)."""
    quant_config = (PtpcFp8Config() if per_channel else Fp8Config()) if fp8 else None
    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, renormalize=True, quant_config=quant_config)
    for shard, tensor in expert_weights().items():
        param = layer.down_proj if shard.endswith("down_proj") else layer.gate_up_proj
        param.weight_loader(param, tensor, shard)
    layer.process_weights_after_loading()
    return layer


def inputs(num_tokens: int, seed: int, only_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random hidden states and router logits (``only_experts``: logits that pick among the first n)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)
    if only_experts is not None:
        logits[:, only_experts:] -= 100.0
    return hidden, logits


# (tokens of rank 0, tokens of rank 1, route only to the first n experts): one rank sends nothing;
# everything goes to rank 0's experts (rank 1 receives nothing); a plain random case
DP_CASES = [(9, 0, None), (5, 7, 4), (13, 6, None)]


def _dp_ep(rank: int, init_method: str, results: dict) -> None:
    fdist.init_tensor_parallel(1, 0, init_method, CPU, expert_parallel=True, dp_size=2, dp_rank=rank)
    try:
        layer = build_moe()
        assert layer.num_local_experts == EXPERTS // 2 and layer.first_local_expert == rank * EXPERTS // 2
        outs = []
        for case, (n0, n1, only) in enumerate(DP_CASES):
            hidden, logits = inputs((n0, n1)[rank], seed=10 * case + rank, only_experts=only)
            outs.append(layer(hidden, logits))
        # the runner's agreed size (larger than either rank's tokens: a captured graph's size)
        with fdist.ep_step_tokens(16):
            for case, (n0, n1, only) in enumerate(DP_CASES):
                hidden, logits = inputs((n0, n1)[rank], seed=10 * case + rank, only_experts=only)
                outs.append(layer(hidden, logits))
        # bf16: the routing travels bit for bit as bf16 columns of the hidden states' all-gather
        hidden, logits = inputs((5, 7)[rank], seed=90 + rank)
        outs.append(layer.to(torch.bfloat16)(hidden.bfloat16(), logits.bfloat16()))
        results[rank] = outs
    finally:
        fdist.destroy_tensor_parallel()


def test_experts_across_data_parallel_ranks_equal_one_process():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_dp_ep, args=(fdist.free_port_init_method(), results), nprocs=2, join=True)
        results = dict(results)
    reference = build_moe()  # one process, every expert
    for rank in range(2):
        got_all = results[rank]
        assert len(got_all) == 2 * len(DP_CASES) + 1
        hidden, logits = inputs((5, 7)[rank], seed=90 + rank)
        expected = build_moe().to(torch.bfloat16)(hidden.bfloat16(), logits.bfloat16())
        assert got_all[-1].dtype == torch.bfloat16 and expected.abs().max() > 0.05
        # the two ranks' partial sums add in bf16 (one rounding more than one process): 2^-7 scale
        torch.testing.assert_close(got_all.pop(), expected, rtol=2e-2, atol=2e-2)
        for index, got in enumerate(got_all):
            case = index % len(DP_CASES)
            n = DP_CASES[case][rank]
            hidden, logits = inputs(n, seed=10 * case + rank, only_experts=DP_CASES[case][2])
            expected = reference(hidden, logits)
            assert got.shape == (n, HIDDEN)
            if n:
                assert expected.abs().max() > 0.05
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _tp_ep(rank: int, init_method: str, results: dict) -> None:
    fdist.init_tensor_parallel(2, rank, init_method, CPU, expert_parallel=True)
    try:
        layer = build_moe()
        shared = torch.full((5, HIDDEN), float(rank + 1))  # partial sums of shared experts: 1 + 2
        outs = [layer(*inputs(n, seed=n)) for n in (1, 2, 11)]  # 1 token: one TP rank has no share
        hidden, logits = inputs(5, seed=5)
        outs.append(layer(hidden, logits, lambda: shared))
        outs.append(build_moe(fp8=True)(*inputs(7, seed=7)))  # each rank quantizes only its experts
        outs.append(build_moe(fp8=True, per_channel=True)(*inputs(7, seed=7)))
        results[rank] = outs
    finally:
        fdist.destroy_tensor_parallel()


def test_tensor_parallel_ranks_with_expert_parallel_equal_one_process():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_tp_ep, args=(fdist.free_port_init_method(), results), nprocs=2, join=True)
        results = dict(results)
    reference = build_moe()
    expected = [reference(*inputs(n, seed=n)) for n in (1, 2, 11)]
    expected.append(reference(*inputs(5, seed=5)) + 3.0)
    fp8_reference = build_moe(fp8=True)
    assert fp8_reference.gate_up_proj.dtype == torch.float8_e4m3fn
    expected.append(fp8_reference(*inputs(7, seed=7)))
    assert (expected[-1] - reference(*inputs(7, seed=7))).abs().max() > 0  # quantized: not the bf16 output
    channel_reference = build_moe(fp8=True, per_channel=True)
    assert channel_reference.gate_up_proj_scale.shape == (EXPERTS, 2 * INTER)
    expected.append(channel_reference(*inputs(7, seed=7)))
    for rank in range(2):
        for got, want in zip(results[rank], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
