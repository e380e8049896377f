"""Tables of an offline throughput run shared by our profiler (``profile_throughput.py``) and vLLM's
(``benchmarks/vllm_offline.py --profile-window``): seconds per phase, and one window of steps'
kernels. Imports neither engine."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

GAP_BUCKETS_US = (1, 2, 4, 10, 100)
WINDOW_STEPS = 4
"""Steps of the profiled window."""


def run_steps(
    step: Callable[[], Any], unfinished: Callable[[], bool], window_step: int | None
) -> tuple[list[float], list[str]]:
    """Step an engine until ``unfinished()`` is false: each step's wall time, and the
    :func:`kernel_window` of :data:`WINDOW_STEPS` steps from ``window_step`` on (torch profiler,
    CUDA activity; None: no window)."""
    times: list[float] = []
    window: list[str] = []
    while unfinished():
        if window_step is not None and len(times) == window_step:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                begin = time.perf_counter()
                for _ in range(WINDOW_STEPS):
                    step()
                torch.cuda.synchronize()
                wall = time.perf_counter() - begin
            times += [wall / WINDOW_STEPS] * WINDOW_STEPS
            window = kernel_window(list(prof.events()), WINDOW_STEPS, wall)
            continue
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return times, window


def phase_table(log: list[tuple[int, int]], times: list[float], max_batch: int) -> list[str]:
    """Markdown rows of seconds per phase: ``log`` is (scheduled tokens, requests) per step and
    ``times[i]`` the wall time of step ``i``; step ``i`` is charged ``times[i + 1]``."""
    phases: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for i, (tokens, reqs) in enumerate(log):
        if i + 1 >= len(times) or tokens == 0:
            continue
        key = "prefill" if tokens > reqs else f"decode, batch {min(max_batch, -(-reqs // 32) * 32)}"
        phases[key][0] += 1
        phases[key][1] += times[i + 1]
    rows = ["| phase | steps | ms per step | seconds |", "| --- | ---: | ---: | ---: |"]
    for key, (steps, seconds) in sorted(phases.items(), key=lambda kv: -kv[1][1]):
        rows.append(f"| {key} | {steps} | {seconds / steps * 1e3:.2f} | {seconds:.3f} |")
    return rows


def kernel_window(events: list[Any], steps: int, wall_s: float, top: int = 12) -> list[str]:
    """Busy time, span, gaps and the top kernels of ``steps`` profiled steps."""
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        return ["(no CUDA kernels recorded)"]
    busy = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3 / steps
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3 / steps
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
    lines = [
        f"per step: wall {wall_s * 1e3 / steps:.2f} ms, kernel span {span:.2f} ms, GPU busy {busy:.2f} ms, "
        f"{len(kernels) / steps:.0f} kernels"
    ]
    labels = [f"< {b} µs" for b in GAP_BUCKETS_US] + [f">= {GAP_BUCKETS_US[-1]} µs"]
    buckets = dict.fromkeys(labels, 0.0)
    for gap in gaps:
        index = next((i for i, b in enumerate(GAP_BUCKETS_US) if gap < b), len(GAP_BUCKETS_US))
        buckets[labels[index]] += gap
    lines.append(
        "idle between kernels per step (negative: overlapping launches, e.g. PDL): "
        + ", ".join(f"{k} {v / 1e3 / steps:.3f} ms" for k, v in buckets.items())
    )
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for i, e in enumerate(kernels):
        entry = by_name[e.name[:70]]
        entry[0] += 1
        entry[1] += (e.time_range.end - e.time_range.start) / 1e3
        entry[2] += gaps[i - 1] / 1e3 if i else 0.0
    lines += [
        "| kernel | per step | ms per step | idle before, ms per step |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (count, ms, idle) in sorted(by_name.items(), key=lambda kv: -kv[1][1] - kv[1][2])[:top]:
        lines.append(f"| `{name}` | {count / steps:.0f} | {ms / steps:.3f} | {idle / steps:.3f} |")
    return lines
