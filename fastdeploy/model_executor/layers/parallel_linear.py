"""Tensor-parallel linear layers: each rank holds a slice of the weight and loads it from the full tensor.

All four are :class:`~fastdeploy.model_executor.layers.linear.Linear` (oneDNN prepack on a
CPU, the Triton small-M kernels on a GPU) over this rank's shard; at one rank they are
exactly ``Linear``. The rank and group size are read from :mod:`fastdeploy.distributed`
when the layer is built, so :func:`~fastdeploy.distributed.init_tensor_parallel` must run first.

- :class:`ColumnParallelLinear` splits the output features (rows of the weight): the input
  is the full activation, the output this rank's slice of the features.
- :class:`MergedColumnParallelLinear` is several column-parallel layers side by side
  (``gate_up_proj`` = gate and up), each split on its own, so rank r holds [gate_r | up_r].
- :class:`QKVParallelLinear` splits the attention heads (:func:`shard_heads`): rank r holds
  whole GQA groups, its query heads and the key/value heads they read (KV heads replicated
  when there are fewer than ranks).
- :class:`RowParallelLinear` splits the input features: the input is a column-parallel
  layer's output slice, the partial products are summed over the ranks (all-reduce), and
  the bias is added once, after the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fastdeploy.distributed import divide, tp_all_reduce, tp_rank, tp_size
from fastdeploy.model_executor.layers.linear import Linear
from fastdeploy.model_executor.layers.weight_loading import ShardId

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one tensor-parallel rank holds, whole GQA groups (every local query
    head reads a local KV head): the checkpoint's query heads ``head_start`` onwards
    (``num_heads`` of them) and KV heads ``kv_head_start`` onwards (``num_kv_heads``)."""

    num_heads: int
    num_kv_heads: int
    head_start: int
    kv_head_start: int


def shard_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """The heads rank ``rank`` of ``size`` holds.

    With at least as many KV heads as ranks, rank r holds KV heads
    ``[r*K//N, (r+1)*K//N)`` and the query heads of their GQA groups: an even split when N
    divides K, else whole groups unevenly (SmolLM2's 9 heads / 3 KV heads over 2 ranks:
    3 + 6 query heads, 1 + 2 KV heads). With fewer KV heads than ranks, N must be a
    multiple of K: each KV head is replicated on N/K ranks, which split its group's query
    heads evenly (so N must divide the query heads too). ValueError naming the attention
    heads for any other layout.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not form groups of {num_kv_heads} key/value heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_end = rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size
        return HeadShard(group * (kv_end - kv_start), kv_end - kv_start, group * kv_start, kv_start)
    if size % num_kv_heads or num_heads % size:
        raise ValueError(
            f"cannot split {num_heads} attention heads ({num_kv_heads} key/value heads) over a "
            f"tensor-parallel size of {size}: with fewer key/value heads than ranks, the size must be "
            f"a multiple of the key/value heads and divide the attention heads"
        )
    local = num_heads // size
    return HeadShard(local, 1, rank * local, rank * local // group)


def local_heads(num_heads: int, num_kv_heads: int) -> HeadShard:
    """:func:`shard_heads` for this process's rank (what its attention layers and KV cache hold)."""
    return shard_heads(num_heads, num_kv_heads, tp_size(), tp_rank())


class ColumnParallelLinear(Linear):
    """``y = x W^T + b`` with W's rows (output features) split over the ranks.

    Rank r holds rows ``[r * out/N, (r+1) * out/N)`` of the weight and bias and returns
    those output features; the input is the full activation.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        weight_shapes: dict[ShardId, tuple[int, int]] | None = None,
    ):
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.full_out_features = out_features
        super().__init__(
            in_features,
            divide(out_features, self.tp_size, "output features"),
            bias=bias,
            quant_config=quant_config,
            weight_shapes=weight_shapes or {None: (out_features, in_features)},
        )

    def weight_region(self, shard_id: ShardId = None) -> tuple[int, int, int, int]:
        """This rank's rows of the full ``[out, in]`` weight (or ``[out]`` bias)."""
        return 0, 0, self.out_features, self.tp_rank * self.out_features


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel layers of ``output_sizes`` fused into one weight (``gate_up_proj``).

    Each part is split over the ranks on its own, so that rank r holds rows
    ``[part_0 shard r | part_1 shard r | ...]``; the checkpoint has one tensor per part
    (shard ids 0, 1, ...).
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
    ):
        size = tp_size()
        self.local_sizes = [divide(n, size, "output features") for n in output_sizes]
        self.output_sizes = list(output_sizes)
        shapes = {i: (n, in_features) for i, n in enumerate(output_sizes)}
        super().__init__(in_features, sum(output_sizes), bias, quant_config, shapes)

    def weight_region(self, shard_id: ShardId = None) -> tuple[int, int, int, int]:
        """This rank's rows of part ``shard_id``, in that part's region of the fused weight."""
        local = self.local_sizes[shard_id]
        return 0, sum(self.local_sizes[:shard_id]), local, self.tp_rank * local


class QKVParallelLinear(Linear):
    """The fused q/k/v projection with the attention heads split over the ranks (column-parallel).

    Rank r's output is ``[its q heads | its k heads | its v heads]``, ``head_dim`` each, as
    :func:`shard_heads` assigns them (:attr:`heads`; :attr:`num_heads` / :attr:`num_kv_heads`
    are the local counts): whole GQA groups, KV heads replicated when there are fewer
    than ranks. The checkpoint has q, k and v tensors (shard ids "q", "k", "v").
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
    ):
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.head_dim = head_dim
        self.heads = shard_heads(total_num_heads, total_num_kv_heads, self.tp_size, self.tp_rank)
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        full_q, full_kv = total_num_heads * head_dim, total_num_kv_heads * head_dim
        shapes = {"q": (full_q, hidden_size), "k": (full_kv, hidden_size), "v": (full_kv, hidden_size)}
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, quant_config, shapes)

    def weight_region(self, shard_id: ShardId = None) -> tuple[int, int, int, int]:
        """This rank's heads of the full q, k or v tensor, in their region of the fused weight."""
        if shard_id == "q":
            return 0, 0, self.q_size, self.heads.head_start * self.head_dim
        if shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            return 0, offset, self.kv_size, self.heads.kv_head_start * self.head_dim
        raise ValueError(f"qkv_proj loads shards 'q', 'k' and 'v', not {shard_id!r}")


class RowParallelLinear(Linear):
    """``y = x W^T + b`` with W's columns (input features) split over the ranks.

    Rank r holds columns ``[r * in/N, (r+1) * in/N)`` (or its ``input_shard``) and takes the
    matching slice of the input (a column-parallel layer's output); the partial products
    are all-reduced in :meth:`forward`, so every rank returns the full ``y``, and the bias
    (held whole) is added once after the sum. The all-reduce comes before whatever follows
    (the next norm), which is what makes the fused norm-in-linear paths correct at any size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_shard: tuple[int, int] | None = None,
        quant_config: QuantizationConfig | None = None,
    ):
        """``input_shard`` = (first input feature, count) of this rank, for a split that is not
        even (o_proj over :func:`shard_heads`' uneven heads); default the even split."""
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.full_in_features = in_features
        if input_shard is None:
            local = divide(in_features, self.tp_size, "input features")
            input_shard = (self.tp_rank * local, local)
        self.input_start = input_shard[0]
        shapes = {None: (out_features, in_features)}
        super().__init__(input_shard[1], out_features, bias, quant_config, shapes)

    def weight_region(self, shard_id: ShardId = None) -> tuple[int, int, int, int]:
        """This rank's columns of the full ``[out, in]`` weight (the bias is loaded whole)."""
        return 1, 0, self.in_features, self.input_start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        return self._reduce(self.matmul(x, None))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))`` for this rank's ``[gate | up]`` slice, then the all-reduce."""
        if self.tp_size == 1:
            return self.matmul_silu_mul(gate_up, self.bias)
        return self._reduce(self.matmul_silu_mul(gate_up, None))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        out = tp_all_reduce(partial)
        return out if self.bias is None else out + self.bias
