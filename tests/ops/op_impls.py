"""The implementations every custom-op test runs: the torch fallback on a CPU and on CUDA, and the
compiled kernel (the CUDA ones marked ``gpu``; the kernel skipped when fastdeploy_ops is not built)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from fastdeploy.ops import has_cuda_ops

IMPL_PARAMS = [
    pytest.param("torch-cpu"),
    pytest.param("torch-cuda", marks=pytest.mark.gpu),
    pytest.param("kernel-cuda", marks=pytest.mark.gpu),
]
"""``params`` of each test file's ``impl`` fixture."""


@dataclass(frozen=True)
class Impl:
    """One implementation under test: where its tensors live and how to call it."""

    name: str
    device: str
    fn: Callable[..., None]

    def fp8_capable(self) -> bool:
        return self.device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)


def select_impl(param: str, torch_fn: Callable[..., None], kernel_fn: Callable[..., None]) -> Impl:
    """The ``Impl`` of one of :data:`IMPL_PARAMS`, skipping the kernel when it is not built."""
    if param in ("torch-cpu", "torch-cuda"):
        return Impl(param, param.removeprefix("torch-"), torch_fn)
    if not has_cuda_ops():
        pytest.skip("fastdeploy_ops is not built (python setup_ops.py build_ext --inplace)")
    return Impl(param, "cuda", kernel_fn)
