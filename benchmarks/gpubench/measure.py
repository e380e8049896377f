"""Measuring helpers shared by the sections of ``benchmarks/gpu_benchmark.py``.

Device timings use CUDA events on a GPU and ``time.perf_counter`` on a CPU (smoke
runs). Bandwidths count every byte moved once: a copy of N bytes moves 2N (read +
written), which is the convention behind the issue's floor (vLLM's 8B figure: 16.06 GB
of weights in 3.77 ms on an H200 = 4.26 TB/s, an H200's copy rate counted this way).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from fastdeploy.transformers_utils.config import ModelArchConfig


def error_text() -> str:
    """A short traceback tail of the exception being handled (recorded in results.json)."""
    lines = traceback.format_exc().strip().splitlines()
    return "\n".join(line[:400] for line in lines[-6:])


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(
    fn: Callable[[int], Any], device: torch.device, iters: int, warmup: int = 3, repeats: int = 5
) -> float:
    """Median over ``repeats`` of the mean seconds of ``fn(i)`` over ``iters`` back-to-back calls.

    ``fn`` receives the call index so that callers can rotate through several input
    sets (keeping small working sets out of the GPU's L2 cache).
    """
    for i in range(warmup):
        fn(i)
    sync(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(iters):
                fn(i)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0 / iters)
        else:
            begin = time.perf_counter()
            for i in range(iters):
                fn(i)
            samples.append((time.perf_counter() - begin) / iters)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, num_bytes: int) -> dict[str, float]:
    """Device-to-device copy rate in bytes/s, counting bytes read + written (2x the tensor size)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_per_call(lambda _: dst.copy_(src), device, iters=10)
    moved = 2 * src.numel() * src.element_size()
    return {"tensor_bytes": moved // 2, "seconds": seconds, "bytes_per_s": moved / seconds}


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """FLOP/s of an ``n x n x n`` matrix product in ``dtype`` (after warm-up)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = time_per_call(
        lambda _: torch.mm(a, b, out=out), device, iters=10 if device.type == "cuda" else 2
    )
    return {"n": n, "seconds": seconds, "flop_per_s": 2 * n**3 / seconds}


def parameter_count(arch: ModelArchConfig) -> int:
    """Parameters of a Llama-family model (tied embeddings counted once), from its config."""
    h, layers = arch.hidden_size, arch.num_hidden_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate_size + 2 * h
    if arch.attention_bias:
        per_layer += q + 2 * kv
    if arch.qk_norm:
        per_layer += 2 * arch.head_dim
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return embeddings + layers * per_layer + h


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts that stay clear of the special tokens at the bottom of the vocabulary."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


def free_memory(device: torch.device) -> None:
    """Drop unreachable objects and return cached GPU memory to the driver (between sections)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def find_runner(llm: Any) -> Any | None:
    """The in-process ``ModelRunner`` behind an offline ``LLM`` (None if the layout differs).

    ``LLM.engine`` (LLMEngine) → ``.core`` (EngineCore) → ``.executor`` (InProcExecutor) →
    ``.worker`` (Worker) → ``.runner``; a few spellings are tried because the engine core is
    being restructured.
    """
    executor = getattr(getattr(getattr(llm, "engine", None), "core", None), "executor", None)
    if executor is None:
        return None
    for path in (("worker", "runner"), ("runner",), ("driver_worker", "runner"), ("model_runner",)):
        obj = executor
        for attr in path:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    workers = getattr(executor, "workers", None)
    if workers:
        return getattr(workers[0], "runner", None)
    return None


def device_description(device: torch.device) -> dict[str, Any]:
    """GPU name (or CPU), torch / CUDA / Triton versions, and whether fastdeploy_ops is built."""
    from fastdeploy.ops import has_cuda_ops

    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "fastdeploy_ops_cuda": bool(device.type == "cuda" and has_cuda_ops()),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=torch.cuda.get_device_name(device),
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
        )
    else:
        info["gpu"] = "none (CPU)"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info
