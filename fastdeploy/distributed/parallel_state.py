"""This process's place in the tensor-parallel group, and the collectives the layers use.

The state is per process (one worker process = one rank), set once by
:func:`init_tensor_parallel` before the model is built; until then the process
is rank 0 of 1 and every collective returns its input.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelInfo:
    """Rank and size of this process's tensor-parallel group."""

    rank: int = 0
    size: int = 1


_INFO = TensorParallelInfo()


def tp_info() -> TensorParallelInfo:
    """This process's tensor-parallel rank and group size."""
    return _INFO


def tp_rank() -> int:
    return _INFO.rank


def tp_size() -> int:
    return _INFO.size


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """``numerator // denominator``; ValueError naming ``what`` unless it divides evenly."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def free_port_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` rendezvous address on a free port (single-host launches)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def init_tensor_parallel(size: int, rank: int, init_method: str, device: torch.device) -> None:
    """Join the tensor-parallel group of ``size`` ranks as ``rank`` (NCCL on CUDA, gloo on CPU).

    Size 1 sets the state without a process group.
    """
    global _INFO
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank, **kwargs)
    _INFO = TensorParallelInfo(rank=rank, size=size)


def destroy_tensor_parallel() -> None:
    """Leave the group (if any) and become rank 0 of 1 again."""
    global _INFO
    if dist.is_initialized():
        dist.destroy_process_group()
    _INFO = TensorParallelInfo()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place (``x`` itself at one rank)."""
    if _INFO.size > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (``x`` at one rank)."""
    if _INFO.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_INFO.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def tp_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank, in place."""
    if _INFO.size > 1:
        dist.broadcast(x, src=src)
    return x
