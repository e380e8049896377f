"""Content hash of a multimodal item (``mm_hash``).

The hash keys the encoder cache and goes into the prefix cache's block hashes,
so it must depend on everything that changes the KV cache an item produces and
on nothing else: equal features fetched from two different URLs hash equal (a
cache hit), equal features with a different ``grid_thw`` do not (the rotary
positions of the placeholder tokens differ).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def mm_hash(features: torch.Tensor, modality: str, grid_thw: Sequence[int]) -> str:
    """SHA-256 (hex) over modality, grid_thw, dtype, shape and the raw bytes of ``features``."""
    tensor = features.detach().cpu().contiguous()
    header = f"fastdeploy-mm-v1|{modality}|{list(grid_thw)}|{tensor.dtype}|{list(tensor.shape)}|"
    digest = hashlib.sha256(header.encode())
    if tensor.numel():
        # a uint8 view works for every dtype numpy lacks (bfloat16) and copies nothing
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()
