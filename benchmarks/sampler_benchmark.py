"""Micro-benchmark of the batched sampler: mixed per-request parameters against greedy argmax.

Builds a persistent batch of ``--batch`` requests with ``--history`` tokens each,
then times ``build_sampling_tensors`` + ``Sampler`` on random ``[batch, vocab]``
logits for several parameter mixes. Prints a markdown table (median ms per step).

    python benchmarks/sampler_benchmark.py --batch 256 --vocab 151936 --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fastdeploy.core.step_io import NewRequestData, WorkerSamplingParams
from fastdeploy.model_executor.sampler import Sampler
from fastdeploy.worker.input_batch import InputBatch
from fastdeploy.worker.sampling_metadata import build_sampling_tensors

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": None}


def mixed_fields(i: int, vocab: int) -> dict:
    """Request ``i`` of the fully mixed batch: every control in use somewhere."""
    kinds = [
        dict(GREEDY),
        {**GREEDY, "temperature": 0.8, "top_p": 0.9},
        {**GREEDY, "temperature": 1.0, "top_k": 50, "seed": i},
        {**GREEDY, "temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1},
        {**GREEDY, "temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.3, "logprobs": 5},
        {
            **GREEDY,
            "logit_bias": {j: 2.0 for j in range(0, vocab, vocab // 8)},
            "min_tokens": 10**6,
            "stop_token_ids": [0, 1, 2],
        },
        {**GREEDY, "temperature": 0.9, "bad_words_token_ids": [[5], [7, 8], [9, 10, 11]]},
    ]
    return kinds[i % len(kinds)]


SCENARIOS = {
    "greedy (argmax fast path)": lambda i, v: dict(GREEDY),
    "greedy + logprobs=5": lambda i, v: {**GREEDY, "logprobs": 5},
    "temperature + top_p / top_k": lambda i, v: {
        **GREEDY,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 50 * (i % 2),
    },
    "penalties only (greedy)": lambda i, v: {**GREEDY, "repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "fully mixed": mixed_fields,
}


def make_batch(batch: int, vocab: int, history: int, fields_of, device: torch.device) -> InputBatch:
    rng = np.random.default_rng(0)
    ib = InputBatch(batch, history + 16, 16, device)
    for i in range(batch):
        tokens = rng.integers(0, vocab, history).tolist()
        sampling = WorkerSamplingParams(**fields_of(i, vocab))
        ib.add_request(NewRequestData(f"r{i}", tokens, history // 2, sampling, [0], 0))
    return ib


def time_scenario(name: str, args: argparse.Namespace, device: torch.device) -> float:
    ib = make_batch(args.batch, args.vocab, args.history, SCENARIOS[name], device)
    slots = np.arange(args.batch)
    logits = torch.randn(args.batch, args.vocab, device=device)
    sampler = Sampler()

    def to_device(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    times = []
    for it in range(args.warmup + args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = sampler(logits, build_sampling_tensors(ib, slots, args.vocab, to_device))
        out.token_ids.tolist()
        if it >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument(
        "--history", type=int, default=256, help="tokens per request (half prompt, half output)"
    )
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"batch {args.batch} x vocab {args.vocab}, history {args.history}, device {device}, "
        f"threads {torch.get_num_threads()}"
    )
    results = {name: time_scenario(name, args, device) for name in SCENARIOS}
    base = results["greedy (argmax fast path)"]
    print("| scenario | ms / step | vs greedy |")
    print("| --- | ---: | ---: |")
    for name, ms in results.items():
        print(f"| {name} | {ms:.2f} | {ms / base:.1f}x |")


if __name__ == "__main__":
    main()
