"""FP8 block-scaled checkpoints (weights in float8_e4m3fn + ``weight_scale_inv`` + a config.json
``quantization_config``, as Qwen3-*-FP8 and DeepSeek ship them), written here from a tiny random
Llama, and FP8 under tensor parallelism.

The checkpoint is compared with two models of the same weights:

* the *dequantized* float32 model (each weight = fp8 × its block scale, no quantization config):
  only the activations' fp8 rounding separates them; bound 0.15 of the logits' norm, as in
  test_fp8_models.py (e4m3's 3 mantissa bits: ~4% per GEMM, over two layers).
* ``--quantization fp8`` applied to that dequantized model: re-quantizing a dequantized block
  gives back the same fp8 values and scales (each block's largest element is exactly ±448 × its
  scale), so the two compute the same thing: 1e-5.

Dimensions are multiples of 128 so that at TP=2 every rank's shard is whole 128 × 128 blocks
(q: 4 heads × 128, k/v: 2 heads × 128, MLP 512).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.layers.parallel_linear import QKVParallelLinear
from fastdeploy.model_executor.layers.quantization import Fp8Config
from fastdeploy.ops import fp8_quant as fq
from tests.greedy_tokens import TINY_ENGINE, TOKEN_PROMPTS
from tests.model_executor.test_fp8_models import model_logits, rel_err

BLOCK = (128, 128)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = dict(
    vocab_size=300,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"fp8": the FP8 checkpoint, "dequantized": the same weights in float32, unquantized}."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    fp8, dequantized = {}, {}
    for name, tensor in model.state_dict().items():
        if _is_projection(name):
            q, scale = fq.quantize_weight_block(tensor, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = fq.dequantize_weight_block(q, scale, BLOCK)
        else:
            fp8[name] = dequantized[name] = tensor.contiguous()
    out = {}
    for kind, tensors in (("fp8", fp8), ("dequantized", dequantized)):
        folder = str(tmp_path_factory.mktemp(f"llama_{kind}"))
        model.config.save_pretrained(folder)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        out[kind] = folder
    with open(os.path.join(out["fp8"], "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
    }
    with open(os.path.join(out["fp8"], "config.json"), "w") as f:
        json.dump(config, f)
    out["tensors"] = fp8
    return out


def test_fp8_checkpoint_loads_its_weights_as_they_are(folders):
    model, _ = model_logits(folders["fp8"])
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.quant_method.config.is_checkpoint_fp8
    saved = folders["tensors"]
    prefix = "model.layers.1.self_attn."
    expected = torch.cat([saved[prefix + f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.weight.view(torch.uint8), expected.view(torch.uint8))
    scales = torch.cat([saved[prefix + f"{p}.weight_scale_inv"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.weight_scale_inv, scales)
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(down.weight_scale_inv, saved["model.layers.0.mlp.down_proj.weight_scale_inv"])


def test_fp8_checkpoint_matches_the_dequantized_model(folders):
    _, logits = model_logits(folders["fp8"])
    _, dequantized = model_logits(folders["dequantized"])
    _, requantized = model_logits(folders["dequantized"], "fp8")
    assert 1e-3 < rel_err(logits, dequantized) < 0.15
    assert rel_err(logits, requantized) < 1e-5


def test_dummy_weights_for_an_fp8_checkpoint_are_quantized_at_load(folders):
    model, logits = model_logits(folders["fp8"], load_format="dummy")
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and not layer.quant_method.config.is_checkpoint_fp8
    assert (layer.weight_scale_inv > 0).all() and torch.isfinite(logits).all()


def test_shards_that_split_a_weight_block_are_refused():
    # k and v of 2 heads x 32 = 64 rows each: v starts at row 192 of the fused weight, inside a block
    with pytest.raises(ValueError, match="not whole 128x128 blocks.*multiples of 128"):
        QKVParallelLinear(256, 32, 4, 2, bias=False, quant_config=Fp8Config(is_checkpoint_fp8=True))
    QKVParallelLinear(256, 32, 4, 2, bias=False, quant_config=Fp8Config())  # online: any shape


def _greedy(folder: str, tp: int, quantization: str | None = None) -> list[list[int]]:
    llm = LLM(model=folder, tensor_parallel_size=tp, quantization=quantization, **TINY_ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(TOKEN_PROMPTS, params)]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_fp8_at_tp2_equals_tp1(folders):
    """TP=2 (gloo) with the FP8 checkpoint, and online FP8 of the dequantized weights at TP=2, give
    the TP=1 FP8 checkpoint's greedy tokens."""
    expected = _greedy(folders["fp8"], tp=1)
    assert _greedy(folders["fp8"], tp=2) == expected
    assert _greedy(folders["dequantized"], tp=2, quantization="fp8") == expected
