"""Kernel bandwidth: ``reshape_and_cache_flash``, the Triton decode attention and the
small-M linear layers of batch-1 decode (cuBLAS against the Triton small-M kernel).

Each figure is bytes moved per call / time per call, also as a fraction of the
measured copy bandwidth (which counts read + written bytes the same way). Inputs
are rotated over several independent sets whose total exceeds ``ROTATE_BYTES`` so
that a small working set is not served from the L2 cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .measure import error_text, free_memory, time_per_call

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


GEMV_SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "Llama-3.1-8B": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
    "Llama-3.2-1B": [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048)],
}
"""(layer, in_features K, out_features N) of the decoder layer's linears, bf16, no bias."""
GEMV_SMOKE_SHAPES = {"tiny": [("qkv", 128, 512), ("o", 256, 128), ("gate_up", 128, 512), ("down", 256, 128)]}
"""The ``--smoke`` model's shapes (benchmarks/gpubench/settings.py TINY_OVERRIDES)."""
GRAPH_CALLS = 32


def _time_calls(call: Callable[[int], Any], sets: int, device: torch.device) -> float:
    """Seconds per ``call(i)``: on a GPU, replays of a CUDA graph of at least ``GRAPH_CALLS``
    calls over the rotated sets (a 3-30 µs kernel launched from Python would time the host,
    and decode replays graphs too); on a CPU, back-to-back calls."""
    if device.type != "cuda":
        return time_per_call(call, device, iters=max(3, sets))
    calls = sets * math.ceil(GRAPH_CALLS / sets)
    for i in range(sets):  # warm-up outside capture: compiles and autotunes
        call(i)
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            call(i)
    return time_per_call(lambda _: graph.replay(), device, iters=5) / calls


def bench_small_m_linear(
    model: str, layer: str, k: int, n: int, silu_mul: bool, device: torch.device,
    dtype: torch.dtype = torch.bfloat16, m: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Time ``m`` rows through one linear layer: ``F.linear`` (cuBLAS) against ``small_m_linear``.

    With ``silu_mul`` the input is ``gate_up`` (``[m, 2k]``) and the baseline is
    ``F.linear(silu_and_mul(gate_up))`` (two kernels) against the fused kernel. Bytes: the
    weight (the activations are under 0.1% of it). The Triton rows run on CUDA, or on a CPU
    under ``TRITON_INTERPRET=1``; otherwise they are marked skipped.
    """
    from fastdeploy.ops.layer_ops import silu_and_mul

    weight_bytes = n * k * dtype.itemsize
    sets = _num_sets(weight_bytes, device)
    weights = [torch.randn(n, k, device=device, dtype=dtype) * k**-0.5 for _ in range(sets)]
    inputs = [torch.randn(m, 2 * k if silu_mul else k, device=device, dtype=dtype) for _ in range(sets)]
    row: dict[str, Any] = {
        "op": "small_m_linear",
        "model": model,
        "layer": layer + (" + silu_and_mul" if silu_mul else ""),
        "shape": f"{m} x {inputs[0].shape[1]} -> {n}",
        "weight_bytes": weight_bytes,
        "input_sets": sets,
        "baseline": "silu_and_mul + F.linear" if silu_mul else "F.linear",
    }

    def baseline(i: int) -> None:
        x = inputs[i % sets]
        F.linear(silu_and_mul(x) if silu_mul else x, weights[i % sets])

    row["baseline_seconds"] = _time_calls(baseline, sets, device)
    try:
        from fastdeploy.ops import triton_gemv
        from fastdeploy.ops.triton_env import triton_interpreting
    except ImportError:
        row["skipped"] = "triton is not installed"
        return row
    if device.type != "cuda" and not triton_interpreting():
        row["skipped"] = "needs CUDA (or TRITON_INTERPRET=1)"
        return row
    row["triton_seconds"] = _time_calls(
        lambda i: triton_gemv.small_m_linear(inputs[i % sets], weights[i % sets], silu_mul=silu_mul),
        sets,
        device,
    )
    row["config"] = triton_gemv.last_tuned_config() if device.type == "cuda" else "interpreter"
    out = triton_gemv.small_m_linear(inputs[0], weights[0], silu_mul=silu_mul).double()
    ref = F.linear(silu_and_mul(inputs[0]) if silu_mul else inputs[0], weights[0]).double()
    row["rel_err_vs_baseline"] = ((out - ref).norm() / ref.norm()).item()
    row["speedup"] = row["baseline_seconds"] / row["triton_seconds"]
    return row


def gemv_rows(s: Any, copy_bytes_per_s: float) -> list[dict[str, Any]]:
    """The small-M linear comparison at M = 1 for every Llama layer shape (tiny ones with ``--smoke``)."""
    rows: list[dict[str, Any]] = []
    for model, layers in (GEMV_SMOKE_SHAPES if s.smoke else GEMV_SHAPES).items():
        for layer, k, n in layers:
            for silu_mul in (False, True) if layer == "down" else (False,):
                try:
                    row = bench_small_m_linear(model, layer, k, n, silu_mul, s.device)
                except Exception:
                    row = {"op": "small_m_linear", "model": model, "layer": layer, "shape": f"{k} -> {n}",
                           "error": error_text()}  # fmt: skip
                for impl in ("baseline", "triton"):
                    if f"{impl}_seconds" in row:
                        rate = row["weight_bytes"] / row[f"{impl}_seconds"]
                        row[f"{impl}_fraction_of_copy"] = rate / copy_bytes_per_s
                rows.append(row)
                free_memory(s.device)
    return rows


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
    return {"copy_bytes_per_s": copy_bytes_per_s, "rows": rows, "gemv_rows": gemv_rows(s, copy_bytes_per_s)}
