"""FP8 weights in whole models (CPU, the torch path): the quantization config, the layers it
reaches, and how far the logits move from the unquantized model.

Logit bound: e4m3 keeps 3 mantissa bits, so each weight and activation is rounded by up to
2^-4 (about 3.6% RMS); one GEMM on random data is then about 5% off in norm, and the error
compounds over the tiny models' two layers (measured: 7.9% for the Llama below, 7.5% for the
Qwen3-MoE, against 0.8% for bfloat16). The bound, 15% of the logits' norm, leaves room for that; a wrong scale, a
misplaced shard or an unquantized path is off by O(1) or exactly 0 and fails.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from fastdeploy import LLM, SamplingParams
from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.layers.linear import Linear
from fastdeploy.model_executor.layers.quantization import (
    Fp8Config,
    check_quantization_supported,
    resolve_quant_config,
)
from fastdeploy.model_executor.model_loader import load_model, resolve_model
from tests.greedy_tokens import TINY_ENGINE, TOKEN_PROMPTS

CPU = torch.device("cpu")
LOGIT_REL_TOL = 0.15
TINY_LLAMA = dict(
    vocab_size=300,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny_llama_fp8"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen3_moe_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny_qwen3_moe_fp8"))
    torch.manual_seed(1)
    config = Qwen3MoeConfig(
        **{**TINY_LLAMA, "intermediate_size": 256},
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    return folder


def model_logits(folder: str, quantization: str | None = None, load_format: str = "auto"):
    """The float32 model of ``folder`` (quantized as asked) and its logits on fixed random tokens."""
    config = ModelConfig(model=folder, dtype="float32", quantization=quantization, load_format=load_format)
    model = load_model(config, resolve_model(config), CPU, torch.float32)
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model, model.compute_logits(model(ids, torch.arange(len(ids))))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got - ref).norm() / ref.norm()).item()


# ---- the config -----------------------------------------------------------------------------


def test_flag_quantizes_at_load_in_128_blocks():
    config = resolve_quant_config("fp8", {})
    assert config == Fp8Config(weight_block_size=(128, 128), is_checkpoint_fp8=False)
    assert resolve_quant_config(None, {}) is None


def test_ptpc_flag_quantizes_per_channel():
    config = resolve_quant_config("ptpc_fp8", {})
    assert isinstance(config, Fp8Config) and config.name == "ptpc_fp8"
    assert config.weight_block_size is None and not config.is_checkpoint_fp8
    with pytest.raises(ValueError, match="contradicts"):
        resolve_quant_config("ptpc_fp8", {"quantization_config": {"quant_method": "fp8"}})


def test_checkpoint_config_is_read_quantized_and_dummy_weights_quantize_online():
    qc = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 64],
    }
    config = resolve_quant_config(None, {"quantization_config": qc})
    assert config == Fp8Config(weight_block_size=(128, 64), is_checkpoint_fp8=True)
    assert resolve_quant_config("fp8", {"quantization_config": qc}) == config
    dummy = resolve_quant_config(None, {"quantization_config": qc}, load_format="dummy")
    assert dummy == Fp8Config(weight_block_size=(128, 64), is_checkpoint_fp8=False)
    per_tensor = resolve_quant_config(None, {"quantization_config": {"quant_method": "fp8"}})
    assert per_tensor.weight_block_size is None and per_tensor.is_checkpoint_fp8


@pytest.mark.parametrize(
    "quantization, hf, message",
    [
        ("int4", {}, "unknown quantization 'int4'"),
        (None, {"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq' is not supported"),
        (None, {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "static"),
        (None, {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "e5m2"),
    ],
)
def test_unsupported_quantization_is_a_clear_error(quantization, hf, message):
    with pytest.raises(ValueError, match=message):
        resolve_quant_config(quantization, hf)


def test_gpu_without_fp8_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(
        RuntimeError, match=r"--quantization fp8 needs a GPU of compute capability 8\.9.*8\.0"
    ):
        check_quantization_supported(Fp8Config(), torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_quantization_supported(Fp8Config(), torch.device("cuda"))  # Hopper: fine
    check_quantization_supported(Fp8Config(), CPU)  # the torch path runs anywhere


def test_serve_flag_sets_the_model_config():
    from fastdeploy.entrypoints.cli.args import engine_config_from_args
    from fastdeploy.entrypoints.cli.serve import make_parser

    parser = make_parser()
    assert engine_config_from_args(parser.parse_args(["--quantization", "fp8"])).model.quantization == "fp8"
    ptpc = engine_config_from_args(parser.parse_args(["--quantization", "ptpc_fp8"]))
    assert ptpc.model.quantization == "ptpc_fp8"
    assert engine_config_from_args(parser.parse_args([])).model.quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


# ---- whole models ---------------------------------------------------------------------------


def test_llama_fp8_quantizes_every_projection_and_stays_close(llama_folder):
    _, reference = model_logits(llama_folder)
    model, logits = model_logits(llama_folder, "fp8")
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quant_method is not None]
    assert len(quantized) == 4 * TINY_LLAMA["num_hidden_layers"]  # qkv, o, gate_up, down per layer
    for layer in quantized:
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
        assert not layer.small_m_gemv  # the bf16 small-M kernels never see fp8 weights
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.quant_method is None
    assert 1e-3 < rel_err(logits, reference) < LOGIT_REL_TOL  # quantized (not 0), and close


def test_offline_llm_generates_with_fp8(llama_folder):
    llm = LLM(model=llama_folder, quantization="fp8", **TINY_ENGINE)
    try:
        outs = llm.generate(TOKEN_PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * len(TOKEN_PROMPTS)


@pytest.mark.parametrize("quantization", ["fp8", "ptpc_fp8"])
def test_qwen3_moe_fp8_quantizes_projections_and_experts_and_stays_close(qwen3_moe_folder, quantization):
    _, reference = model_logits(qwen3_moe_folder)
    model, logits = model_logits(qwen3_moe_folder, quantization)
    block = model.model.layers[0].mlp
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.weight.dtype == torch.float8_e4m3fn
    assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    if quantization == "ptpc_fp8":  # one scale per output channel, dense and experts
        assert o_proj.weight_scale.shape == (o_proj.weight.shape[0],)
        assert block.experts.gate_up_proj_scale.shape == block.experts.gate_up_proj.shape[:2]
    assert block.gate.weight.dtype == torch.float32  # the router stays unquantized
    assert 1e-3 < rel_err(logits, reference) < LOGIT_REL_TOL
    llm = LLM(model=qwen3_moe_folder, quantization=quantization, **TINY_ENGINE)
    try:
        outs = llm.generate(TOKEN_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        llm.shutdown()
    assert len(outs[0].outputs[0].token_ids) == 4
