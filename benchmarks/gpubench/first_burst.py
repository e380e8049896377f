"""Why an engine's first burst of many requests starts slower than the next one: the host functions
of each burst's first engine step.

    python -m benchmarks.gpubench.first_burst [config dir] [--num-prompts 256] [--input-len 40]

``cold_start`` found a first burst still ~60% slower than the second once nothing compiled in it
(0.18 against 0.11 s, docs/benchmarks.md). Here bursts of the same shape (new random prompts each
time, so no prefix-cache hits; greedy, a few output tokens) run three times after start-up; for each
it prints the wall time of its first ``engine.step()`` (scheduling, inputs and the forward's
launch; with async scheduling no wait for the device) and of the whole burst, and the functions
that took the most host time in that first step (``cProfile``): what differs between the first
burst's row and the others' is what the start-up warm-up leaves undone.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

from fastdeploy import LLM, SamplingParams

from .measure import random_prompts
from .settings import MODEL_8B


def run_burst(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str
) -> tuple[float, float, str]:
    """All prompts at once through the engine: seconds of the first step, seconds of the whole burst,
    and the first step's top host functions by own time."""
    engine = llm.engine
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    profiler = cProfile.Profile()
    first_start = time.perf_counter()
    profiler.enable()
    engine.step()
    profiler.disable()
    first_s = time.perf_counter() - first_start
    while engine.has_unfinished_requests():
        engine.step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return first_s, time.perf_counter() - start, text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=MODEL_8B)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=40, help="tokens a prompt (a short chat turn)")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--hf-config-overrides", default="{}", help="JSON, e.g. fewer layers")
    args = parser.parse_args()
    overrides = json.loads(args.hf_config_overrides)
    llm = LLM(
        model=args.config, load_format="dummy", skip_tokenizer_init=True, seed=0, device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32", max_num_seqs=args.num_prompts,
        max_model_len=args.input_len + args.output_len + 16, hf_config_overrides=overrides,
    )  # fmt: skip
    vocab = llm.engine.core.source.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    try:
        for burst in range(1, args.bursts + 1):
            prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=burst)
            first_s, total_s, top = run_burst(llm, prompts, params, f"b{burst}")
            print(f"burst {burst}: first step {first_s * 1000:.1f} ms, burst {total_s * 1000:.1f} ms")
            print(top)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
