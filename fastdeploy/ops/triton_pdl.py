"""Programmatic dependent launch (PDL) for the Triton kernels of the decode step.

A batch-1 decode step is a chain of ~100 small kernels; between two of them the GPU
drains one grid and launches the next, a microsecond or two each in which no memory
is read. With PDL (Hopper and later) a kernel is launched while its predecessor
finishes: its programs wait in ``gdc_wait`` until the predecessor's writes are
visible, so the launch latency is hidden. Every kernel that takes ``USE_PDL`` calls
:func:`pdl_prologue` before it touches global memory, so the stream order stays
what it was for every buffer a kernel reads or writes. The predecessor lets its
dependents launch with :func:`pdl_trigger` after its main loop, or implicitly when
its programs exit.

Measured on an H200 (batch-1 decode step, ``profile_decode``, 1B / 8B ms): triggering
at each kernel's start, the first version, let the next kernel's programs take SM
slots while the current grid still ran: 0.950 / 4.345 with the norm-fused linears,
against 0.902 / 4.060 with the trigger at exit and 0.889 / 4.022 after the main loop.

Tried and dropped: prefetching the small-M linear's weights into L2 before ``gdc_wait``
(batch-1 decode on an H200: 1B 0.98 → 1.07 ms, 8B 4.31 → 4.79 ms).

``FD_TRITON_PDL`` turns it off; it is also off under ``TRITON_INTERPRET=1``, on GPUs
before sm_90, and with a Triton that has no ``launch_pdl`` option.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from fastdeploy import envs
from fastdeploy.ops.triton_env import triton_interpreting

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


def _triton_has_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover
        return False
    return gdc_wait is not None and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if not envs.FD_TRITON_PDL or triton_interpreting() or not _triton_has_launch_pdl():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(tensor: torch.Tensor) -> bool:
    """Whether kernels launched on ``tensor``'s device use programmatic dependent launch."""
    return tensor.is_cuda and _pdl_on(tensor.device.index if tensor.device.index is not None else 0)


def pdl_kwargs(tensor: torch.Tensor) -> dict[str, Any]:
    """Launch arguments for a kernel with a ``USE_PDL`` constexpr: the flag and, when on, ``launch_pdl``."""
    if pdl_enabled(tensor):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next kernel launch once every program got here (kernels without it: at exit).

    Called after a kernel's main loop, before its epilogue: the next kernel's programs
    then take the SMs that the finishing ones free, instead of crowding them earlier."""
    if USE_PDL:
        gdc_launch_dependents()
