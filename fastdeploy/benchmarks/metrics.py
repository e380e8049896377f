"""Statistics of a serving benchmark: per-request timings in, the reported metrics out.

Definitions (the field's, as in vLLM's ``benchmark_serving``; see docs/benchmark_metrics.md):

* TTFT: request sent → first non-empty token chunk received.
* TPOT: ``(E2E − TTFT) / (output tokens − 1)``, only for requests with more than one output token.
* ITL: every gap between two consecutive non-empty chunks, pooled over all requests.
* E2E: request sent → last byte of the response.

Percentiles use linear interpolation between closest ranks (``numpy.percentile``'s default).
Only successful requests enter the statistics; failed ones are counted and their errors kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES: tuple[int, ...] = (50, 90, 99)
"""Percentiles reported for every latency (p50 is the median)."""

SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")
"""Metrics ``--goodput`` accepts (values in milliseconds)."""


@dataclass
class RequestResult:
    """What one benchmark request measured. Times in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    """Prompt tokens (the server's ``usage.prompt_tokens`` when it sent one)."""
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive non-empty chunks (``len(itl) == chunks - 1``)."""
    latency: float = 0.0
    """End-to-end latency."""
    start_time: float = 0.0
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two output tokens."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class Distribution:
    """Mean, median and percentiles of one latency, in milliseconds (None with no samples)."""

    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    std: float | None
    count: int

    @classmethod
    def of(cls, seconds: Iterable[float]) -> Distribution:
        values = np.asarray(list(seconds), dtype=np.float64) * 1000.0
        if values.size == 0:
            return cls(None, None, None, None, None, 0)
        p50, p90, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
        return cls(float(values.mean()), p50, p90, p99, float(values.std()), int(values.size))


@dataclass
class BenchmarkMetrics:
    """The reported numbers of one run (throughputs per second of wall time ``duration``)."""

    num_prompts: int
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    goodput: float | None
    """Requests per second that met every ``--goodput`` SLO; None without SLOs."""
    good_requests: int | None
    slos_ms: dict[str, float]
    errors: list[str]
    """The error of every failed request, in request order."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (ms); raises ValueError."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"bad --goodput item {item!r}: expected NAME:MS with NAME in {', '.join(SLO_METRICS)}"
            )
        ms = float(value)
        if ms < 0:
            raise ValueError(f"bad --goodput item {item!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (a request without TPOT meets a TPOT SLO)."""
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(values[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def compute_metrics(
    results: Sequence[RequestResult], duration: float, slos_ms: dict[str, float] | None = None
) -> BenchmarkMetrics:
    """The run's statistics from every request's result (failed ones included) and its wall time."""
    if duration <= 0:
        raise ValueError("duration must be positive")
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    slos_ms = dict(slos_ms or {})
    good = sum(meets_slos(r, slos_ms) for r in ok) if slos_ms else None
    return BenchmarkMetrics(
        num_prompts=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        input_throughput=input_tokens / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=Distribution.of(r.ttft for r in ok),
        tpot_ms=Distribution.of(t for r in ok if (t := r.tpot) is not None),
        itl_ms=Distribution.of(gap for r in ok for gap in r.itl),
        e2el_ms=Distribution.of(r.latency for r in ok),
        goodput=None if good is None else good / duration,
        good_requests=good,
        slos_ms=slos_ms,
        errors=[r.error or "unknown error" for r in results if not r.success],
    )


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_table(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """The human-readable report (the layout of vLLM's, so numbers compare at a glance)."""
    width = 50
    rows: list[str] = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value: float | int | None, digits: int = 2) -> None:
        rows.append(f"{label:<34}{_fmt(value, digits):>16}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if m.goodput is not None:
        row("Request goodput (req/s):", m.goodput)
    row("Input token throughput (tok/s):", m.input_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for key, name in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        dist: Distribution = getattr(m, f"{key}_ms")
        rows.append(f"{name:-^{width}}")
        label = key.upper()
        row(f"Mean {label} (ms):", dist.mean)
        row(f"Median {label} (ms):", dist.median)
        row(f"P90 {label} (ms):", dist.p90)
        row(f"P99 {label} (ms):", dist.p99)
    if m.errors:
        rows.append(f"{' Errors (first 5) ':-^{width}}")
        rows.extend(f"  {e[:200]}" for e in m.errors[:5])
    rows.append("=" * width)
    return "\n".join(rows)
