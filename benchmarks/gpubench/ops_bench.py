"""Kernel bandwidth: ``reshape_and_cache_flash`` and the Triton decode attention.

Each figure is bytes moved per call / time per call, also as a fraction of the
measured copy bandwidth (which counts read + written bytes the same way). Inputs
are rotated over several independent sets whose total exceeds ``ROTATE_BYTES`` so
that a small working set is not served from the L2 cache.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .measure import error_text, time_per_call

ROTATE_BYTES = 256 << 20
"""Total bytes touched by one pass over the rotated input sets (H100/H200 L2: 50 MiB)."""
MAX_SETS = 64


def _num_sets(bytes_per_call: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(1, bytes_per_call))))


def _random_cache(
    shape: tuple[int, ...], fp8: bool, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    values = torch.randn(shape, device=device, dtype=dtype)
    return values.to(torch.float8_e4m3fn) if fp8 else values


def bench_reshape_and_cache(
    num_tokens: int, kv_heads: int, head_dim: int, block_size: int, kv_cache_dtype: str,
    device: torch.device, dtype: torch.dtype = torch.bfloat16, iters: int = 50,
) -> dict[str, Any]:  # fmt: skip
    """Time one ``reshape_and_cache_flash`` call writing ``num_tokens`` keys and values.

    Slots: each set fills its own randomly placed blocks in order (as prefills and decodes
    do). Bytes: keys + values read, cache rows written (fp8: one byte per value plus a
    float32 scale per token and head), and the int64 slot mapping.
    """
    from fastdeploy.ops import has_cuda_ops, reshape_and_cache_flash
    from fastdeploy.ops.cache_ops import check_fp8_supported

    fp8 = kv_cache_dtype != "auto"
    if fp8:
        check_fp8_supported(device)
    in_bytes = 2 * num_tokens * kv_heads * head_dim * dtype.itemsize
    out_bytes = 2 * num_tokens * kv_heads * (head_dim * (1 if fp8 else dtype.itemsize) + (4 if fp8 else 0))
    moved = in_bytes + out_bytes + num_tokens * 8
    sets = _num_sets(moved, device)
    blocks_per_set = -(-num_tokens // block_size)
    num_blocks = sets * blocks_per_set
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    key_cache = torch.zeros(cache_shape, device=device, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    scales = [torch.ones(cache_shape[:3], device=device) for _ in range(2)] if fp8 else [None, None]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(device)
    offsets = torch.arange(num_tokens, device=device)
    inputs = []
    for s in range(sets):
        blocks = perm[s * blocks_per_set : (s + 1) * blocks_per_set]
        slots = blocks[offsets // block_size] * block_size + offsets % block_size
        key = torch.randn(num_tokens, kv_heads, head_dim, device=device, dtype=dtype)
        inputs.append((key, torch.randn_like(key), slots.to(torch.int64)))

    def call(i: int) -> None:
        key, value, slots = inputs[i % sets]
        reshape_and_cache_flash(key, value, key_cache, value_cache, slots, kv_cache_dtype, *scales)

    seconds = time_per_call(call, device, iters=max(iters, sets))
    return {
        "op": "reshape_and_cache_flash",
        "kv_cache_dtype": "fp8_e4m3" if fp8 else str(dtype).replace("torch.", ""),
        "shape": f"{num_tokens} tokens x {kv_heads} kv heads x {head_dim}",
        "implementation": "fastdeploy_ops (CUDA)"
        if device.type == "cuda" and has_cuda_ops()
        else "torch/CPU fallback",
        "bytes_per_call": moved,
        "input_sets": sets,
        "seconds_per_call": seconds,
        "bytes_per_s": moved / seconds,
    }


def bench_decode_attention(
    batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
    kv_cache_dtype: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, iters: int = 20,
) -> dict[str, Any]:  # fmt: skip
    """Time one decode-attention call (``TritonAttentionBackend.forward`` of one layer).

    ``batch`` requests, each with ``context`` tokens in randomly placed blocks; the block
    table is exactly as wide as the context (the engine's is ``max_model_len`` wide, which
    only changes the split count). Bytes: the KV cache rows read (fp8: plus their scales);
    queries and outputs are ignored (under 0.1%).
    """
    from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
    from fastdeploy.model_executor.attention.triton_backend import TritonAttentionBackend
    from fastdeploy.ops.cache_ops import check_fp8_supported
    from fastdeploy.ops.triton_attention import decode_num_splits

    fp8 = kv_cache_dtype != "auto"
    if fp8:
        check_fp8_supported(device)
    elem = 1 if fp8 else dtype.itemsize
    kv_bytes = 2 * batch * context * kv_heads * (head_dim * elem + (4 if fp8 else 0))
    sets = _num_sets(kv_bytes, device)
    blocks_per_req = -(-context // block_size)
    num_blocks = sets * batch * blocks_per_req
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = _random_cache(cache_shape, fp8, device, dtype)
    value_cache = _random_cache(cache_shape, fp8, device, dtype)
    kv_scales = tuple(torch.rand(cache_shape[:3], device=device) * 0.01 for _ in range(2)) if fp8 else None
    layer = SimpleNamespace(
        kv_cache=(key_cache, value_cache),
        kv_cache_dtype="fp8_e4m3" if fp8 else "auto",
        kv_scales=kv_scales,
        scale=head_dim**-0.5,
    )
    backend = TritonAttentionBackend()
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    seq_lens_cpu = np.full(batch, context, dtype=np.int32)
    qsl_cpu = np.arange(batch + 1, dtype=np.int32)
    sets_data = []
    for s in range(sets):
        table = perm[s * batch * blocks_per_req : (s + 1) * batch * blocks_per_req].view(
            batch, blocks_per_req
        )
        common = CommonAttentionMetadata(
            num_reqs=batch,
            num_actual_tokens=batch,
            query_start_loc=torch.from_numpy(qsl_cpu).to(device),
            seq_lens=torch.from_numpy(seq_lens_cpu).to(device),
            block_table=table.to(device=device, dtype=torch.int32),
            slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=1,
            max_seq_len=context,
            block_size=block_size,
        )
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype)
        sets_data.append((q, backend.build(common)))

    def call(i: int) -> None:
        q, meta = sets_data[i % sets]
        backend.forward(layer, q, None, None, meta)

    seconds = time_per_call(call, device, iters=max(iters, sets))
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return {
        "op": "decode_attention (triton)",
        "kv_cache_dtype": "fp8_e4m3" if fp8 else str(dtype).replace("torch.", ""),
        "shape": f"batch {batch} x {context} ctx, {q_heads}/{kv_heads} heads x {head_dim}, block {block_size}",
        "num_splits": decode_num_splits(batch, kv_heads, blocks_per_req * block_size, num_sms),
        "bytes_per_call": kv_bytes,
        "input_sets": sets,
        "seconds_per_call": seconds,
        "bytes_per_s": kv_bytes / seconds,
    }


def ops_section(s: Any, copy_bytes_per_s: float) -> dict[str, Any]:
    """Every op measurement of the settings ``s``; each row also as a fraction of the copy bandwidth."""
    q_heads, kv_heads, head_dim, block_size = s.op_heads
    rows: list[dict[str, Any]] = []
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        for tokens in s.reshape_tokens:
            try:
                rows.append(
                    bench_reshape_and_cache(tokens, kv_heads, head_dim, block_size, kv_cache_dtype, s.device)
                )
            except Exception:
                rows.append(
                    {
                        "op": "reshape_and_cache_flash",
                        "kv_cache_dtype": kv_cache_dtype,
                        "shape": f"{tokens} tokens",
                        "error": error_text(),
                    }
                )
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        for batch, context in s.decode_shapes:
            shape = f"batch {batch} x {context} ctx"
            if s.device.type != "cuda":
                rows.append(
                    {
                        "op": "decode_attention (triton)",
                        "kv_cache_dtype": kv_cache_dtype,
                        "shape": shape,
                        "skipped": "needs CUDA",
                    }
                )
                continue
            try:
                rows.append(
                    bench_decode_attention(
                        batch, context, q_heads, kv_heads, head_dim, block_size, kv_cache_dtype, s.device
                    )
                )
            except Exception:
                rows.append(
                    {
                        "op": "decode_attention (triton)",
                        "kv_cache_dtype": kv_cache_dtype,
                        "shape": shape,
                        "error": error_text(),
                    }
                )
    for row in rows:
        if "bytes_per_s" in row:
            row["fraction_of_copy"] = row["bytes_per_s"] / copy_bytes_per_s
    return {"copy_bytes_per_s": copy_bytes_per_s, "rows": rows}
