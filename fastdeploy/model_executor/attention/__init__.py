"""Attention over the paged KV cache: one layer module, pluggable backends."""

from fastdeploy.model_executor.attention.layer import Attention
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata

__all__ = ["Attention", "CommonAttentionMetadata"]
