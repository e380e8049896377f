"""Meta-parameters of one tiled Triton GEMM launch, and the lookup in a table tuned by row count.

The FP8 block GEMM (:mod:`.triton_fp8_gemm`) and the fused-MoE grouped GEMM
(:mod:`.triton_fused_moe`) both pick their tiles from a table of ``(most rows, config)`` rows
measured on a GPU; this is their one config type and lookup.
"""

from __future__ import annotations

from dataclasses import dataclass


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
