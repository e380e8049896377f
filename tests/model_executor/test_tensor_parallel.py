"""Tensor-parallel layers and models on two gloo processes, against plain torch and against one rank.

One ``torch.multiprocessing.spawn`` of two ranks (a module fixture) runs every check: each
parallel layer on random inputs beside the plain torch operation it splits, and each tiny
random Hugging Face checkpoint loaded through ``load_weights`` (and one model of dummy
weights) on the same token ids. The parent compares the layers with their references and
the models with the same checkpoint loaded at one rank (float32, same greedy tokens).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastdeploy import distributed as fdist
from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    shard_heads,
)
from fastdeploy.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from fastdeploy.model_executor.layers.weight_loading import ShardId, checkpoint_shapes, weight_loader
from fastdeploy.model_executor.model_loader import load_model, resolve_model

CPU = torch.device("cpu")
TP = 2
SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
CHECKPOINTS = {
    "llama-gqa": ("llama", {}),
    "llama-kv1": ("llama", dict(num_key_value_heads=1, vocab_size=161)),  # KV head replicated; vocab padded
    "llama-uneven": ("llama", dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8, hidden_size=48)),
    "qwen3": ("qwen3", {}),  # q/k norms
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, vocab_size=161)),  # q/k/v biases, tied head
}
"""name → (family, config overrides): tiny random checkpoints written with ``transformers``."""
LOCAL_HEADS = {"llama-gqa": [(2, 1)] * 2, "llama-kv1": [(2, 1)] * 2, "llama-uneven": [(2, 1), (4, 2)]}
"""(query heads, KV heads) of each rank, where the layout is the point of the checkpoint."""
NUM_TOKENS = 23
QKV_LAYOUTS = {
    (4, 2): [((0, 2), (0, 1)), ((2, 4), (1, 2))],  # even
    (4, 1): [((0, 2), (0, 1)), ((2, 4), (0, 1))],  # the one KV head on both ranks
    (6, 3): [((0, 2), (0, 1)), ((2, 6), (1, 3))],  # whole GQA groups, unevenly
}
"""(heads, KV heads) → per rank: its query heads and its KV heads, [start, end) of the checkpoint's."""


def _write_checkpoint(folder: str, family: str, overrides: dict) -> None:
    """A tiny random checkpoint whose every weight (norms and biases too) is spread."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[family]
    model = model_cls(config_cls(**{**SMALL, **overrides}))
    g = torch.Generator().manual_seed(len(folder))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    model.save_pretrained(folder)


def _write_config_only(folder: str) -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(**SMALL)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(folder)


def _token_ids(vocab_size: int) -> torch.Tensor:
    ids = torch.randint(0, vocab_size, (NUM_TOKENS,), generator=torch.Generator().manual_seed(5))
    ids[-1] = vocab_size - 1  # the last row of the vocabulary: on the last rank, beside any padding
    return ids


def run_model(folder: str, load_format: str) -> dict:
    """Load ``folder`` at this process's tensor-parallel rank and run one float32 forward."""
    config = ModelConfig(model=folder, dtype="float32", load_format=load_format, seed=11)
    source = resolve_model(config)
    model = load_model(config, source, CPU, torch.float32)
    ids = _token_ids(source.arch.vocab_size)
    with torch.no_grad():
        hidden = model(ids, torch.arange(len(ids)))
        logits = model.compute_logits(hidden)
    attn = model.model.layers[0].self_attn.attn
    return {"hidden": hidden, "logits": logits, "heads": (attn.num_heads, attn.num_kv_heads)}


# ---- the layers, each beside the plain torch operation it splits ------------------------------


def _load(param: torch.nn.Parameter, full: torch.Tensor, shard: ShardId = None) -> None:
    assert checkpoint_shapes(param)[shard] == tuple(full.shape)
    weight_loader(param)(param, full, shard)


def _layer_checks(rank: int, size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name → (this rank's output, the reference's part of it); the same weights on every rank."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def mine(t: torch.Tensor) -> torch.Tensor:  # this rank's even slice of the last dim
        return t.chunk(size, dim=-1)[rank]

    checks = {}
    x = rand(5, 12)
    w, b = rand(8, 12), rand(8)
    layer = ColumnParallelLinear(12, 8, bias=True)
    _load(layer.weight, w)
    _load(layer.bias, b)
    checks["column"] = (layer(x), mine(F.linear(x, w, b)))

    w0, w1 = rand(6, 12), rand(10, 12)
    layer = MergedColumnParallelLinear(12, [6, 10], bias=False)
    _load(layer.weight, w0, 0)
    _load(layer.weight, w1, 1)
    checks["merged"] = (layer(x), torch.cat([mine(F.linear(x, w0)), mine(F.linear(x, w1))], dim=-1))

    head_dim = 3
    for (heads, kv_heads), ranks in QKV_LAYOUTS.items():
        (q_start, q_end), (kv_start, kv_end) = ranks[rank]
        wq, wk, wv = rand(heads * head_dim, 12), rand(kv_heads * head_dim, 12), rand(kv_heads * head_dim, 12)
        bq, bk, bv = rand(heads * head_dim), rand(kv_heads * head_dim), rand(kv_heads * head_dim)
        layer = QKVParallelLinear(12, head_dim, heads, kv_heads, bias=True)
        for shard, weight, bias in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            _load(layer.weight, weight, shard)
            _load(layer.bias, bias, shard)
        q_cols, kv_cols = (
            slice(q_start * head_dim, q_end * head_dim),
            slice(kv_start * head_dim, kv_end * head_dim),
        )
        want = [
            F.linear(x, wq, bq)[:, q_cols],
            F.linear(x, wk, bk)[:, kv_cols],
            F.linear(x, wv, bv)[:, kv_cols],
        ]
        checks[f"qkv-{heads}-{kv_heads}"] = (layer(x), torch.cat(want, dim=-1))

    w, b, x8, gate_up = rand(6, 8), rand(6), rand(5, 8), rand(5, 16)
    layer = RowParallelLinear(8, 6, bias=True)
    _load(layer.weight, w)
    _load(layer.bias, b)
    checks["row"] = (layer(mine(x8)), F.linear(x8, w, b))  # the bias once, after the all-reduce
    gate, up = gate_up.split(8, dim=-1)
    local = torch.cat([mine(gate), mine(up)], dim=-1)
    checks["row-silu-mul"] = (layer.forward_silu_mul(local), F.linear(F.silu(gate) * up, w, b))
    start, count = (0, 5) if rank == 0 else (5, 3)
    layer = RowParallelLinear(8, 6, bias=True, input_shard=(start, count))
    _load(layer.weight, w)
    _load(layer.bias, b)
    checks["row-uneven"] = (layer(x8[:, start : start + count]), F.linear(x8, w, b))

    table, hidden, ids = rand(11, 6), rand(5, 6), torch.tensor([0, 10, 5, 6, 3, 10, 1])
    embedding = VocabParallelEmbedding(11, 6)  # 6 + 5 rows and one row of padding
    _load(embedding.weight, table)
    checks["embedding"] = (embedding(ids), F.embedding(ids, table))
    head = ParallelLMHead(11, 6)
    _load(head.weight, table)
    checks["lm-head"] = (head(hidden), F.linear(hidden, table))
    tied = ParallelLMHead(11, 6)
    tied.weight = embedding.weight
    checks["lm-head-tied"] = (tied(hidden), F.linear(hidden, table))
    return checks


def _rank_main(rank: int, size: int, init_method: str, folders: dict, results: dict) -> None:
    torch.set_num_threads(1)  # two processes on a small CPU
    fdist.init_tensor_parallel(size, rank, init_method, CPU)
    try:
        with torch.no_grad():
            out = {"layers": _layer_checks(rank, size)}
        for name, (folder, load_format) in folders.items():
            out[name] = run_model(folder, load_format)
        results[rank] = out
    finally:
        fdist.destroy_tensor_parallel()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """(what each of the two ranks returned, the folders and load formats they ran)."""
    folders = {}
    for name, (family, overrides) in CHECKPOINTS.items():
        folder = str(tmp_path_factory.mktemp(name))
        _write_checkpoint(folder, family, overrides)
        folders[name] = (folder, "auto")
    dummy = str(tmp_path_factory.mktemp("dummy"))
    _write_config_only(dummy)
    folders["qwen3-dummy"] = (dummy, "dummy")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(TP, fdist.free_port_init_method(), folders, results), nprocs=TP, join=True)
        results = dict(results)
    return results, folders


def test_layers_match_plain_torch(tp_results):
    results, _ = tp_results
    for rank in range(TP):
        for name, (got, want) in results[rank]["layers"].items():
            assert got.shape == want.shape, (rank, name)
            error = (got - want).abs().max().item()
            assert error < 1e-5, f"rank {rank} {name}: max error {error}"


@pytest.mark.parametrize("name", [*CHECKPOINTS, "qwen3-dummy"])
def test_model_matches_one_rank(tp_results, name):
    results, folders = tp_results
    one_rank = run_model(*folders[name])
    for rank in range(TP):
        out = results[rank][name]
        torch.testing.assert_close(out["hidden"], one_rank["hidden"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["logits"], one_rank["logits"], atol=1e-5, rtol=1e-5)
        assert out["logits"].shape == one_rank["logits"].shape  # the full vocabulary, no padding
        assert torch.equal(out["logits"].argmax(-1), one_rank["logits"].argmax(-1))
        if name in LOCAL_HEADS:
            assert out["heads"] == LOCAL_HEADS[name][rank]
    assert torch.equal(results[0][name]["logits"], results[1][name]["logits"])  # gathered, so identical


# ---- the head layout, without processes ------------------------------------------------------


@pytest.mark.parametrize(
    "heads, kv_heads, size",
    [(4, 2, 2), (8, 8, 4), (32, 8, 8), (8, 2, 4), (8, 1, 8), (9, 3, 2), (9, 3, 3), (12, 4, 3), (9, 9, 2)],
)
def test_every_query_head_once_beside_its_kv_head(heads, kv_heads, size):
    group = heads // kv_heads
    seen = []
    for rank in range(size):
        shard = shard_heads(heads, kv_heads, size, rank)
        local_group = shard.num_heads // shard.num_kv_heads
        for i in range(shard.num_heads):
            head = shard.head_start + i
            seen.append(head)
            assert head // group == shard.kv_head_start + i // local_group  # the KV head it reads is local
    assert seen == list(range(heads))


def test_impossible_head_layouts_name_the_attention_heads():
    for heads, kv_heads, size in ((12, 3, 4), (9, 3, 6), (6, 1, 4)):
        with pytest.raises(ValueError, match=f"cannot split {heads} attention heads"):
            shard_heads(heads, kv_heads, size, 0)
