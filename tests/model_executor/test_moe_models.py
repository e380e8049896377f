"""Qwen3-MoE and Qwen2-MoE on the torch path (CPU, float32).

The MoE layer alone must match a float64 per-token reference, with and without
renormalised top-k weights; tiny random checkpoints saved by ``transformers`` must give
its greedy tokens through our engine at tensor-parallel sizes 1 and 2.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from fastdeploy.model_executor.layers.fused_moe import FusedMoE, select_experts
from fastdeploy.model_executor.layers.moe_load import MoELoadMeter, load_imbalance
from fastdeploy.model_executor.models.qwen_moe import is_sparse_layer
from fastdeploy.transformers_utils.config import ModelArchConfig
from tests.greedy_tokens import (
    CHUNKED_PREFIX_CACHED,
    TOKEN_PROMPTS,
    engine_greedy_tokens,
    transformers_greedy_tokens,
)

MAX_TOKENS = 10
TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def reference_moe(
    hidden: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, k: int, renorm: bool
) -> torch.Tensor:
    """Per-token float64 loop: softmax, top-k, optional renormalisation, SwiGLU experts."""
    hidden, logits, w13, w2 = (t.double() for t in (hidden, logits, w13, w2))
    out = torch.zeros_like(hidden)
    inter = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        probs = torch.softmax(logits[t], dim=-1)
        weights, ids = torch.topk(probs, k)
        if renorm:
            weights = weights / weights.sum()
        for weight, e in zip(weights.tolist(), ids.tolist()):
            gate, up = w13[e, :inter] @ hidden[t], w13[e, inter:] @ hidden[t]
            out[t] += weight * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("renorm", [False, True], ids=["softmax-topk", "renormalised"])
def test_moe_layer_matches_float64_reference(renorm):
    torch.manual_seed(0)
    experts, hidden_size, inter, top_k, tokens = 6, 32, 24, 2, 37
    layer = FusedMoE(experts, top_k, hidden_size, inter, renormalize=renorm)
    gate = [torch.randn(inter, hidden_size) * 0.2 for _ in range(experts)]
    up = [torch.randn(inter, hidden_size) * 0.2 for _ in range(experts)]
    down = [torch.randn(hidden_size, inter) * 0.2 for _ in range(experts)]
    for e in range(experts):  # through the per-expert loaders, as from a checkpoint
        layer.gate_up_proj.weight_loader(layer.gate_up_proj, gate[e], f"{e}.gate_proj")
        layer.gate_up_proj.weight_loader(layer.gate_up_proj, up[e], f"{e}.up_proj")
        layer.down_proj.weight_loader(layer.down_proj, down[e], f"{e}.down_proj")
    hidden = torch.randn(tokens, hidden_size)
    logits = torch.randn(tokens, experts)
    w13 = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
    expected = reference_moe(hidden, logits, w13, torch.stack(down), top_k, renorm)
    got = layer(hidden, logits)
    assert expected.abs().max() > 0.1  # a non-trivial output
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_renormalised_weights_sum_to_one_and_plain_ones_do_not():
    torch.manual_seed(1)
    logits = torch.randn(20, 8)
    plain, ids = select_experts(logits, 2, renormalize=False)
    renormed, ids2 = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(20))
    assert (plain.sum(-1) < 0.999).all()


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        **TINY,
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    arch = ModelArchConfig.from_dict(cfg)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    assert [is_sparse_layer(arch, i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "extra"),
    [
        (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"head_dim": 16, "norm_topk_prob": True}),
        (
            Qwen2MoeConfig,
            Qwen2MoeForCausalLM,
            {"shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [0]},
        ),
    ],
    ids=["qwen3-moe", "qwen2-moe"],
)
@pytest.mark.parametrize(("tp", "ep"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-ep2"])
def test_tiny_random_moe_models_equal_transformers(tmp_path, config_cls, model_cls, extra, tp, ep):
    """TP=1, TP=2 and TP=2 with expert parallelism (4 experts per rank, each computing its own experts' pairs), with
    chunked prefill and prefix-cache hits."""
    torch.manual_seed(0)
    reference = model_cls(config_cls(**{**TINY, **extra})).eval()
    with torch.no_grad():  # random router weights (transformers starts them at zero): real routing
        for name, param in reference.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
    reference.save_pretrained(tmp_path)
    expected = transformers_greedy_tokens(reference, TOKEN_PROMPTS, MAX_TOKENS)
    assert len({tuple(t) for t in expected}) > 1  # the prompts' continuations differ
    engine = dict(CHUNKED_PREFIX_CACHED, enable_expert_parallel=ep)
    assert engine_greedy_tokens(str(tmp_path), TOKEN_PROMPTS, MAX_TOKENS, tp, passes=2, **engine) == expected


def test_load_imbalance_is_max_over_mean_routed_pairs_and_resets():
    torch.manual_seed(3)
    layers = [FusedMoE(4, 2, 8, 6, renormalize=True) for _ in range(2)]
    for layer in layers:
        torch.nn.init.normal_(layer.gate_up_proj)
        torch.nn.init.normal_(layer.down_proj)
    meter = MoELoadMeter(layers, read_interval_s=0.0)
    assert meter.poll() is None  # starts the first read (nothing routed yet)
    logits = torch.tensor([[9.0, 8.0, 0.0, 0.0]] * 3)  # 3 tokens → experts 0 and 1
    layers[0](torch.randn(3, 8), logits)
    layers[1](torch.randn(1, 8), torch.tensor([[0.0, 0.0, 9.0, 8.0]]))  # 1 token → experts 2 and 3
    assert meter.poll() is None  # the empty first read completes; this one takes the counts
    assert meter.poll() == pytest.approx(3 * 4 / 8)  # counts [3, 3, 1, 1]: max 3, mean 2
    assert meter.poll() is None  # read once: nothing routed since
    assert MoELoadMeter([]).poll() is None


def test_load_imbalance_per_expert_parallel_rank():
    counts = torch.tensor([3, 1, 0, 0])  # rank 0 holds experts 0-1, rank 1 experts 2-3
    assert load_imbalance(counts, ep_size=2) == pytest.approx(4 * 2 / 4)
    assert load_imbalance(counts, ep_size=1) == pytest.approx(3 * 4 / 4)
    assert load_imbalance(torch.zeros(4, dtype=torch.int64), ep_size=1) is None


def test_meter_reads_at_most_once_per_interval():
    layer = FusedMoE(4, 2, 8, 6, renormalize=True)
    meter = MoELoadMeter([layer], read_interval_s=3600.0)
    assert meter.poll() is None  # first read started at once
    layer(torch.randn(2, 8), torch.randn(2, 4))
    assert meter.poll() is None  # the (empty) first read completed; no second read within the interval
    assert int(layer.routed_tokens.sum()) == 4  # still counting on the device, unread


def test_start_beside_runs_in_order_on_a_cpu():
    """Without CUDA the side-stream helper just runs the work (the models' CPU path is unchanged)."""
    from fastdeploy.model_executor.layers.side_stream import start_beside

    calls = []
    pending = start_beside(lambda: calls.append(1) or torch.ones(2), torch.device("cpu"))
    assert calls == [1] and torch.equal(pending.result(), torch.ones(2))
