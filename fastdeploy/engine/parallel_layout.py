"""Checks that a parallel layout can run before any process starts: one clear error instead of a hang.

Tensor parallelism splits the attention heads by whole GQA groups and the MLP
evenly, and needs a GPU per rank on CUDA; data parallelism multiplies the GPUs.
"""

from __future__ import annotations

import torch

from fastdeploy.config import EngineConfig
from fastdeploy.distributed.multinode import NodeLayoutError, check_node_flags
from fastdeploy.model_executor.layers.parallel_linear import shard_heads
from fastdeploy.platforms import resolve_device
from fastdeploy.transformers_utils.config import ModelArchConfig


class ParallelLayoutError(ValueError):
    """The requested tensor- / data-parallel layout cannot run this model on this machine."""


def check_parallel_layout(config: EngineConfig, arch: ModelArchConfig) -> None:
    """Raise :class:`ParallelLayoutError` naming the problem unless the layout can run."""
    parallel = config.parallel
    tp, dp = parallel.tensor_parallel_size, parallel.data_parallel_size
    if tp < 1 or dp < 1:
        raise ParallelLayoutError(f"tensor_parallel_size ({tp}) and data_parallel_size ({dp}) must be >= 1")
    if not 0 <= parallel.data_parallel_rank < dp:
        raise ParallelLayoutError(f"data_parallel_rank ({parallel.data_parallel_rank}) must lie in [0, {dp})")
    try:
        check_node_flags(parallel)
    except NodeLayoutError as exc:
        raise ParallelLayoutError(str(exc)) from None
    device = resolve_device(config)
    if device.type == "cuda":
        if device.index is not None and tp * dp > 1:
            raise ParallelLayoutError(
                f"--device {device} names one GPU, but tensor_parallel_size x data_parallel_size = {tp * dp} "
                "workers need one each; use --device cuda (and CUDA_VISIBLE_DEVICES to pick GPUs)"
            )
        visible = torch.cuda.device_count()
        local = tp * dp // parallel.nnodes
        if local > visible:
            per_node = f" on each of {parallel.nnodes} nodes" if parallel.nnodes > 1 else ""
            raise ParallelLayoutError(
                f"tensor_parallel_size {tp} x data_parallel_size {dp} needs {local} GPUs{per_node}, "
                f"but {visible} {'is' if visible == 1 else 'are'} visible"
            )
    if parallel.enable_expert_parallel:
        check_expert_parallel(config, arch)
    if tp == 1:
        return
    try:
        for rank in range(tp):
            shard_heads(arch.num_attention_heads, arch.num_key_value_heads, tp, rank)
    except ValueError as exc:
        raise ParallelLayoutError(str(exc)) from None
    if arch.intermediate_size % tp:
        raise ParallelLayoutError(
            f"the MLP's intermediate size ({arch.intermediate_size}) is not divisible by "
            f"tensor_parallel_size {tp}"
        )


def check_expert_parallel(config: EngineConfig, arch: ModelArchConfig) -> None:
    """Expert parallelism needs a mixture-of-experts model, more than one worker, an even split of the
    experts, and (spanning replicas) steps that run one at a time."""
    parallel = config.parallel
    size = parallel.tensor_parallel_size * parallel.data_parallel_size
    if arch.num_experts == 0:
        raise ParallelLayoutError(
            f"enable_expert_parallel needs a mixture-of-experts model; {arch.architecture} has no experts"
        )
    if size == 1:
        raise ParallelLayoutError(
            "enable_expert_parallel needs tensor_parallel_size or data_parallel_size > 1"
        )
    if arch.num_experts % size:
        raise ParallelLayoutError(
            f"the model's {arch.num_experts} experts cannot be split evenly over "
            f"tensor_parallel_size x data_parallel_size = {size} expert-parallel ranks"
        )
