"""This process's place in the tensor- and expert-parallel groups, and the collectives the layers use.

The state is per process (one worker process = one rank), set once by
:func:`init_tensor_parallel` before the model is built; until then the process
is rank 0 of 1 and every collective returns its input.

Layouts: the ``torch.distributed`` world is the tensor-parallel group (TP alone, or
TP + EP, where the expert-parallel group is the same ranks), or, when expert
parallelism spans data-parallel replicas, all ``dp x tp`` workers of every engine
core: world rank ``dp_rank * tp + tp_rank``, each replica's ranks a TP subgroup, the
world the expert-parallel group.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelInfo:
    """Rank and size of this process's tensor-parallel group."""

    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class ExpertParallelInfo:
    """Rank and size of this process's expert-parallel group (size 1: every rank holds every expert)."""

    rank: int = 0
    size: int = 1


_INFO = TensorParallelInfo()
_EP_INFO = ExpertParallelInfo()
_TP_GROUP: dist.ProcessGroup | None = None
"""The tensor-parallel subgroup when the world is larger (expert parallelism over DP replicas); None: the world."""
_EP_HOST_GROUP: dist.ProcessGroup | None = None
"""A gloo group over the expert-parallel world when it spans replicas on GPUs: the per-step
agreement on the padded token count travels on the host, not through the device."""
_EP_STEP_TOKENS: int | None = None
"""The most tokens any expert-parallel rank has in the forward pass in progress (see :func:`ep_step_tokens`)."""


def tp_info() -> TensorParallelInfo:
    """This process's tensor-parallel rank and group size."""
    return _INFO


def tp_rank() -> int:
    return _INFO.rank


def tp_size() -> int:
    return _INFO.size


def ep_info() -> ExpertParallelInfo:
    """This process's expert-parallel rank and group size."""
    return _EP_INFO


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


def init_tensor_parallel(
    size: int,
    rank: int,
    init_method: str,
    device: torch.device,
    *,
    expert_parallel: bool = False,
    dp_size: int = 1,
    dp_rank: int = 0,
    store: dist.Store | None = None,
) -> None:
    """Join the tensor-parallel group of ``size`` ranks as ``rank`` (NCCL on CUDA, gloo on CPU).

    ``expert_parallel``: the experts are split over the expert-parallel group: the TP ranks
    (``dp_size`` 1), or all ``dp_size x size`` workers of every data-parallel replica, which
    then meet at ``init_method`` in one world, each replica's ranks a TP subgroup. ``store``
    (multi-host launches): the world is always all ``dp_size x size`` workers, meeting in this
    store instead of at ``init_method``. One rank alone sets the state without a process group.
    """
    global _INFO, _EP_INFO, _TP_GROUP, _EP_HOST_GROUP
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    spans_dp = (expert_parallel or store is not None) and dp_size > 1
    world, world_rank = (dp_size * size, dp_rank * size + rank) if spans_dp else (size, rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict = {"device_id": device} if device.type == "cuda" else {}
        kwargs.update({"store": store} if store is not None else {"init_method": init_method})
        dist.init_process_group(backend, world_size=world, rank=world_rank, **kwargs)
    _TP_GROUP = None
    if spans_dp and size > 1:  # every rank creates every replica's subgroup, in the same order
        for replica in range(dp_size):
            group = dist.new_group(list(range(replica * size, (replica + 1) * size)))
            if replica == dp_rank:
                _TP_GROUP = group
    _EP_HOST_GROUP = None
    if expert_parallel and spans_dp:
        _EP_HOST_GROUP = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    _INFO = TensorParallelInfo(rank=rank, size=size)
    _EP_INFO = ExpertParallelInfo(world_rank, world) if expert_parallel else ExpertParallelInfo()


def destroy_tensor_parallel() -> None:
    """Leave the group (if any) and become rank 0 of 1 again."""
    global _INFO, _EP_INFO, _TP_GROUP, _EP_HOST_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _INFO, _EP_INFO, _TP_GROUP, _EP_HOST_GROUP = TensorParallelInfo(), ExpertParallelInfo(), None, None


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place (``x`` itself at one rank)."""
    if _INFO.size > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (``x`` at one rank)."""
    if _INFO.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_INFO.size)]
    dist.all_gather(parts, x, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def tp_all_gather_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Every TP rank's ``x`` (rank r's has ``rows[r]`` rows, possibly 0) concatenated in rank order."""
    if _INFO.size == 1:
        return x
    width = max(rows)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(_INFO.size)]
    dist.all_gather(parts, padded, group=_TP_GROUP)
    return torch.cat([part[:n] for part, n in zip(parts, rows)])


def ep_spans_replicas() -> bool:
    """Whether the expert-parallel group is larger than the tensor-parallel one: each data-parallel
    replica has its own tokens, which the MoE layers gather from every replica."""
    return _EP_INFO.size > _INFO.size


def ep_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every expert-parallel rank's ``x`` (the same shape on each) stacked along dim 0 in rank order."""
    out = x.new_empty((_EP_INFO.size * x.shape[0], *x.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch < 2.13)
    gather(out, x.contiguous())
    return out


def ep_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the expert-parallel ranks, split along dim 0 into equal parts: this rank's part."""
    out = x.new_empty((x.shape[0] // _EP_INFO.size, *x.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (torch < 2.13)
    scatter(out, x.contiguous())
    return out


def ep_agree_step(num_tokens: int, graphable: bool) -> tuple[int, bool]:
    """One host exchange over the expert-parallel ranks before a forward pass in which they meet:
    (the most tokens any rank has, whether every rank can replay a CUDA graph)."""
    if _EP_HOST_GROUP is None:
        return num_tokens, graphable
    flags = torch.tensor([num_tokens, int(not graphable)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=_EP_HOST_GROUP)
    return int(flags[0]), not flags[1]


@contextlib.contextmanager
def ep_step_tokens(num_tokens: int) -> Iterator[None]:
    """Tell the MoE layers of the forward pass inside the most tokens any expert-parallel rank has
    (from :func:`ep_agree_step`, or a captured graph's size), so that they pad to it without a
    device-to-host read of their own."""
    global _EP_STEP_TOKENS
    previous, _EP_STEP_TOKENS = _EP_STEP_TOKENS, num_tokens
    try:
        yield
    finally:
        _EP_STEP_TOKENS = previous


def ep_max_tokens(num_tokens: int, device: torch.device) -> int:
    """The most tokens any expert-parallel rank has in this forward pass: the value set by
    :func:`ep_step_tokens`, or else one all-reduce read back on the host (eager calls outside the
    runner: tests, start-up passes)."""
    if _EP_STEP_TOKENS is not None:
        return _EP_STEP_TOKENS
    count = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def tp_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank, in place."""
    if _INFO.size > 1:
        dist.broadcast(x, group=_TP_GROUP, group_src=src)
    return x
