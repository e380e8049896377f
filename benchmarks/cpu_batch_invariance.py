"""What ``FD_CPU_BATCH_INVARIANT`` (CPU linear layers in calls of at most 32 rows) costs and buys,
on the default model in its default dtype (bf16 on a CPU), offline.

* cost: a prefill of 8 prompts of ~520 tokens (one output token each), then the same 8 prompts with
  64 output tokens each, with it off and on, alternated (``--repeats`` pairs);
* what it buys: a greedy request's logprobs alone and beside other prompts' chunked prefills (a
  64-token budget), their largest difference with it off and on (0.0: the same bits).

    python benchmarks/cpu_batch_invariance.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

from fastdeploy import LLM, SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


def _set(on: bool) -> None:
    os.environ["FD_CPU_BATCH_INVARIANT"] = "1" if on else "0"  # read at every matmul call


def cost(repeats: int) -> None:
    """Seconds of the prefill and of the prefill + decode run, off and on, alternated."""
    llm = LLM(enable_prefix_caching=False)
    prompts = [
        ("Tell me everything about the history of Rome, its emperors and wars. " * 40)[: 2400 + i]
        for i in range(8)
    ]
    prefill = SamplingParams(temperature=0, max_tokens=1)
    decode = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], prefill)  # warm-up
    for _ in range(repeats):
        for on in (False, True):
            _set(on)
            start = time.perf_counter()
            llm.generate(prompts, prefill)
            mid = time.perf_counter()
            llm.generate(prompts, decode)
            end = time.perf_counter()
            print(f"FD_CPU_BATCH_INVARIANT={int(on)}: prefill 8 x ~520 tokens {mid - start:.2f} s, "
                  f"the same with 64 output tokens each {end - mid:.2f} s", flush=True)  # fmt: skip
    llm.shutdown()


def difference() -> None:
    """The largest logprob difference of a greedy request alone and beside chunked prefills."""
    llm = LLM(max_num_batched_tokens=64, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=32, logprobs=0)
    longs = [("Tell me about the history of Rome and its emperors. " * 12)[: 500 + 40 * i] for i in range(3)]
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=6) for i in range(3)]
    for on in (False, True):
        _set(on)
        alone = llm.generate([PROMPT], greedy)[0].outputs[0]
        mixed = llm.generate([PROMPT, *longs], [greedy, *others])[0].outputs[0]
        pairs = zip(alone.logprobs, mixed.logprobs, alone.token_ids, mixed.token_ids, strict=False)
        diff = max(abs(a[t].logprob - b[u].logprob) for a, b, t, u in pairs)
        same = alone.token_ids == mixed.token_ids
        print(f"FD_CPU_BATCH_INVARIANT={int(on)}: same tokens {same}, largest logprob difference {diff:.3g}")
    llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    difference()
    cost(args.repeats)


if __name__ == "__main__":
    main()
