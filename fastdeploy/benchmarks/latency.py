"""``bench latency``: one batch through the engine, step by step, to separate prefill from decode.

Each iteration adds ``batch_size`` random-token prompts of ``input_len`` tokens
(``max_tokens = output_len``, ``ignore_eos``) and steps the :class:`LLMEngine`:

* prefill time: from adding the batch until every request has its first token
  (all the steps of a chunked prefill included);
* decode time per token: the wall time of each later step, in which every
  running request gets one token.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass
class LatencyStats:
    """Mean, p50 and p90 of one timing, in milliseconds."""

    mean: float
    p50: float
    p90: float
    count: int

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        if ms.size == 0:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        p50, p90 = np.percentile(ms, [50, 90])
        return cls(float(ms.mean()), float(p50), float(p90), int(ms.size))


@dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    num_iters: int
    prefill_ms: LatencyStats
    decode_token_ms: LatencyStats
    """Per decode step (one token for every request of the batch)."""
    total_ms: LatencyStats
    """Whole iteration: prefill plus every decode step."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [f"{' Latency Result ':=^58}"]
        rows.append(
            f"batch {self.batch_size}, input {self.input_len}, output {self.output_len}, "
            f"{self.num_iters} iterations"
        )
        rows.append(f"{'':<26}{'mean':>10}{'p50':>10}{'p90':>10}")
        for label, stats in (
            ("prefill (ms)", self.prefill_ms),
            ("decode per token (ms)", self.decode_token_ms),
            ("total per batch (ms)", self.total_ms),
        ):
            rows.append(f"{label:<26}{stats.mean:>10.2f}{stats.p50:>10.2f}{stats.p90:>10.2f}")
        rows.append("=" * 58)
        return "\n".join(rows)


def _one_batch(
    engine: Any, prompts: list[list[int]], output_len: int, tag: str
) -> tuple[float, list[float], float]:
    """Run one batch to completion; returns (prefill s, decode step s, total s)."""
    from fastdeploy import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    prefill = None
    decode_steps: list[float] = []
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if prefill is None:
            started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
            if len(started) == len(prompts):
                prefill = now - start
        elif outputs:
            decode_steps.append(now - step_start)
    if prefill is None:
        raise RuntimeError("the batch finished without a token for every request")
    return prefill, decode_steps, time.perf_counter() - start


def run_latency(
    engine: Any,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int,
    num_warmup_iters: int = 1,
    seed: int = 0,
) -> LatencyResult:
    """Time ``num_iters`` batches on ``engine`` (a :class:`LLMEngine`) after ``num_warmup_iters`` untimed ones.

    Each iteration gets fresh random prompts, so the prefix cache never shortens a prefill.
    """
    rng = random.Random(seed)
    vocab = engine.source.arch.vocab_size
    prefills: list[float] = []
    decodes: list[float] = []
    totals: list[float] = []
    for it in range(num_warmup_iters + num_iters):
        prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(batch_size)]
        prefill, steps, total = _one_batch(engine, prompts, output_len, f"lat{it}")
        if it >= num_warmup_iters:
            prefills.append(prefill)
            decodes.extend(steps)
            totals.append(total)
    return LatencyResult(
        batch_size,
        input_len,
        output_len,
        num_iters,
        LatencyStats.of(prefills),
        LatencyStats.of(decodes),
        LatencyStats.of(totals),
    )
