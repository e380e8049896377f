"""Shared fixtures: the default model's path, a reference HF model, skip rules."""

from __future__ import annotations

import os

import pytest

import fastdeploy  # noqa: F401  (first: under FD_BACKEND=paddle it binds `import torch` to Paddle)

# isort: split
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no priming compile (~1 s of a core) beside every test's first structured request on the 2-core CI;
# tests/structured_output/test_structured_grammar.py turns it on where it is the subject
os.environ.setdefault("FD_GRAMMAR_PRIME_LENGTH", "0")
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU-only machines; this must be set before any
    # test module imports a kernel, or that kernel would be compiled for a GPU there is not
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="also run the tests marked slow (long variants of covered paths; or FD_RUN_SLOW_TESTS=1)",
    )


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or os.environ.get("FD_RUN_SLOW_TESTS") == "1"
    if not run_slow:  # the default run (CI) stays within its time budget
        skip_slow = pytest.mark.skip(reason="slow: run with --run-slow or FD_RUN_SLOW_TESTS=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The default model's GGUF file. Missing on a GPU machine (where the 94 MB package is not
    carried) the test is skipped; missing elsewhere (CI installs it) the test fails."""
    from fastdeploy.model_executor.model_loader.default_model import (
        DefaultModelMissingError,
        default_model_path,
    )

    try:
        return default_model_path()
    except DefaultModelMissingError:
        if torch.cuda.is_available():
            pytest.skip("the default model is not installed on this GPU machine")
        raise


@pytest.fixture(scope="session")
def hf_reference_model(default_model_path):
    """transformers' Llama loaded from the same GGUF, in float32 (the correctness reference)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


QWEN2_VL_TOKENS = {"image": 290, "video": 291, "vision_start": 292, "vision_end": 293}
"""Placeholder token ids of the dummy Qwen2-VL model (``qwen2_vl_dummy``)."""


def _dummy_qwen2_vl_tokenizer():
    """A byte-level tokenizer of 300 ids: bytes, chat markers, and the vision tokens at 290-293."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    names = {256: "<|endoftext|>", 257: "<|im_start|>", 258: "<|im_end|>"}
    names.update({290: "<|image_pad|>", 291: "<|video_pad|>", 292: "<|vision_start|>", 293: "<|vision_end|>"})
    for i in range(256, 300):
        vocab[names.get(i, f"<|extra_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(names.values()))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
    )


@pytest.fixture(scope="session")
def qwen2_vl_dummy(tmp_path_factory):
    """A tiny random float32 Qwen2-VL (2 layers, hidden 64, vision tower of depth 1) saved with
    ``save_pretrained`` plus a byte-level tokenizer with a chat template: ``(folder, hf_model)``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.25,  # large random weights: varied greedy tokens, not one repeated id
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=None,
    )
    vision = dict(
        depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2,
        temporal_patch_size=2, spatial_merge_size=2, initializer_range=0.25,
    )  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=QWEN2_VL_TOKENS["image"],
        video_token_id=QWEN2_VL_TOKENS["video"],
        vision_start_token_id=QWEN2_VL_TOKENS["vision_start"],
        vision_end_token_id=QWEN2_VL_TOKENS["vision_end"],
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).float().eval()
    folder = tmp_path_factory.mktemp("qwen2-vl-dummy")
    model.save_pretrained(str(folder))
    _dummy_qwen2_vl_tokenizer().save_pretrained(str(folder))
    return folder, model
