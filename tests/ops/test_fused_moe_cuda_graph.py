"""GPU only: the whole CUDA MoE layer (Triton routing, sort, both expert paths, combine, the load
statistic) captured in a CUDA graph and replayed on new inputs gives the eager result bit for
bit, and matches the torch path — i.e. nothing in it waits for or reads back from the device."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.model_executor.layers.fused_moe import FusedMoE, select_experts, select_experts_torch
from fastdeploy.model_executor.layers.fused_moe_fp8 import BLOCK_SCALE_SUFFIX as SCALE_SUFFIX
from fastdeploy.model_executor.layers.quantization import Fp8Config

pytestmark = pytest.mark.gpu
E, K, H, INTER = 16, 4, 256, 128


def _layer(fp8: bool) -> FusedMoE:
    g = torch.Generator().manual_seed(0)
    layer = FusedMoE(E, K, H, INTER, renormalize=True, quant_config=Fp8Config() if fp8 else None)
    layer.gate_up_proj.data.copy_(torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5)
    layer.down_proj.data.copy_(torch.randn(E, H, INTER, generator=g) * INTER**-0.5)
    layer = layer.to(device="cuda", dtype=torch.bfloat16)
    layer.process_weights_after_loading()
    return layer


def _inputs(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, E, device="cuda", generator=g).bfloat16()
    return x, logits


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [1, 4, 40, 300])  # GEMV path; grouped, one and two align kernels
def test_layer_replays_in_a_cuda_graph(tokens, fp8):
    layer = _layer(fp8)
    x, logits = _inputs(tokens, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, logits)  # warm-up: compile every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits)
    new_x, new_logits = _inputs(tokens, seed=2)
    x.copy_(new_x)
    logits.copy_(new_logits)
    layer.routed_tokens.zero_()
    graph.replay()
    replayed_counts = layer.routed_tokens.clone()
    layer.routed_tokens.zero_()
    eager = layer(new_x, new_logits)
    assert torch.equal(out, eager)
    assert torch.equal(replayed_counts, layer.routed_tokens) and int(replayed_counts.sum()) == tokens * K
    weights, ids = select_experts(new_logits, K, True)  # the kernel's choice (bf16 logits can tie)
    ref = layer.compute_experts_torch(new_x, weights, ids).double()
    _, torch_ids = select_experts_torch(new_logits, K, True)
    assert (ids == torch_ids).float().mean() > 0.95
    assert ((out.double() - ref).norm() / ref.norm()).item() < (0.08 if fp8 else 2e-2)


def _expert_parallel_half(full: FusedMoE, rank: int) -> FusedMoE:
    """``full``'s layer as expert-parallel rank ``rank`` of 2 would hold it (half the experts),
    without a process group: the TP + EP forward, whose all-reduce is then the caller's sum."""
    half = _layer(full.fp8 is not None)
    half.ep_rank, half.ep_size = rank, 2
    half.num_local_experts, half.first_local_expert = E // 2, rank * E // 2
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    half.gate_up_proj = torch.nn.Parameter(full.gate_up_proj.data[mine].clone(), requires_grad=False)
    half.down_proj = torch.nn.Parameter(full.down_proj.data[mine].clone(), requires_grad=False)
    if full.fp8 is not None:
        for name in ("gate_up_proj", "down_proj"):
            scale = getattr(full, name + SCALE_SUFFIX)[mine].clone()
            setattr(half, name + SCALE_SUFFIX, torch.nn.Parameter(scale, requires_grad=False))
    return half


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [1, 40])  # GEMV path; grouped GEMM
def test_expert_parallel_halves_replay_in_a_graph_and_sum_to_the_whole(tokens, fp8):
    full = _layer(fp8)
    halves = [_expert_parallel_half(full, rank) for rank in (0, 1)]
    x, logits = _inputs(tokens, seed=3)
    for half in halves:
        half(x, logits)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [half(x, logits) for half in halves]
    new_x, new_logits = _inputs(tokens, seed=4)
    x.copy_(new_x)
    logits.copy_(new_logits)
    graph.replay()
    whole = full(new_x, new_logits).float()
    summed = outs[0].float() + outs[1].float()
    assert ((summed - whole).norm() / whole.norm()).item() < 1e-2  # bf16 rounding of two partials


@pytest.mark.parametrize("tokens", [1, 40])
def test_shared_experts_beside_the_routed_ones(tokens, monkeypatch):
    """The shared experts on the side stream (eager and captured in a graph, the fork and join
    captured too): the same output, bit for bit, as one stream (``FD_SIDE_STREAM=0``); the side
    stream's output is not reused before the join (a slow shared computation still adds up)."""
    layer = _layer(False)
    w = torch.randn(H, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)).bfloat16()

    def shared_of(x):
        def shared():
            out = x
            for _ in range(20):  # long enough to still run when the routed experts end
                out = torch.tanh(out @ w)
            return out

        return shared

    x, logits = _inputs(tokens, seed=4)
    monkeypatch.setenv("FD_SIDE_STREAM", "0")
    one_stream = layer(x, logits, shared_of(x))
    monkeypatch.setenv("FD_SIDE_STREAM", "1")
    assert torch.equal(layer(x, logits, shared_of(x)), one_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x, logits, shared_of(x))
    new_x, new_logits = _inputs(tokens, seed=5)
    x.copy_(new_x)
    logits.copy_(new_logits)
    graph.replay()
    monkeypatch.setenv("FD_SIDE_STREAM", "0")
    assert torch.equal(captured, layer(new_x, new_logits, shared_of(new_x)))
