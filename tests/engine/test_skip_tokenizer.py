"""``skip_tokenizer_init``: token-id prompts in, token ids and empty text out, no tokenizer loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.sampling_params import SamplingParamsError

CONFIG_1B = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-3.2-1b"
TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
ENGINE = dict(
    load_format="dummy",
    dtype="float32",
    device="cpu",
    num_threads=1,
    max_num_seqs=4,
    max_model_len=128,
    num_gpu_blocks_override=64,
)
PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 300, 400, 500, 7, 8, 9]]


@pytest.fixture
def folder_with_broken_tokenizer(tmp_path) -> Path:
    """The 1B benchmark config, shrunk, next to a tokenizer.json that cannot be loaded."""
    shutil.copy(CONFIG_1B / "config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(TINY)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("this is not a tokenizer")
    return tmp_path


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_token_ids_in_token_ids_out(folder_with_broken_tokenizer):
    llm = LLM(model=str(folder_with_broken_tokenizer), skip_tokenizer_init=True, **ENGINE)
    try:
        assert llm.get_tokenizer() is None
        outs = llm.generate(PROMPTS, greedy(6))
        again = llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(6))
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt is None and out.prompt_token_ids == prompt
        completion = out.outputs[0]
        assert completion.text == ""
        assert len(completion.token_ids) == 6 and all(
            0 <= t < TINY["vocab_size"] for t in completion.token_ids
        )
        assert completion.finish_reason == "length"
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # greedy: same tokens again


def test_without_the_flag_the_tokenizer_is_loaded(folder_with_broken_tokenizer):
    """The broken tokenizer.json proves that the flag is what kept it from being read."""
    with pytest.raises(Exception) as info:  # noqa: B017 - whatever transformers raises for a garbage file
        LLM(model=str(folder_with_broken_tokenizer), **ENGINE)
    assert any(entry.name == "load_tokenizer" for entry in info.traceback)


def test_what_needs_a_tokenizer_is_refused():
    llm = LLM(model=str(CONFIG_1B), skip_tokenizer_init=True, hf_config_overrides=TINY, **ENGINE)
    try:
        with pytest.raises(ValueError, match="pass prompt token ids"):
            llm.generate("Hello world", greedy(2))
        with pytest.raises(SamplingParamsError, match="stop strings need a tokenizer"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, stop=["."]))
        with pytest.raises(ValueError, match="chat needs a tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}])
        # stop token ids need no tokenizer
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[3]))
        assert out[0].outputs[0].text == "" and 1 <= len(out[0].outputs[0].token_ids) <= 4
    finally:
        llm.shutdown()


def test_benchmark_configs_have_the_official_shapes():
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import resolve_model

    shapes = {}
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        arch = resolve_model(ModelConfig(model=str(CONFIG_1B.parent / name))).arch
        shapes[name] = (
            arch.hidden_size,
            arch.num_hidden_layers,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
            arch.intermediate_size,
            arch.vocab_size,
            arch.tie_word_embeddings,
            arch.rope_scaling["rope_type"],
            arch.max_position_embeddings,
        )
        assert arch.rope_theta == 500000.0 and arch.torch_dtype == "bfloat16"
    assert shapes["llama-3.2-1b"] == (2048, 16, 32, 8, 64, 8192, 128256, True, "llama3", 131072)
    assert shapes["llama-3.1-8b"] == (4096, 32, 32, 8, 128, 14336, 128256, False, "llama3", 131072)
