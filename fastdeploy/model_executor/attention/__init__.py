"""Attention over the paged KV cache: one layer module, pluggable backends (see registry.py)."""

from fastdeploy.model_executor.attention.backend import AttentionBackend, AttentionSpec, PrefillDecodeBackend
from fastdeploy.model_executor.attention.layer import Attention
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionSpec",
    "CommonAttentionMetadata",
    "PrefillDecodeBackend",
]
