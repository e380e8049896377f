"""The scheduler's own cost per decode step: ``schedule`` + ``update_from_output`` at N running requests.

    python benchmarks/scheduler_overhead.py [--requests 64,256] [--steps 200]

No model and no worker: each step's sampled tokens are made up (random, never a stop), with
async scheduling's placeholders, so what is timed is the scheduler's Python for every running
request (block bookkeeping, prefix-cache hashing of filled blocks, the step's output). It runs
inside every engine step, on the engine loop that the grammar-mask threads and the GPU wait on.
"""

from __future__ import annotations

import argparse
import random
import time

from fastdeploy.config import EngineConfig
from fastdeploy.core.request import EngineCoreRequest, Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.step_io import ModelRunnerOutput
from fastdeploy.scheduler.scheduler import Scheduler


def median_step_seconds(num_requests: int, steps: int, prompt_len: int = 512) -> float:
    """Median seconds of a steady decode step (the first 20 steps, with the prefills, left out)."""
    config = EngineConfig.from_kwargs(
        block_size=16, max_num_seqs=num_requests, max_num_batched_tokens=8192, enable_prefix_caching=True
    )
    scheduler = Scheduler(config, 64 * num_requests, 4096)
    scheduler.async_scheduling = True
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(3, 30000) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
        scheduler.add_request(Request(EngineCoreRequest(f"r{i}", prompt, params, eos_token_ids=[2]), 16))
    pending, times = None, []
    for step in range(steps):
        start = time.perf_counter()
        output = scheduler.schedule()
        if pending is not None:
            scheduler.update_from_output(pending)
        elapsed = time.perf_counter() - start
        ids = list(output.num_scheduled_tokens)
        pending = ModelRunnerOutput(
            output.step_id, ids, [rng.randrange(3, 30000) for _ in ids], [0] * len(ids)
        )
        if step >= 20:
            times.append(elapsed)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="64,256")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print("| running requests | ms per step (best of 3 medians) | µs per request |")
    print("| ---: | ---: | ---: |")
    for n in (int(x) for x in args.requests.split(",")):
        best = min(median_step_seconds(n, args.steps) for _ in range(3))
        print(f"| {n} | {best * 1e3:.3f} | {best / n * 1e6:.2f} |")


if __name__ == "__main__":
    main()
