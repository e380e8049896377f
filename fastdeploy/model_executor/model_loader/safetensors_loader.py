"""Weights from a Hugging Face folder of safetensors files (single or sharded)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def safetensors_files(folder: str) -> list[str]:
    """The shard files of ``folder``, as listed by its index when there is one."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shard {missing[0]!r} listed in {index_path} does not exist")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights found in {folder!r}")
    return files


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every shard."""
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
