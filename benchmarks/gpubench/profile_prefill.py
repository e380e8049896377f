"""Where the time to a lone request's first token goes: its prefill step's kernels against the wall.

    python -m benchmarks.gpubench.profile_prefill [config dir] [--prompt-len 512] [--batch 1] [--runs 20]
        [--cprofile] [--cuda-graph-max-tokens 512]

One request at a time (``max_tokens=1``, fresh random prompts, so no prefix-cache hit) through
the offline engine's loop: the wall time from ``add_request`` to its token (the engine's part of
a concurrency-1 TTFT, no HTTP), the GPU's kernel time of the same (torch profiler, CUDA
activity), and the kernel table. Issue #19 compares the served TTFT at concurrency 1 with it.
``--batch 16`` adds 16 prompts at once instead: one prefill step of 8,192 tokens at 512 each
(a burst's step under an 8,192-token budget, vLLM's, whose length is the burst's longest
inter-token gap; the engine here takes a budget of at least 8,192 whatever the default).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from fastdeploy import LLM, SamplingParams

from .profile_decode import host_profile, kernel_table


def first_tokens(
    llm: LLM,
    prompt_len: int,
    runs: int,
    rng: random.Random,
    launches: list[float] | None = None,
    batch: int = 1,
) -> list[float]:
    """Seconds from adding ``batch`` requests at once to their one token each, ``runs`` times one
    after another; ``launches`` gets the seconds of each first engine step (scheduling and launching the prefill:
    with async scheduling it returns without waiting for the GPU, so near the whole time means the
    host, not the GPU, is the bound)."""
    engine = llm.engine
    times = []
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(runs):
        prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_len)] for _ in range(batch)]
        begin = time.perf_counter()
        for prompt in prompts:
            engine.add_request(f"r{rng.random()}", prompt, params)
        first = True
        while engine.has_unfinished_requests():
            engine.step()
            if first and launches is not None:
                launches.append(time.perf_counter() - begin)
            first = False
        times.append(time.perf_counter() - begin)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1, help="prompts added at once (one prefill step)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25, help="kernel table rows (0: no table)")
    parser.add_argument("--quantization", default=None)
    parser.add_argument(
        "--cuda-graph-max-tokens", type=int, default=0, help="replay steps up to this many tokens as graphs"
    )
    parser.add_argument("--cprofile", action="store_true", help="the host functions that take the most time")
    args = parser.parse_args()
    llm = LLM(
        model=args.config, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
        max_model_len=max(2048, args.prompt_len + 16), quantization=args.quantization,
        max_num_batched_tokens=max(8192, args.prompt_len * args.batch),
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
    )  # fmt: skip
    rng = random.Random(0)
    first_tokens(llm, args.prompt_len, 3, rng, batch=args.batch)  # warm-up
    launches: list[float] = []
    ms = np.asarray(first_tokens(llm, args.prompt_len, args.runs, rng, launches, args.batch)) * 1e3
    launch_ms = np.asarray(launches) * 1e3
    profiled = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        first_tokens(llm, args.prompt_len, profiled, rng, batch=args.batch)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(e.device_time for e in kernels) / 1e3 / profiled
    print(
        f"prompt {args.prompt_len} x {args.batch}: add → token {ms.mean():.2f} ms mean, {np.median(ms):.2f} p50, "
        f"{ms.min():.2f} min; first step (schedule + launch) {np.median(launch_ms):.2f} p50; "
        f"kernels {kernel_ms:.2f} ms per run ({len(kernels) / profiled:.0f} launched)"
    )
    if args.rows:
        print(kernel_table(prof, args.rows))
    if args.cprofile:
        run = lambda: first_tokens(llm, args.prompt_len, profiled, rng, batch=args.batch)  # noqa: E731
        print(host_profile(run, {"tottime": 25, "cumulative": 40}))
    llm.shutdown()


if __name__ == "__main__":
    main()
