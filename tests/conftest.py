"""Shared fixtures: the default model's path, a reference HF model, skip rules."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU-only machines; this must be set before any
    # test module imports a kernel, or that kernel would be compiled for a GPU there is not
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from fastdeploy.model_executor.model_loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_reference_model(default_model_path):
    """transformers' Llama loaded from the same GGUF, in float32 (the correctness reference)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()
