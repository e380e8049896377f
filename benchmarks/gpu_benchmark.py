"""GPU benchmark of issue #7: correctness, kernel bandwidth, decode latency, throughput, overlap.

One run writes ``results.json`` (everything measured) and ``results.md`` (tables for
docs/benchmarks.md) into ``--out``:

    python benchmarks/gpu_benchmark.py --out /tmp/gpu                 # H100 / H200, all sections
    python benchmarks/gpu_benchmark.py --sections ops,itl --out /tmp/gpu
    python benchmarks/gpu_benchmark.py --device cpu --smoke --out /tmp/smoke   # checks the script only

Sections (each independent: a failure is recorded in the results and the run goes on):

* ``correctness``: greedy tokens of the GPU engine in float32 on the default model
  (SmolLM2-135M GGUF) against the CPU engine; bf16 prefill logits against fp32 (<= 2e-2).
* ``ops``: ``reshape_and_cache_flash`` (bf16, fp8_e4m3) and Triton decode attention in
  bytes/s, as a fraction of the measured device copy bandwidth (read + written bytes); the
  batch-1 linears of the Llama-3.1-8B / 3.2-1B layers, cuBLAS against the Triton small-M
  kernel (down_proj also with its SiLU-and-multiply fused), in µs and weight bytes/s.
* ``itl``: batch-1 decode inter-token latency of the Llama-3.2-1B and Llama-3.1-8B shapes
  (dummy bf16 weights), CUDA graphs on and off, against weight bytes / copy bandwidth.
* ``throughput``: output tok/s for 256 random 512-token prompts x 256 tokens on the 8B shape
  per async-scheduling / CUDA-graphs mode, transformers ``generate`` in static batches on
  the same workload, and the fraction of the compute floor (tokens x 2 x params / bf16 mm rate,
  in a burst and held for seconds), with the GPU's clock and power during each run.
* ``overlap``: with ``FD_STEP_TRACE=1``, checks in the runner's trace that batch N-1's output
  is saved while batch N runs; skipped when the runner keeps no trace.

Each section's wall time is recorded with its results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTHONUNBUFFERED", "1")  # for child processes; this one is line-buffered below
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpubench import engine_bench  # noqa: E402
from gpubench.measure import (  # noqa: E402
    copy_bandwidth,
    device_description,
    error_text,
    free_memory,
    matmul_rate,
    sustained_matmul_rate,
)
from gpubench.ops_bench import ops_section  # noqa: E402
from gpubench.report import render_markdown  # noqa: E402
from gpubench.settings import Settings, add_arguments, settings_from_args  # noqa: E402


def log(message: str) -> None:
    """A timestamped progress line on stdout, flushed at once (runs are watched live)."""
    print(f"[gpu_benchmark {time.strftime('%H:%M:%S')}] {message}", flush=True)


class SectionTimeout(BaseException):
    """A section ran past ``--section-timeout`` (raised by SIGALRM in the main thread).

    A BaseException so that the per-row ``except Exception`` handlers inside a section
    let it through: the whole section stops, not just its current row.
    """


def _on_alarm(signum: int, frame: Any) -> None:
    raise SectionTimeout("the section ran past --section-timeout")


def run_section(results: dict[str, Any], name: str, fn: Any, s: Settings, timeout_s: int) -> None:
    """Run one section, recording its result or its error text and its duration.

    A hung section (an engine that never finishes) is interrupted after ``timeout_s`` so
    that the later sections still run.
    """
    log(f"section {name} ...")
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout_s)
    try:
        entry: dict[str, Any] = {"status": "ok", "result": fn()}
    except (Exception, SectionTimeout):
        entry = {"status": "error", "error": error_text()}
        log(f"section {name} failed:\n{entry['error']}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    entry["seconds"] = time.perf_counter() - start
    results["sections"][name] = entry
    free_memory(s.device)
    if s.device.type == "cuda":  # what a section leaves behind shrinks the next engine's KV cache
        entry["cuda_memory_allocated_after"] = torch.cuda.memory_allocated(s.device)
    log(f"section {name} {entry['status']} in {entry['seconds']:.1f} s")


def device_rates(s: Settings, results: dict[str, Any]) -> tuple[float | None, dict[str, float | None]]:
    """Copy bandwidth (for ops and itl) and the bf16 matmul rates (for throughput), measured once:
    a short burst, and held for ``s.sustained_matmul_s`` seconds (see ``sustained_matmul_rate``)."""
    copy_bw = None
    rates: dict[str, float | None] = {"burst": None, "sustained": None}
    if {"ops", "itl"} & set(s.sections):
        try:
            copy = copy_bandwidth(s.device, s.copy_bytes)
            results["meta"]["copy_bandwidth"] = copy
            copy_bw = copy["bytes_per_s"]
            log(f"copy bandwidth (read + written): {copy_bw / 1e12:.3f} TB/s")
        except Exception:
            results["meta"]["copy_bandwidth_error"] = error_text()
    if "throughput" in s.sections:
        try:
            mm = matmul_rate(s.device, s.matmul_n)
            results["meta"]["matmul_bf16"] = mm
            rates["burst"] = mm["flop_per_s"]
            held = sustained_matmul_rate(s.device, s.matmul_n, s.sustained_matmul_s)
            results["meta"]["matmul_bf16_sustained"] = held
            rates["sustained"] = held["flop_per_s"]
            log(
                f"bf16 matmul {s.matmul_n}^3: {rates['burst'] / 1e12:.1f} TFLOP/s in a burst, "
                f"{rates['sustained'] / 1e12:.1f} held for {s.sustained_matmul_s:g} s"
            )
        except Exception:
            results["meta"]["matmul_error"] = error_text()
    free_memory(s.device)
    return copy_bw, rates


def needs(value: float | None, what: str) -> float:
    """``value``, or an error for the section that cannot run without it."""
    if value is None:
        raise RuntimeError(f"the {what} could not be measured (see meta)")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections, saving results.json and results.md after each one."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    s = settings_from_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)]
    )
    settings = {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(s).items()}
    results: dict[str, Any] = {
        "meta": {
            "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "settings": settings,
        },
        "sections": {},
    }

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "results.md").write_text(render_markdown(results))

    if s.device.type == "cuda" and not torch.cuda.is_available():
        results["meta"]["device_info"] = {"gpu": "unavailable", "torch": torch.__version__}
        for name in s.sections:
            results["sections"][name] = {"status": "error", "error": "CUDA is not available", "seconds": 0.0}
        save()
        log("CUDA is not available; nothing measured (use --device cpu --smoke for a script check)")
        return 1
    results["meta"]["device_info"] = device_description(s.device)
    log(f"device: {results['meta']['device_info']}")
    copy_bw, mm_rates = device_rates(s, results)
    save()
    sections = {
        "correctness": lambda: engine_bench.correctness(s),
        "ops": lambda: ops_section(s, needs(copy_bw, "copy bandwidth")),
        "itl": lambda: engine_bench.itl(s, needs(copy_bw, "copy bandwidth")),
        "throughput": lambda: engine_bench.throughput(s, mm_rates["burst"], mm_rates["sustained"]),
        "overlap": lambda: engine_bench.overlap(s),
    }
    for name in s.sections:
        run_section(results, name, sections[name], s, args.section_timeout)
        save()  # partial results survive a later crash or a time limit
    log(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    print(render_markdown(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
