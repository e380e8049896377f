"""The multi-host path on one machine: TP=N on one host vs the same N workers split over two "nodes".

Node 0 (``fastdeploy serve --nnodes 2 --node-rank 0``) sees the first half of the GPUs, node 1
(``--headless``) the second half (``CUDA_VISIBLE_DEVICES``); they meet on 127.0.0.1 (NCCL between
the halves, the engine core's steps to node 1 over ZMQ/TCP). Against ``--tensor-parallel-size N``
on one host it checks the greedy tokens through the ``openai`` client and measures batch-1
inter-token latency (one streamed request, median gap between chunks)::

    python benchmarks/two_nodes_one_host.py --out /tmp/twonodes                  # 2 GPUs, default model
    python benchmarks/two_nodes_one_host.py --model /path/to/hf-folder --tp 4 --out /tmp/twonodes
    python benchmarks/two_nodes_one_host.py --device cpu --tp 2 --out /tmp/cpu  # gloo, checks the script

Writes ``results.json`` in ``--out`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from server_health import free_port

PROMPTS = ["Hello, my name is", "The best way to learn Python is", "List three colors:"]


def serve_cmd(args: argparse.Namespace, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--device", args.device]
    cmd += ["--tensor-parallel-size", str(args.tp), "--max-model-len", str(args.max_model_len)]
    cmd += ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    cmd += ["--kv-cache-memory", "0.25", "--num-threads", "1"] if args.device == "cpu" else []
    return cmd + list(extra)


def start(cmd: list[str], log: Path, gpus: list[int] | None) -> subprocess.Popen:
    env = dict(os.environ)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(url: str, procs: list[subprocess.Popen], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a node exited during start-up:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"not healthy within {timeout_s:.0f} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:  # node 0 first: it shuts the headless node's workers down
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy completions of :data:`PROMPTS` and the median inter-token gap of streamed requests."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    texts = [
        client.completions.create(model=model, prompt=p, max_tokens=32, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    gaps: list[float] = []
    for _ in range(args.repeats):
        stream = client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=args.output_len, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        last = None
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if last is not None:
                    gaps.append((now - last) * 1e3)
                last = now
    return {
        "texts": texts,
        "itl_ms_median": statistics.median(gaps),
        "itl_ms_p90": statistics.quantiles(gaps, n=10)[-1],
    }


def run_layout(args: argparse.Namespace, two_nodes: bool, out: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gpus = list(range(args.tp)) if args.device == "cuda" else None
    if not two_nodes:
        procs = [start(serve_cmd(args, "--port", str(port)), out / "one_host.log", gpus)]
    else:
        half = args.tp // 2
        nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        node0 = start(serve_cmd(args, "--port", str(port), *nodes), out / "node0.log", gpus and gpus[:half])
        node1 = start(
            serve_cmd(args, *nodes, "--node-rank", "1", "--headless"), out / "node1.log", gpus and gpus[half:]
        )
        procs = [node0, node1]
    try:
        wait_healthy(url, procs, out / ("node0.log" if two_nodes else "one_host.log"), args.timeout_s)
        return measure(url, args)
    finally:
        stop(procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (even: half per node)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "one_host": run_layout(args, False, args.out),
        "two_nodes": run_layout(args, True, args.out),
    }
    results["tokens_equal"] = results["one_host"]["texts"] == results["two_nodes"]["texts"]
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"| layout (TP={args.tp}, {args.device}) | batch-1 ITL median ms | p90 ms |")
    print("| --- | --- | --- |")
    for name in ("one_host", "two_nodes"):
        r = results[name]
        print(f"| {name} | {r['itl_ms_median']:.2f} | {r['itl_ms_p90']:.2f} |")
    print(f"greedy texts equal: {results['tokens_equal']}")
    return 0 if results["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
