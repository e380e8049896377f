"""The serving path's cost on a CPU: one workload offline (``LLM.generate``) and through ``fastdeploy serve``.

    python benchmarks/serving_breakdown.py                          # default model, 64 prompts x 64/32 tokens
    python benchmarks/serving_breakdown.py --model tiny             # a 1-layer dummy model: the path itself
    python benchmarks/serving_breakdown.py --profile /tmp/prof      # also py-spy both server processes
    python benchmarks/serving_breakdown.py --model benchmarks/configs/llama-3.1-8b --num-threads 0 \
        --engine-args device=cuda,max_model_len=2048,tokenizer=TOKENIZER_DIR \
        --num-prompts 256 --input-len 512 --output-len 256 --dtype bfloat16     # a GPU

Prints offline and online output tokens/s and their ratio (online / offline: what the HTTP path
costs), and, from the server's per-request timeline (``FD_REQUEST_TIMELINE_FILE``), the median
and p99 of each stage of a request's way to its first token: HTTP receive → tokenized → engine
queue → first scheduled → first token sent by the engine core → received by the API server →
detokenized → first SSE chunk written; and per token after the first, engine core send → chunk
written. ``--model tiny`` (one layer, 64 wide, the default model's tokenizer, dummy weights)
makes the forward pass nearly free, so the ratio and the stages show the serving path alone.

With ``--profile DIR`` (needs ``pip install py-spy``), the server processes are sampled during
the online run; the collapsed stacks are saved to DIR and the top functions by own time printed.
``--api-server-count N`` is passed to ``fastdeploy serve`` (N API server processes, each measured
and profiled on its own, ``api_server_0`` ...; the timelines of all go to one file).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from server_health import free_port

from fastdeploy.benchmarks.metrics import BenchmarkMetrics

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, hidden_size=64,
    intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=49152,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    hidden_act="silu", bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)  # fmt: skip


def default_tokenizer_into(folder: Path) -> None:
    """Save the default model's (SmolLM2's) tokenizer into ``folder``."""
    from fastdeploy.model_executor.model_loader.default_model import default_model_path
    from fastdeploy.model_executor.model_loader.gguf_loader import load_gguf_tokenizer

    load_gguf_tokenizer(default_model_path()).save_pretrained(folder)


def tiny_model_dir() -> str:
    """A folder with the tiny config and the default model's tokenizer (dummy weights are made on load)."""
    folder = Path(tempfile.mkdtemp(prefix="fd-tiny-"))
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    default_tokenizer_into(folder)
    return str(folder)


def engine_args(args: argparse.Namespace, model: str | None) -> dict:
    kwargs: dict = dict(dtype=args.dtype, max_model_len=1024)
    if args.num_threads:
        kwargs.update(num_threads=args.num_threads, kv_cache_memory=0.5)
    if model is not None:
        kwargs.update(model=model, load_format="dummy")
    for item in filter(None, args.engine_args.split(",")):
        key, _, value = item.partition("=")
        kwargs[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return kwargs


def to_flags(kwargs: dict) -> list[str]:
    flags = []
    for key, value in kwargs.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def make_samples(tokenizer, args: argparse.Namespace):
    from fastdeploy.benchmarks.datasets import HFTokenizer, random_dataset

    return random_dataset(HFTokenizer(tokenizer), args.num_prompts, args.input_len, args.output_len, seed=0)


def free_device_memory() -> None:
    """Give back what the offline engine (in this process) held on the GPU."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_offline(args: argparse.Namespace, model: str | None) -> tuple[float, list]:
    """Output tokens/s of ``LLM.generate`` on the workload (text prompts: tokenization included)."""
    from fastdeploy import LLM, SamplingParams

    llm = LLM(**engine_args(args, model))
    samples = make_samples(llm.get_tokenizer(), args)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([s.prompt for s in samples[:2]], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([s.prompt for s in samples], params)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    del llm
    free_device_memory()  # the server started next sizes its KV cache by the free GPU memory
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed, samples


def start_server(args: argparse.Namespace, model: str | None, timeline: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--host", "127.0.0.1",
           "--port", str(port), *to_flags(engine_args(args, model)),
           "--api-server-count", str(args.api_server_count)]  # fmt: skip
    env = {**os.environ, "FD_REQUEST_TIMELINE_FILE": timeline, "FD_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start in 300 s")


def engine_core_pid(server_pid: int) -> int | None:
    import psutil

    for child in psutil.Process(server_pid).children(recursive=True):
        if "fastdeploy-engine-core" in " ".join(child.cmdline()):
            return child.pid
    return None


def api_server_pids(server_pid: int) -> dict[str, int]:
    """``{"api_server": pid}`` (the serve process itself), or with several API server processes
    ``{"api_server_0": pid, ...}`` (the serve process only supervises)."""
    import psutil

    found = {}
    for child in psutil.Process(server_pid).children():
        name = child.cmdline()[-1]
        if name.startswith("fastdeploy-api-server-"):
            found[int(name.rsplit("-", 1)[1])] = child.pid
    if not found:
        return {"api_server": server_pid}
    return {f"api_server_{index}": found[index] for index in sorted(found)}


def start_profilers(pids: dict[str, int], out_dir: Path, seconds: int) -> list[subprocess.Popen]:
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, pid in pids.items():
        cmd = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--nonblocking",
               "--duration", str(seconds), "--output", str(out_dir / f"{name}.txt")]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def top_functions(collapsed: Path, limit: int) -> list[tuple[float, float, str]]:
    """(own %, inclusive %, function) of the busiest functions in a py-spy ``raw`` (collapsed) file;
    idle waits (``select``, ``poll``, ``epoll``) excluded from the total."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        leaf = frames[-1]
        if any(idle in leaf for idle in ("select (", "poll (", "epoll", "_run_once", "wait (")):
            continue
        n = int(count)
        total += n
        own[leaf] += n
        for frame in set(frames):
            inclusive[frame] += n
    total = max(total, 1)
    return [(100 * n / total, 100 * inclusive[f] / total, f) for f, n in own.most_common(limit)]


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    import psutil

    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def run_online(
    args: argparse.Namespace, model: str | None, samples: list
) -> tuple[BenchmarkMetrics, list[dict], dict[str, float]]:
    """The client's metrics (output tokens/s, TTFT, ...), the per-request timelines, and the CPU µs
    each server process spent per output token (robust to other load on the machine, unlike the rates)."""
    from fastdeploy.benchmarks.serve import ServeConfig, first_model, run_benchmark

    timeline = tempfile.mktemp(suffix=".jsonl", prefix="fd-timeline-")
    proc, url = start_server(args, model, timeline)
    try:
        name = asyncio.run(first_model(url, None))
        cfg = ServeConfig(
            url,
            name,
            endpoint=args.endpoint,
            ignore_eos=True,
            disable_tqdm=True,
            max_concurrency=args.max_concurrency or None,
        )
        asyncio.run(run_benchmark(cfg, samples[:2]))  # warm-up
        Path(timeline).write_text("")
        profilers = []
        pids = {**api_server_pids(proc.pid), "engine_core": engine_core_pid(proc.pid)}
        if args.profile:
            profilers = start_profilers(pids, Path(args.profile), args.profile_seconds)
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        metrics, _ = asyncio.run(run_benchmark(cfg, samples))
        tokens = max(metrics.total_output_tokens, 1)
        cpu_us = {name: (cpu_seconds(pid) - cpu_before[name]) / tokens * 1e6 for name, pid in pids.items()}
        for p in profilers:
            p.wait(timeout=args.profile_seconds + 30)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if metrics.failed:
        raise RuntimeError(f"{metrics.failed} requests failed: {metrics.errors[:3]}")
    lines = Path(timeline).read_text().splitlines() if os.path.exists(timeline) else []
    return metrics, [json.loads(line) for line in lines if line.strip()], cpu_us


STAGES = (
    ("tokenize", "received", "tokenized"),
    ("to engine queue", "tokenized", "queued"),
    ("queue → first scheduled", "queued", "scheduled"),
    ("scheduled → first token sent", "scheduled", "first_token_sent"),
    ("engine core → API server", "first_token_sent", "first_token_received"),
    ("detokenize", "first_token_received", "first_token_detokenized"),
    ("to SSE written", "first_token_detokenized", "first_chunk_written"),
    ("TTFT (server side)", "received", "first_chunk_written"),
)


def stage_table(records: list[dict]) -> list[str]:
    rows = ["| stage | median (ms) | p99 (ms) |", "| --- | ---: | ---: |"]

    def row(name: str, values: list[float]) -> None:
        if values:
            rows.append(f"| {name} | {np.median(values) * 1e3:.2f} | {np.percentile(values, 99) * 1e3:.2f} |")

    for name, start, end in STAGES:
        row(name, [r[end] - r[start] for r in records if r.get(end) is not None and r.get(start) is not None])
    row("per later token: engine core sent → chunk written (mean per request)",
        [r["token_path_s"] / r["token_path_count"] for r in records if r.get("token_path_count")])  # fmt: skip
    # the burst as a whole: when each request got there, from the first request's receipt
    start = min((r["received"] for r in records if r.get("received") is not None), default=None)
    if start is not None:
        for name, key in (("since the burst's first receipt: tokenized", "tokenized"),
                          ("since the burst's first receipt: in the engine queue", "queued"),
                          ("since the burst's first receipt: first chunk written", "first_chunk_written")):  # fmt: skip
            row(name, [r[key] - start for r in records if r.get(key) is not None])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="default",
        help="default (the embedded model), tiny (1 layer, dummy weights) or a model folder (dummy weights)",
    )
    parser.add_argument(
        "--engine-args",
        default="",
        help="more engine flags for both runs, as 'key=value,key=value' (e.g. device=cuda,max_model_len=2048)",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--num-threads", type=int, default=1, help="CPU threads (0 on a GPU: leave the CPU flags out)"
    )
    parser.add_argument(
        "--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions")
    )
    parser.add_argument("--skip-offline", action="store_true", help="online only (no ratio)")
    parser.add_argument(
        "--max-concurrency", type=int, default=0, help="requests in flight at most (0: all at once)"
    )
    parser.add_argument(
        "--api-server-count", type=int, default=1, help="API server processes of the server (serve's flag)"
    )
    parser.add_argument(
        "--profile", default=None, metavar="DIR", help="py-spy both server processes into DIR"
    )
    parser.add_argument("--profile-seconds", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="functions listed per profile")
    args = parser.parse_args()
    model = {"tiny": tiny_model_dir, "default": lambda: None}.get(args.model, lambda: args.model)()
    no_tokenizer = model and not (Path(model) / "tokenizer_config.json").exists()
    if no_tokenizer and "tokenizer=" not in args.engine_args:  # a config-only folder: SmolLM2's tokenizer
        folder = Path(tempfile.mkdtemp(prefix="fd-tokenizer-"))
        default_tokenizer_into(folder)
        args.engine_args = ",".join(filter(None, [args.engine_args, f"tokenizer={folder}"]))
    if args.model == "tiny":
        args.dtype = "float32"

    offline = None
    if args.skip_offline:
        from fastdeploy.config import EngineConfig
        from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

        config = EngineConfig.from_kwargs(**engine_args(args, model))
        samples = make_samples(load_tokenizer(config.model, resolve_model(config.model)), args)
    else:
        offline, samples = run_offline(args, model)
    metrics, records, cpu_us = run_online(args, model, samples)
    online = metrics.output_throughput
    print(f"workload: {args.num_prompts} prompts x {args.input_len}/{args.output_len} tokens, model {args.model}, "
          f"{args.dtype}, {args.num_threads} thread(s), {args.endpoint}")  # fmt: skip
    if offline is not None:
        print(f"offline output tok/s: {offline:.1f}")
    print(f"online output tok/s:  {online:.1f}")
    if offline is not None:
        print(f"online / offline:     {online / offline:.3f}")
    print(f"client-side median TTFT: {metrics.ttft_ms.median:.2f} ms")
    for name, us in cpu_us.items():
        print(f"{name} CPU per output token: {us:.1f} us")
    api_us = [us for name, us in cpu_us.items() if name.startswith("api_server_")]
    if api_us:
        print(f"API servers together, CPU per output token: {sum(api_us):.1f} us")
    if records:
        print(f"\nper-request stages ({len(records)} requests):")
        print("\n".join(stage_table(records)))
    if args.profile:
        for name in cpu_us:
            path = Path(args.profile) / f"{name}.txt"
            if not path.exists():
                print(f"\nno profile of the {name} (is py-spy installed?)")
                continue
            print(f"\n{name}: top functions by own time (% of busy samples; inclusive %)")
            for own, incl, func in top_functions(path, args.top):
                print(f"  {own:5.1f}  {incl:5.1f}  {func}")


if __name__ == "__main__":
    main()
