"""M-RoPE positions of a prompt with images and videos (Qwen2-VL's ``get_rope_index``).

Text tokens count up by one on all three rows. The tokens of an item with grid
``(t, h, w)`` (``h' = h / merge``, ``w' = w / merge`` after spatial merging) get
``(start + t_i * interval, start + h_i, start + w_i)`` in ``t, h, w`` raster
order, where ``start`` is the next text position and ``interval`` is 1, or for
Qwen2.5-VL videos ``tokens_per_second * second_per_grid_t`` (truncated after
multiplying). Text after an item continues at the item's largest position + 1,
as in the original Qwen2-VL code and vLLM. (For every image, and every video
whose temporal extent does not exceed its spatial one, this equals
``transformers`` 5's ``start + max(h', w')``.)

Generated tokens continue the count: token ``i >= num_prompt_tokens`` sits at
``i + delta`` on all rows, ``delta = max(prompt positions) + 1 - num_prompt_tokens``
(``rope_deltas`` in ``transformers``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastdeploy.core.mm_item import MMItem


def item_positions(
    item: MMItem, start: int, spatial_merge_size: int, tokens_per_second: float | None
) -> np.ndarray:
    """``[3, item.length]`` positions of one item whose first text-equivalent position is ``start``."""
    t, h, w = item.grid_thw
    gh, gw = h // spatial_merge_size, w // spatial_merge_size
    if t * gh * gw != item.length:
        raise ValueError(
            f"item {item.mm_hash[:12]}: grid_thw {list(item.grid_thw)} gives {t * gh * gw} tokens "
            f"(merge size {spatial_merge_size}), its placeholder has {item.length}"
        )
    interval: float = 1
    if item.modality == "video" and tokens_per_second is not None:
        interval = tokens_per_second * item.second_per_grid_t
    temporal = (np.arange(t) * interval).astype(np.int64)
    rows = np.stack(
        [
            np.repeat(temporal, gh * gw),
            np.tile(np.repeat(np.arange(gh), gw), t),
            np.tile(np.arange(gw), t * gh),
        ]
    )
    return rows + start


def mrope_positions(
    num_tokens: int,
    items: Sequence[MMItem],
    spatial_merge_size: int,
    tokens_per_second: float | None = None,
) -> tuple[np.ndarray, int]:
    """``([3, num_tokens]`` int64 positions of a prompt, ``delta``) for generated tokens."""
    pieces: list[np.ndarray] = []
    next_pos = 0
    text_start = 0
    for item in sorted(items, key=lambda it: it.offset):
        if item.offset < text_start or item.end > num_tokens:
            raise ValueError(f"multimodal items overlap or run past the prompt ({num_tokens} tokens)")
        text = item.offset - text_start
        pieces.append(np.broadcast_to(np.arange(next_pos, next_pos + text), (3, text)))
        next_pos += text
        rows = item_positions(item, next_pos, spatial_merge_size, tokens_per_second)
        pieces.append(rows)
        next_pos = int(rows.max()) + 1
        text_start = item.end
    tail = num_tokens - text_start
    pieces.append(np.broadcast_to(np.arange(next_pos, next_pos + tail), (3, tail)))
    positions = np.concatenate(pieces, axis=1).astype(np.int64)
    delta = (int(positions.max()) + 1 - num_tokens) if num_tokens else 0
    return positions, delta
