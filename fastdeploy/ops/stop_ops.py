"""The "is any request still running" flag, kept on the device and read through pinned memory.

After sampling, the model runner has per-request ``stop_flags`` on the device
(its stop codes, non-zero where the request ends). :func:`set_stop` reduces
them to one int32 (1 while any request is not stopped, else 0; FastDeploy's
``not_need_stop``) and writes it to ``flag_device`` (for later device work) and
to ``flag_host`` (pinned host memory), on the current stream and without any
host synchronisation. :func:`get_stop` reads ``flag_host`` on the host, again
without a synchronisation: the runner does so when it saves the step
(``ModelRunner.any_running``), and with async scheduling skips sampling the next
step when every request it holds has already ended.

Memory-ordering contract: ``flag_host`` holds the new value only after the
work queued before it has run. The caller records a CUDA event on the same
stream after :func:`set_stop` and waits for it (``event.synchronize()``, or
``event.query()`` returning True) before :func:`get_stop`; until then the host
reads the previous or the new value, never a torn one. Do not call
:func:`set_stop` again on the same buffers before that read. On the CPU (the
torch fallback with CPU tensors) everything is synchronous and the rule holds
trivially.
"""

from __future__ import annotations

import torch

from fastdeploy.ops._ext import cuda_op, has_cuda_ops


def alloc_stop_flag(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flag_device, flag_host)``: int32 ``[1]`` on ``device`` and on the host (pinned for CUDA), both 0."""
    device = torch.device(device)
    flag_device = torch.zeros(1, dtype=torch.int32, device=device)
    flag_host = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
    return flag_device, flag_host


def set_stop(stop_flags: torch.Tensor, flag_device: torch.Tensor, flag_host: torch.Tensor) -> None:
    """Write ``int(not all(stop_flags))`` to ``flag_device`` and (asynchronously) to ``flag_host``.

    ``stop_flags`` is a bool tensor of any shape (one entry per request; an
    empty batch counts as "nothing running"); see the module docstring for
    when ``flag_host`` may be read. Uses the CUDA kernel of ``fastdeploy_ops``
    for CUDA tensors when it is loaded, :func:`set_stop_torch` otherwise.
    """
    if stop_flags.is_cuda and has_cuda_ops():
        _validate(stop_flags, flag_device, flag_host)  # never let an error be thrown inside the extension
        cuda_op("set_stop")(stop_flags, flag_device, flag_host)
        return
    set_stop_torch(stop_flags, flag_device, flag_host)


def set_stop_torch(stop_flags: torch.Tensor, flag_device: torch.Tensor, flag_host: torch.Tensor) -> None:
    """Torch :func:`set_stop`: a reduction, a device copy and a non-blocking copy into pinned memory."""
    _validate(stop_flags, flag_device, flag_host)
    running = torch.logical_not(stop_flags).any().to(torch.int32)
    flag_device.view(-1).copy_(running.view(1))
    flag_host.view(-1).copy_(flag_device.view(-1), non_blocking=True)


def get_stop(flag_host: torch.Tensor) -> bool:
    """True while at least one request is still running, as last published by :func:`set_stop`.

    Reads host memory only: no CUDA call and no synchronisation, so the caller
    must first wait on an event recorded after :func:`set_stop` (module docstring).
    """
    if has_cuda_ops():
        return bool(cuda_op("get_stop")(flag_host))
    if flag_host.device.type != "cpu" or flag_host.dtype != torch.int32 or flag_host.numel() != 1:
        raise ValueError(
            "get_stop: flag_host must be a CPU int32 tensor with one element; "
            f"got {flag_host.dtype} of shape {tuple(flag_host.shape)} on {flag_host.device}"
        )
    return bool(flag_host.reshape(()).item())


def _validate(stop_flags: torch.Tensor, flag_device: torch.Tensor, flag_host: torch.Tensor) -> None:
    if stop_flags.dtype != torch.bool:
        raise TypeError(f"set_stop: stop_flags must be bool, got {stop_flags.dtype}")
    if (
        flag_device.dtype != torch.int32
        or flag_device.numel() != 1
        or flag_device.device != stop_flags.device
    ):
        raise ValueError(
            f"set_stop: flag_device must be int32 with one element on {stop_flags.device}; "
            f"got {flag_device.dtype} of shape {tuple(flag_device.shape)} on {flag_device.device}"
        )
    if flag_host.dtype != torch.int32 or flag_host.numel() != 1 or flag_host.device.type != "cpu":
        raise ValueError(
            "set_stop: flag_host must be a CPU int32 tensor with one element; "
            f"got {flag_host.dtype} of shape {tuple(flag_host.shape)} on {flag_host.device}"
        )
    if stop_flags.is_cuda and not flag_host.is_pinned():
        raise ValueError(
            "set_stop: flag_host must be in pinned memory (tensor.pin_memory()) for CUDA stop_flags"
        )
