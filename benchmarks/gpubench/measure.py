"""Measuring helpers shared by the sections of ``benchmarks/gpu_benchmark.py``.

Device timings use CUDA events on a GPU and ``time.perf_counter`` on a CPU (smoke
runs). Bandwidths count every byte moved once: a copy of N bytes moves 2N (read +
written), which is the convention behind the issue's floor (vLLM's 8B figure: 16.06 GB
of weights in 3.77 ms on an H200 = 4.26 TB/s, an H200's copy rate counted this way).
"""

from __future__ import annotations

import gc
import random
import shutil
import statistics
import subprocess
import threading
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


def sustained_matmul_rate(
    device: torch.device, n: int, seconds: float, dtype: torch.dtype = torch.bfloat16, window: int = 100
) -> dict[str, Any]:
    """FLOP/s of back-to-back ``n x n x n`` products held for ``seconds``: the rate a GPU keeps up.

    A short burst (:func:`matmul_rate`) runs at boost clocks; held for seconds, a GPU at its
    power limit lowers its clocks (an H200 at 700 W: 771 TFLOP/s in a burst, about 665 held).
    ``flop_per_s`` is the rate over the second half of the run, after the clocks settle;
    ``windows`` are the rates of its successive windows of ``window`` products.
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    windows: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(windows) < 2:
        windows.append(2 * n**3 / time_per_call(lambda _: torch.mm(a, b, out=out), device, window, 0, 1))
    settled = windows[len(windows) // 2 :]
    return {"n": n, "seconds": seconds, "flop_per_s": statistics.mean(settled), "windows": windows}


class GpuMonitor:
    """Samples the GPU's SM clock, power draw and clock-limit reasons (``nvidia-smi``) while open.

    Throughput runs hold a GPU at its power limit for seconds; the summary says at which
    clock it ran and how often the limit was what held it back. Without a CUDA device or
    ``nvidia-smi`` the summary is empty.
    """

    QUERY = "clocks.sm,power.draw,power.limit,clocks_event_reasons.active"
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8 | 0x40 | 0x80  # hardware slowdown, thermal and power-brake slowdowns

    def __init__(self, device: torch.device, interval_ms: int = 100):
        self.samples: list[tuple[float, float, float, int]] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._command: list[str] | None = None
        tool = shutil.which("nvidia-smi")
        if device.type != "cuda" or tool is None:
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        gpu = f"GPU-{uuid}" if uuid is not None else str(index)  # the UUID holds under CUDA_VISIBLE_DEVICES
        self._command = [tool, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                         f"--loop-ms={interval_ms}", f"--id={gpu}"]  # fmt: skip

    def __enter__(self) -> GpuMonitor:
        if self._command is not None:
            self._proc = subprocess.Popen(
                self._command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = self.parse(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._thread.join(timeout=5)

    @staticmethod
    def parse(line: str) -> tuple[float, float, float, int] | None:
        """(SM MHz, power W, power limit W, reasons bit mask) of one CSV line, or None."""
        try:
            clock, power, limit, reasons = (field.strip() for field in line.split(","))
            return float(clock), float(power), float(limit), int(reasons, 16)
        except ValueError:
            return None

    def summary(self) -> dict[str, float]:
        """Mean SM clock and power, the power limit, and the share of samples held at the
        software power cap or slowed down by the hardware (empty without samples)."""
        if not self.samples:
            return {}
        clocks, powers, limits, reasons = zip(*self.samples)
        return {
            "samples": len(self.samples),
            "sm_clock_mhz_mean": statistics.mean(clocks),
            "power_w_mean": statistics.mean(powers),
            "power_limit_w": max(limits),
            "power_capped_share": sum(bool(r & self.SW_POWER_CAP) for r in reasons) / len(reasons),
            "hw_slowdown_share": sum(bool(r & self.HW_SLOWDOWN) for r in reasons) / len(reasons),
        }


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
