"""Kernel-time breakdown of batch-1 decode steps (torch profiler, CUDA time): where the
inter-token latency goes beyond the weight-read floor.

    python -m benchmarks.gpubench.profile_decode [config dir]
"""

from __future__ import annotations

import sys

from torch.profiler import ProfilerActivity, profile

from fastdeploy import LLM, SamplingParams


def main() -> None:
    config = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/configs/llama-3.1-8b"
    llm = LLM(
        model=config, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
        max_num_seqs=1, max_model_len=512, num_gpu_blocks_override=64,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([list(range(100, 132))], params)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([list(range(200, 232))], params)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    llm.shutdown()


if __name__ == "__main__":
    main()
