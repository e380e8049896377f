"""A torch profile of a window of one worker's steps, written to a folder (``FD_TORCH_PROFILER_DIR``).

A serving run is hard to profile from outside: the steps that matter (a full batch, a DP + EP
step whose replicas wait on each other) happen minutes in, in a worker process. With
``FD_TORCH_PROFILER_DIR`` set, each worker profiles the steps ``FD_PROFILE_STEPS`` names
(``first:count`` of the calls that launch a step) with ``torch.profiler`` (CPU and, on a GPU,
CUDA kernels, those replayed inside CUDA graphs included) and writes, per rank:

* ``<folder>/dp<d>-rank<r>-pid<p>.trace.json.gz``: the Chrome / Perfetto trace;
* ``<folder>/dp<d>-rank<r>-pid<p>.txt``: the step timings (start-to-start interval, time inside the step
  call, tokens per step: an interval much longer than the call means the worker waited for its
  engine core) and the operators and kernels by total device time.

Off (the default), :meth:`StepProfiler.from_env` returns None and the worker does nothing per step.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from fastdeploy import envs

logger = logging.getLogger(__name__)

TABLE_ROWS = 40
"""Operators and kernels listed in the summary."""


def parse_window(text: str) -> tuple[int, int]:
    """``"first:count"`` → (first step index, number of steps); ValueError naming the variable."""
    try:
        first, count = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"FD_PROFILE_STEPS must be 'first:count' (e.g. 200:20), got {text!r}") from None
    if first < 0 or count < 1:
        raise ValueError(f"FD_PROFILE_STEPS needs first >= 0 and count >= 1, got {text!r}")
    return first, count


@dataclass
class StepTiming:
    """One profiled step: when its call began and ended (``perf_counter`` s), and its tokens."""

    start: float
    tokens: int
    end: float | None = None


@dataclass
class StepProfiler:
    """Profiles steps ``[first, first + count)`` of one worker and writes the trace and summary."""

    folder: str
    first: int
    count: int
    name: str
    """File stem of this worker's outputs (``dp0-rank1-pid123``: one server after another may write
    to the same folder)."""
    device: torch.device
    steps_seen: int = 0
    timings: list[StepTiming] = field(default_factory=list)
    _profile: torch.profiler.profile | None = None

    @classmethod
    def from_env(cls, name: str, device: torch.device) -> StepProfiler | None:
        """The profiler ``FD_TORCH_PROFILER_DIR`` / ``FD_PROFILE_STEPS`` ask for, or None (unset)."""
        folder = envs.FD_TORCH_PROFILER_DIR
        if not folder:
            return None
        first, count = parse_window(envs.FD_PROFILE_STEPS)
        os.makedirs(folder, exist_ok=True)
        return cls(folder, first, count, f"{name}-pid{os.getpid()}", device)

    def step_begin(self, num_tokens: int) -> None:
        """Called as a step call starts: starts the profile at the window's first step, and writes
        it out when the window has passed."""
        index = self.steps_seen
        self.steps_seen += 1
        if index == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.start()
        if self.first <= index < self.first + self.count:
            self.timings.append(StepTiming(time.perf_counter(), num_tokens))
        elif index == self.first + self.count:
            self._finish()

    def step_end(self) -> None:
        """Called as a step call returns."""
        if self.timings and self.timings[-1].end is None:
            self.timings[-1].end = time.perf_counter()

    def _finish(self) -> None:
        """Stop the profile (the device work of the window's steps is done by now) and write it."""
        profile, self._profile = self._profile, None
        if profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profile.stop()
        stem = os.path.join(self.folder, self.name)
        profile.export_chrome_trace(stem + ".trace.json.gz")
        with open(stem + ".txt", "w") as out:
            out.write(self.summary(profile))
        logger.info("profile of steps %d-%d written to %s.txt", self.first, self.first + self.count - 1, stem)

    def summary(self, profile: torch.profiler.profile) -> str:
        """The step timings and the top operators / kernels, as text."""
        done = [t for t in self.timings if t.end is not None]
        intervals = [b.start - a.start for a, b in zip(done, done[1:])]
        calls = [t.end - t.start for t in done]
        tokens = [t.tokens for t in done]
        lines = [f"{self.name}: steps {self.first}-{self.first + self.count - 1} ({len(done)} timed)"]
        if intervals:
            lines.append(
                f"step interval ms: mean {1e3 * statistics.mean(intervals):.3f} "
                f"median {1e3 * statistics.median(intervals):.3f} max {1e3 * max(intervals):.3f}"
            )
        if calls:
            lines.append(
                f"time in the step call ms: mean {1e3 * statistics.mean(calls):.3f} "
                f"median {1e3 * statistics.median(calls):.3f} max {1e3 * max(calls):.3f}"
            )
            lines.append(
                f"tokens per step: min {min(tokens)} mean {statistics.mean(tokens):.1f} max {max(tokens)}"
            )
            lines.append(
                "per step (tokens, call ms): "
                + ", ".join(f"{n}:{1e3 * c:.2f}" for n, c in zip(tokens, calls))
            )
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        lines.append("")
        lines.append(profile.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS))
        return "\n".join(lines) + "\n"
