"""Per-slot block tables of the persistent batch."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """``[max_num_reqs, max_blocks_per_req]`` block ids on the host.

    Rows change only by appending the blocks the scheduler newly allocated; each step
    sends the used rows to the device with its other inputs (:func:`fastdeploy.ops.upload.upload`).
    """

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int):
        self.table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append(row, block_ids)

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise ValueError(
                f"request needs {end} blocks, more than max_model_len allows ({self.table.shape[1]})"
            )
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def clear_row(self, row: int) -> None:
        self.num_blocks[row] = 0

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """The given rows, trimmed to the longest row in use (a host copy)."""
        width = max(int(self.num_blocks[rows].max()) if len(rows) else 1, 1)
        return np.ascontiguousarray(self.table[rows, :width])
