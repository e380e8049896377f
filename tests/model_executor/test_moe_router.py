"""A MoE block's router at decode sizes: split-K partial logits (``FD_MOE_ROUTER_SPLIT``) route the
tokens as the router's plain output does (same experts, weights within the rounding of the logits
to the model's dtype), and the layer's output follows; elsewhere the plain router runs."""

from __future__ import annotations

import os

import pytest
import torch

from fastdeploy.model_executor.layers import fused_moe as fm
from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.linear import Linear
from fastdeploy.ops import layer_ops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and the Triton interpreter is off",
)
E, K, H, INTER = 8, 2, 96, 64


def _layer(device: str) -> tuple[FusedMoE, Linear]:
    g = torch.Generator().manual_seed(0)
    layer = FusedMoE(E, K, H, INTER, renormalize=True)
    layer.gate_up_proj.data = torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5
    layer.down_proj.data = torch.randn(E, H, INTER, generator=g) * INTER**-0.5
    gate = Linear(H, E, bias=False)
    gate.weight.data = torch.randn(E, H, generator=g) * H**-0.5
    return layer.to(device), gate.to(device)


@pytest.mark.parametrize("tokens", [1, 4])
def test_split_router_routes_as_the_plain_router(tokens, monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(fm, "_triton_kernels", lambda name, x: layer_ops.triton_module(name))
    layer, gate = _layer(device)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(device)
    monkeypatch.setenv("FD_MOE_ROUTER_SPLIT", "0")
    plain = layer.router_logits(gate, x)
    assert plain.shape == (tokens, E)
    monkeypatch.setenv("FD_MOE_ROUTER_SPLIT", "1")
    partials = layer.router_logits(gate, x)
    assert partials.dim() == 3 and partials.shape[1:] == (tokens, E) and partials.dtype == torch.float32
    w_plain, ids_plain = fm.select_experts(plain, K, True)
    w_split, ids_split = fm.select_experts(partials, K, True, dtype=x.dtype)
    assert torch.equal(ids_split, ids_plain)
    torch.testing.assert_close(w_split, w_plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer(x, partials), layer(x, plain), rtol=1e-5, atol=1e-5)
    # more tokens than a decode step of a few: the plain router
    many = torch.randn(5, H, device=device)
    assert layer.router_logits(gate, many).shape == (5, E)


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_norm_and_router_logits_fused_or_not(fusion, monkeypatch):
    """``norm_and_router_logits`` (the block's residual add + RMSNorm, then the router): with
    ``FD_MOE_ROUTER_NORM_FUSION`` at a decode step, one kernel; either way the norm's rows and
    residual, and the routing and output of the plain router on them."""
    from fastdeploy.model_executor.layers.layernorm import RMSNorm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(fm, "_triton_kernels", lambda name, x: layer_ops.triton_module(name))
    monkeypatch.setenv("FD_MOE_ROUTER_NORM_FUSION", fusion)
    layer, gate = _layer(device)
    norm = RMSNorm(H, eps=1e-6).to(device)
    norm.weight.data = 1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(5)).to(device)
    g = torch.Generator().manual_seed(6)
    x, residual = torch.randn(2, H, generator=g).to(device), torch.randn(2, H, generator=g).to(device)
    ref_hidden, ref_residual = norm(x.clone(), residual.clone())
    hidden, new_residual, quantized, logits = layer.norm_and_router_logits(
        x.clone(), residual.clone(), norm, gate
    )
    assert quantized is None and logits.dim() == 3  # the split router's partials either way
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)
    plain = gate(ref_hidden)
    w_plain, ids_plain = fm.select_experts(plain, K, True)
    w, ids = fm.select_experts(logits, K, True, dtype=x.dtype)
    assert torch.equal(ids, ids_plain)
    torch.testing.assert_close(w, w_plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer(hidden, logits), layer(ref_hidden, plain), rtol=1e-5, atol=1e-5)


def test_ranks_only_where_the_triton_routing_kernel_runs(monkeypatch):
    """``FD_MOE_RANKS_IN_ROUTER``: the layer asks for pair ranks only where the Triton routing and
    experts run (never on CPU tensors), and the torch routing refuses ranks it would not fill."""
    from fastdeploy.ops.triton_moe_align_atomic import new_pair_ranks

    monkeypatch.setenv("FD_MOE_RANKS_IN_ROUTER", "1")
    layer, gate = _layer("cpu")
    hidden = torch.randn(200, H)
    assert layer.pair_ranks(hidden, gate(hidden)) is None
    with pytest.raises(ValueError, match="ranked"):
        fm.select_experts(gate(hidden), K, True, ranked=new_pair_ranks(200 * K, E, torch.device("cpu")))
