"""Python face of the custom ops.

Each op dispatches to the compiled CUDA extension ``fastdeploy_ops`` (built by
setup_ops.py, loaded by :mod:`fastdeploy.ops._ext`) when it is loaded and the
tensors are on a CUDA device, and to its pure-torch implementation (the
``*_torch`` functions, same signature) otherwise. ``FD_DISABLE_CUSTOM_OPS=1``
forces the torch implementations.
"""

from fastdeploy.ops._ext import has_cuda_ops
from fastdeploy.ops.cache_ops import (
    dequantize_fp8_e4m3_per_head,
    quantize_fp8_e4m3_per_head,
    reshape_and_cache_flash,
    reshape_and_cache_flash_torch,
)
from fastdeploy.ops.stop_ops import alloc_stop_flag, get_stop, set_stop, set_stop_torch

__all__ = [
    "alloc_stop_flag",
    "dequantize_fp8_e4m3_per_head",
    "get_stop",
    "has_cuda_ops",
    "quantize_fp8_e4m3_per_head",
    "reshape_and_cache_flash",
    "reshape_and_cache_flash_torch",
    "set_stop",
    "set_stop_torch",
]
