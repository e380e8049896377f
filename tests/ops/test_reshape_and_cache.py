"""reshape_and_cache_flash against a per-token Python reference, on random inputs."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.ops import reshape_and_cache_flash


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_scatter_matches_reference(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, heads, tokens = 12, 16, 4, 37
    key = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    key_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1  # padding tokens are skipped
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            ref_k[slot // block_size, slot % block_size] = key[t]
            ref_v[slot // block_size, slot % block_size] = value[t]
    reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto")
    assert torch.equal(key_cache, ref_k)
    assert torch.equal(value_cache, ref_v)


def test_only_the_first_len_slot_mapping_tokens_are_written():
    key = torch.randn(8, 2, 64)
    cache_k, cache_v = torch.randn(2, 4, 2, 64), torch.randn(2, 4, 2, 64)
    before = cache_k.clone()
    reshape_and_cache_flash(key, key, cache_k, cache_v, torch.tensor([0, 1, 2]), "auto")
    assert torch.equal(cache_k.view(-1, 2, 64)[:3], key[:3])
    assert torch.equal(cache_k.view(-1, 2, 64)[3:], before.view(-1, 2, 64)[3:])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"key": torch.randn(4, 2, 32)}, "heads/head_dim"),
        ({"slot_mapping": torch.zeros(4, dtype=torch.float32)}, "int32 or int64"),
        ({"slot_mapping": torch.zeros(9, dtype=torch.int64)}, "at most"),
        ({"value_cache": torch.randn(3, 4, 2, 64)}, "key_cache and value_cache"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "fp8_e4m3"),
    ],
)
def test_invalid_arguments_are_refused_with_a_clear_error(kwargs, message):
    args = {
        "key": torch.randn(4, 2, 64),
        "value": torch.randn(4, 2, 64),
        "key_cache": torch.randn(2, 4, 2, 64),
        "value_cache": torch.randn(2, 4, 2, 64),
        "slot_mapping": torch.arange(4),
        "kv_cache_dtype": "auto",
    }
    args.update(kwargs)
    if "key" in kwargs:
        args["value"] = kwargs["key"]
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        reshape_and_cache_flash(**args)
