"""Tiny random embedding models saved with ``transformers``, and their reference pooled vectors.

A bare decoder (``Qwen3Model`` / ``LlamaModel``: no LM head) with the default model's tokenizer,
optionally packaged as sentence-transformers does (``modules.json``, ``1_Pooling/config.json``,
a ``Normalize`` module). :func:`reference_vectors` pools ``transformers``' final hidden states
(after the final norm) the way the engine must.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaModel, Qwen3Config, Qwen3Model

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def save_tokenizer(folder: Path) -> None:
    """The default model's tokenizer (49152 ids), saved into ``folder``."""
    from fastdeploy.model_executor.model_loader.default_model import default_model_path
    from fastdeploy.model_executor.model_loader.gguf_loader import load_gguf_tokenizer

    load_gguf_tokenizer(default_model_path()).save_pretrained(folder)


def save_embedding_model(
    folder: Path,
    kind: str = "qwen3",
    sentence_transformers: str | None = None,
    normalize_module: bool = False,
    config_extra: dict | None = None,
    with_tokenizer: bool = True,
    seed: int = 0,
) -> torch.nn.Module:
    """Save a tiny random bare decoder to ``folder`` and return it (float32, eval mode).

    ``sentence_transformers``: the Pooling mode flag to set (e.g. ``pooling_mode_mean_tokens``),
    with ``normalize_module`` adding a Normalize module; ``config_extra``: more config.json keys.
    """
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3Model(Qwen3Config(vocab_size=49152, head_dim=16, **TINY)).eval()
    else:
        model = LlamaModel(LlamaConfig(vocab_size=49152, **TINY)).eval()
    model.save_pretrained(folder)
    if config_extra:
        config_path = folder / "config.json"
        config = {**json.loads(config_path.read_text()), **config_extra}
        config_path.write_text(json.dumps(config))
    if sentence_transformers:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize_module:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": TINY["hidden_size"], sentence_transformers: True})
        )
    if with_tokenizer:
        save_tokenizer(folder)
    return model


@torch.no_grad()
def reference_vectors(
    model: torch.nn.Module, prompts: list[list[int]], pooling: str, normalize: bool
) -> list[torch.Tensor]:
    """``transformers``' pooled vector of each token-id prompt (run alone, float32)."""
    out = []
    for ids in prompts:
        hidden = model(torch.tensor([ids])).last_hidden_state[0].float()
        vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        out.append(torch.nn.functional.normalize(vector, dim=-1) if normalize else vector)
    return out


def cosine(a, b) -> float:
    """Cosine similarity of two vectors (lists or tensors)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))
