"""Meta-parameters of one tiled Triton GEMM launch, and the lookup in a table tuned by row count.

The FP8 block GEMM (:mod:`.triton_fp8_gemm`) and the fused-MoE grouped GEMM
(:mod:`.triton_fused_moe`) both pick their tiles from a table of ``(most rows, config)`` rows
measured on a GPU; this is their one config type and lookup.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TileConfig:
    """Triton meta-parameters of one launch: a ``block_m x block_n`` output tile per program,
    ``block_k`` columns per K step; ``group_m`` row blocks share a column block before the next
    one starts (L2 reuse of weight tiles)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


def table_config(table: tuple[tuple[int, TileConfig], ...], rows: int) -> TileConfig:
    """The config of the first table row whose bound holds ``rows`` (the last row's bound takes every size)."""
    return next(config for most, config in table if rows <= most)


def shared_memory_bytes(config: TileConfig, element_bytes: int) -> int:
    """Shared memory a launch's software pipeline takes, counted generously: ``num_stages``
    buffers of one ``block_m x block_k`` A tile and one ``block_k x block_n`` B tile."""
    return config.num_stages * (config.block_m + config.block_n) * config.block_k * element_bytes


@functools.cache
def device_shared_memory(device_index: int) -> int:
    """The most shared memory one program may use on this GPU (Triton's reading of the driver)."""
    import triton

    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def fit_shared_memory(config: TileConfig, element_bytes: int, limit: int) -> TileConfig:
    """``config``, or a smaller one whose pipeline fits ``limit`` bytes of shared memory: fewer
    stages (down to two), then half as many K columns a step. A table tuned for 2-byte
    activations asks for twice its budget in float32 (a 128 x 256 x 64 tile in four stages:
    384 KiB against the 227 KiB of an H100 or H200)."""
    while shared_memory_bytes(config, element_bytes) > limit:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_k > 16:
            config = replace(config, block_k=config.block_k // 2)
        else:
            break
    return config
