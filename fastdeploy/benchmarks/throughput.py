"""``bench throughput``: offline engine throughput on a dataset (all prompts submitted at once)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from fastdeploy.benchmarks.datasets import SampleRequest


@dataclass
class ThroughputResult:
    """Counts and rates of one offline run (rates per second of ``elapsed_s``)."""

    num_requests: int
    total_input_tokens: int
    total_output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [f"{' Offline Throughput Result ':=^50}"]
        for key, value in self.to_dict().items():
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            rows.append(f"{key:<34}{shown:>16}")
        rows.append("=" * 50)
        return "\n".join(rows)


def run_throughput(
    llm: Any, samples: list[SampleRequest], ignore_eos: bool = True, warmup: bool = True
) -> ThroughputResult:
    """Generate every sample through ``llm`` (a :class:`fastdeploy.LLM`) and time it.

    ``ignore_eos`` (the default) makes each request produce exactly its
    expected output length, so runs compare across models and seeds.
    """
    from fastdeploy import SamplingParams

    if warmup:  # first-call costs (weight prepacking, allocator) are not throughput
        llm.generate([samples[0].prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    params = [
        SamplingParams(temperature=0, max_tokens=s.expected_output_len, ignore_eos=ignore_eos)
        for s in samples
    ]
    start = time.perf_counter()
    outputs = llm.generate([s.prompt for s in samples], params)
    elapsed = time.perf_counter() - start
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return ThroughputResult(
        num_requests=len(samples),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        elapsed_s=elapsed,
        requests_per_s=len(samples) / elapsed,
        output_tokens_per_s=out_tokens / elapsed,
        total_tokens_per_s=(in_tokens + out_tokens) / elapsed,
    )
