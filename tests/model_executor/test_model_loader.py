"""Model loading from tiny random Hugging Face checkpoints, checked against ``transformers``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.model_loader import load_model, resolve_dtype, resolve_model
from fastdeploy.model_executor.models.llama import WeightLoadError

CPU = torch.device("cpu")
VOCAB = 160
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Spread every weight (norms and biases too) so that a wrong mapping cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.08 * noise)


def make_checkpoint(folder, family="llama", seed=0, max_shard_size=None, **overrides):
    """Write a tiny random checkpoint as a Hugging Face folder; return the reference model."""
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(**{**SMALL, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), **kwargs)
    return model


def load_ours(folder, dtype=torch.float32, **model_config):
    config = ModelConfig(model=str(folder), dtype=str(dtype).replace("torch.", ""), **model_config)
    source = resolve_model(config)
    return load_model(config, source, CPU, dtype), source


def our_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(input_ids, torch.arange(len(input_ids)))
        return model.compute_logits(hidden)


def ref_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids[None]).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def random_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# ---- logits against transformers ------------------------------------------------------


@pytest.mark.parametrize(
    "family, tie",
    [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False)],
)
def test_logits_match_transformers(tmp_path, family, tie):
    ref = make_checkpoint(tmp_path, family, seed=1, tie_word_embeddings=tie)
    ours, source = load_ours(tmp_path)
    assert source.arch.tie_word_embeddings is tie
    if tie:
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    else:
        assert not torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    if family == "qwen2":
        assert ours.model.layers[0].self_attn.qkv_proj.bias is not None
    ids = random_ids(37, seed=2)
    ours_l, ref_l = our_logits(ours, ids), ref_logits(ref, ids)
    assert ours_l.shape == (37, VOCAB) and ours_l.dtype == torch.float32
    assert rel_err(ours_l, ref_l) < 1e-4
    assert torch.equal(ours_l.argmax(-1), ref_l.argmax(-1))


def test_sharded_checkpoint_matches(tmp_path):
    ref = make_checkpoint(tmp_path, "llama", seed=3, max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.isfile(tmp_path / "model.safetensors.index.json")
    ours, _ = load_ours(tmp_path)
    ids = random_ids(29, seed=4)
    assert rel_err(our_logits(ours, ids), ref_logits(ref, ids)) < 1e-4


def test_llama3_rope_scaling_matches(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    ref = make_checkpoint(tmp_path, "llama", seed=5, rope_parameters=rope, rope_scaling=rope)
    ours, source = load_ours(tmp_path)
    assert source.arch.rope_scaling["rope_type"] == "llama3"
    ids = random_ids(60, seed=6)
    ref_l = ref_logits(ref, ids)
    assert rel_err(our_logits(ours, ids), ref_l) < 1e-4
    # the scaling matters at these positions: without it the logits are far off
    plain, _ = load_ours(tmp_path, hf_config_overrides={"rope_scaling": None, "rope_parameters": None})
    assert (
        plain.model.layers[0].self_attn.rotary_emb.cos_cache.shape
        == ours.model.layers[0].self_attn.rotary_emb.cos_cache.shape
    )
    assert rel_err(our_logits(plain, ids), ref_l) > 1e-3


def test_rope_theta_is_honoured(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 500.0}
    ref = make_checkpoint(tmp_path, "qwen2", seed=7, rope_parameters=rope)
    ours, source = load_ours(tmp_path)
    assert source.arch.rope_theta == 500.0
    ids = random_ids(40, seed=8)
    assert rel_err(our_logits(ours, ids), ref_logits(ref, ids)) < 1e-4


# ---- dtypes and dummy weights ----------------------------------------------------------


def test_bfloat16_loads(tmp_path):
    ref = make_checkpoint(tmp_path, "llama", seed=9)
    ours, _ = load_ours(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = random_ids(20, seed=10)
    logits = our_logits(ours, ids)
    assert logits.dtype == torch.float32  # logits are always float32
    assert rel_err(logits, ref_logits(ref, ids)) < 5e-2


def test_resolve_dtype():
    config = ModelConfig()
    arch = resolve_model(config).arch
    assert resolve_dtype("float16", arch, CPU) == torch.float16
    arch.torch_dtype = "float16"
    assert resolve_dtype("auto", arch, CPU) == torch.bfloat16  # float16 is slow on a CPU
    arch.torch_dtype = "float32"
    assert resolve_dtype("auto", arch, CPU) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", arch, CPU)


def _config_only_folder(folder, **overrides):
    config = Qwen3Config(**{**SMALL, **overrides})
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(str(folder))
    assert not any(f.endswith(".safetensors") for f in os.listdir(folder))


def test_dummy_weights_are_seeded(tmp_path):
    _config_only_folder(tmp_path)
    a, _ = load_ours(tmp_path, load_format="dummy", seed=0)
    b, _ = load_ours(tmp_path, load_format="dummy", seed=0)
    c, _ = load_ours(tmp_path, load_format="dummy", seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(
        not torch.equal(sa[k], sc[k]) for k in sa if k != "lm_head.weight" or not a.config.tie_word_embeddings
    )
    for name, p in a.named_parameters():
        assert p.abs().max() > 0 and p.std() > 0, name
    ids = random_ids(12, seed=11)
    assert torch.equal(our_logits(a, ids), our_logits(b, ids))
    # the same seed gives the same weights in another dtype (drawn in float32 on the CPU)
    d, _ = load_ours(tmp_path, dtype=torch.bfloat16, load_format="dummy", seed=0)
    w = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(d.state_dict()[w], sa[w].to(torch.bfloat16))


def test_dummy_weights_drawn_in_chunks_fill_every_row(tmp_path, monkeypatch):
    """Large parameters are drawn in row chunks (bounded float32 temporaries); every row gets values."""
    import fastdeploy.model_executor.model_loader as loader

    _config_only_folder(tmp_path)
    monkeypatch.setattr(loader, "_DUMMY_CHUNK", 100)  # a few rows per draw for every matrix
    a, _ = load_ours(tmp_path, load_format="dummy", seed=3)
    b, _ = load_ours(tmp_path, load_format="dummy", seed=3)
    for name, p in a.named_parameters():
        rows = p.detach().reshape(p.shape[0], -1)
        center = 1.0 if name.endswith("norm.weight") else 0.0
        assert (rows - center).abs().max() <= 0.05, name
        if rows.shape[1] > 1:
            assert bool((rows.std(dim=1) > 0).all()), name
        assert torch.equal(p, dict(b.named_parameters())[name]), name


# ---- errors -----------------------------------------------------------------------------


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooBarForCausalLM"], **SMALL}))
    with pytest.raises(ValueError, match="FooBarForCausalLM"):
        resolve_model(ModelConfig(model=str(tmp_path)))


def test_missing_config_json(tmp_path):
    make_checkpoint(tmp_path, "llama")
    os.remove(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(ModelConfig(model=str(tmp_path)))


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        resolve_model(ModelConfig(model=str(tmp_path / "does-not-exist")))


def test_missing_safetensors_shard(tmp_path):
    make_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    os.remove(tmp_path / shards[1])
    with pytest.raises(FileNotFoundError, match=shards[1]):
        load_ours(tmp_path)


def test_no_weights_at_all(tmp_path):
    _config_only_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_ours(tmp_path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    make_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError) as info:
        load_ours(tmp_path)
    message = str(info.value)
    assert "mlp." in message and "_proj.weight" in message
    assert "(96, 64)" in message or "(64, 96)" in message  # checkpoint
    assert "(80, 64)" in message or "(64, 80)" in message  # model


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, "llama")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="qkv_proj"):
        load_ours(tmp_path)


# ---- generation config ----------------------------------------------------------------


def test_eos_ids_from_generation_config_are_merged(tmp_path):
    make_checkpoint(tmp_path, "llama", eos_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 11]}))
    _, source = load_ours(tmp_path)
    assert source.arch.eos_token_ids == [2, 7, 11]
    os.remove(tmp_path / "generation_config.json")
    assert resolve_model(ModelConfig(model=str(tmp_path))).arch.eos_token_ids == [2]
