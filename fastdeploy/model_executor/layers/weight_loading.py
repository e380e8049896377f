"""How a parameter takes its values from a checkpoint: a loader and the checkpoint tensors it expects.

Every parameter may carry ``weight_loader(param, full_tensor, shard_id)``, which copies
this rank's part of the FULL checkpoint tensor into ``param`` (a slice of it for a
tensor-parallel layer, a region of a fused parameter for ``shard_id``), and
``checkpoint_shapes``: the full shape of each checkpoint tensor it is made from, by
shard id (``{None: shape}`` for a parameter loaded from one tensor). Model code maps
checkpoint names to (parameter, shard id) and calls the loader; it never slices.
Parameters without these attributes (norms) are copied whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ShardId = str | int | None
"""Which checkpoint tensor of a fused parameter: ``"q"``/``"k"``/``"v"`` of qkv, 0/1 of gate_up."""

WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """Copy the whole checkpoint tensor (a parameter every rank holds in full)."""
    param.data.copy_(loaded)


def set_weight_loader(
    param: nn.Parameter, loader: WeightLoader, shapes: dict[ShardId, tuple[int, ...]]
) -> None:
    """Give ``param`` its loader and the full checkpoint shapes it is loaded from."""
    param.weight_loader = loader
    param.checkpoint_shapes = {shard: tuple(shape) for shard, shape in shapes.items()}


def weight_loader(param: nn.Parameter) -> WeightLoader:
    """``param``'s loader (:func:`default_weight_loader` where it has none)."""
    return getattr(param, "weight_loader", default_weight_loader)


def checkpoint_shapes(param: nn.Parameter) -> dict[ShardId, tuple[int, ...]]:
    """Full checkpoint shape by shard id (``{None: param.shape}`` for a parameter loaded whole)."""
    shapes = getattr(param, "checkpoint_shapes", None)
    return shapes if shapes is not None else {None: tuple(param.shape)}


def copy_rows(dest: torch.Tensor, loaded: torch.Tensor, dim: int, start: int) -> None:
    """Copy ``loaded.narrow(dim, start, n)`` into ``dest`` (``n`` = ``dest``'s size along ``dim``,
    or fewer where ``loaded`` ends first: the rest of ``dest``, vocabulary padding, is zeroed)."""
    size = dest.shape[dim]
    available = max(0, min(size, loaded.shape[dim] - start))
    if available:
        dest.narrow(dim, 0, available).copy_(loaded.narrow(dim, start, available))
    if available < size:
        dest.narrow(dim, available, size - available).zero_()
