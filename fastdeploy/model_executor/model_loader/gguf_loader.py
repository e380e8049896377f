"""GGUF files: config, tokenizer and (dequantized) weights.

Weights are dequantized with the ``gguf`` package and renamed to Hugging Face
names, so the same ``load_weights`` serves both formats. Llama-architecture
GGUFs store q/k projections permuted for ggml's interleaved rotary layout; we
undo that here.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fastdeploy import envs

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    """A memory-mapped reader; cached because parsing the metadata takes seconds."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    return gguf.GGUFReader(path)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config_dict(path: str) -> dict[str, Any]:
    """A Hugging Face style ``config.json`` dict built from the GGUF metadata."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type in ("linear",):
        cfg["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
        }
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    return cfg


def _hf_name(gguf_name: str) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in _LAYER_TENSORS:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_TENSORS:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_TENSORS[base]}.{kind}"


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved → rotate-half rotary layout)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iterate_gguf_weights(path: str, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of the file."""
    from gguf.quants import dequantize

    reader = _reader(path)
    permute = config["model_type"] == "llama"
    for tensor in reader.tensors:
        weight = dequantize(tensor.data, tensor.tensor_type)
        name = _hf_name(tensor.name)
        if permute and name.endswith("q_proj.weight"):
            weight = _unpermute_rotary(weight, config["num_attention_heads"])
        elif permute and name.endswith("k_proj.weight"):
            weight = _unpermute_rotary(weight, config["num_key_value_heads"])
        yield name, torch.tensor(weight, dtype=torch.float32)


def load_gguf_tokenizer(path: str):
    """The tokenizer and chat template stored in the GGUF metadata.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is
    cached under ``FD_CACHE_DIR`` keyed by the file's path, size and mtime.
    """
    from transformers import AutoTokenizer

    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[
        :16
    ]
    cache = os.path.join(envs.FD_CACHE_DIR, "gguf_tokenizers", key)
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception:  # a stale or partial cache entry: rebuild it
            pass
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    try:
        os.makedirs(cache, exist_ok=True)
        tokenizer.save_pretrained(cache)
    except OSError:
        pass
    return tokenizer
