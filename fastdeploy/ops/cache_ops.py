"""Writing new keys and values into the paged KV cache."""

from __future__ import annotations

import torch


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``key``/``value`` of shape ``[T, H, D]`` into NHD caches.

    The caches are ``[num_blocks, block_size, H, D]``; token ``t`` goes to flat
    slot ``slot_mapping[t]`` (``block * block_size + offset``); a negative slot
    means "skip this token" (padding). Only the first ``len(slot_mapping)``
    rows of ``key``/``value`` are read.
    """
    _validate(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    num_tokens = slot_mapping.shape[0]
    key, value = key[:num_tokens], value[:num_tokens]
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        key, value, slots = key[valid], value[valid], slots[valid]
    num_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))


def _validate(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
) -> None:
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the torch fallback")
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [tokens, heads, head_dim]; got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, heads, head_dim]; "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key heads/head_dim {tuple(key.shape[1:])} do not match the cache's {tuple(key_cache.shape[2:])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(
            f"slot_mapping must be 1-D with at most {key.shape[0]} entries; got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
