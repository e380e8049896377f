"""Where a decode step's time goes: the GPU's kernels against the host's engine loop.

    python -m benchmarks.gpubench.profile_decode [config dir] [--batch N] [--cprofile]

Prints the inter-token latency, the GPU's kernel time per step (torch profiler, CUDA
activity) and the share of the step the GPU is idle — when the kernels take less than
the step, the host loop (scheduling, input preparation, sampling launches, output
processing) is the bound — then the kernel table and, with ``--cprofile``, the host
functions that take the most time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from fastdeploy import LLM, SamplingParams


def decode_steps(llm: LLM, batch: int, tokens: int, first_id: int) -> float:
    """Run ``batch`` requests of ``tokens`` greedy tokens through the engine loop; seconds per step."""
    engine = llm.engine
    for i in range(batch):
        prompt = list(range(first_id + i * 32, first_id + i * 32 + 32))
        engine.add_request(
            f"p{first_id}-{i}", prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        )
    steps = 0
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - begin) / max(steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="benchmarks/configs/llama-3.2-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--rows", type=int, default=20, help="kernel table rows (0: no table)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (weights quantized at load)")
    args = parser.parse_args()
    llm = LLM(
        model=args.config, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
        max_num_seqs=max(8, args.batch), max_model_len=256, num_gpu_blocks_override=16 * max(8, args.batch) + 8,
        attention_backend=args.attention_backend, quantization=args.quantization,
    )  # fmt: skip
    decode_steps(llm, args.batch, 16, 100)  # warm-up
    step_s = decode_steps(llm, args.batch, args.tokens, 1000)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_steps(llm, args.batch, args.tokens, 2000)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_s = sum(e.device_time for e in kernels) / 1e6 / args.tokens
    print(f"batch {args.batch}: {step_s * 1e3:.3f} ms per step; kernels {kernel_s * 1e3:.3f} ms per step "
          f"({len(kernels) / args.tokens:.0f} per step); GPU idle {max(0.0, 1 - kernel_s / step_s):.0%}")  # fmt: skip
    if args.rows:
        print(kernel_table(prof, args.rows))
    if args.cprofile:
        print(host_profile(lambda: decode_steps(llm, args.batch, args.tokens, 3000), {"tottime": 30}))
    llm.shutdown()


def kernel_table(prof: profile, rows: int) -> str:
    """The profiler's kernels, most device time first."""
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def host_profile(run: Callable[[], object], orders: dict[str, int]) -> str:
    """cProfile of ``run()``: the top functions in each sort order (order name → rows)."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for order, rows in orders.items():
        stats.sort_stats(order).print_stats(rows)
    return text.getvalue()


if __name__ == "__main__":
    main()
