"""Online serving side by side: one server (``fastdeploy serve`` or ``vllm serve``) driven by
both benchmark clients (``vllm bench serve`` and ``fastdeploy bench serve``) on issue #19's workloads.

    python benchmarks/serving_compare.py --server fastdeploy --model benchmarks/configs/llama-3.1-8b \\
        --tokenizer TOK --out /tmp/cmp [--rate 28] [--clients fastdeploy,vllm] [-- extra server flags]

Workloads (random prompts of 512 tokens, 256 output tokens each, ``ignore_eos``):

* ``burst``: 256 requests at once (infinite rate), completions;
* ``c1``: concurrency 1, 8 requests;
* ``poisson``: 256 requests at ``--rate`` requests/s (Poisson arrivals; issue #19 asks for ~80%
  of saturation: take 0.8 x the burst's request throughput of the faster server);
* ``chat``: 256 requests at once on ``/v1/chat/completions``, streamed.

A workload named more than once in ``--workloads`` runs again each time (``burst,burst,burst``:
three bursts on the one server; their files get ``_2``, ``_3``).

The server starts with its defaults plus dummy weights and the tokenizer (``--load-format
dummy``); everything after ``--`` is passed to it. Each client run writes its JSON under
``--out``; the script prints one markdown row per (workload, client) and saves them to
``--out/summary.json``. ``vllm`` must be importable for the vLLM server and client (see
docs/benchmarks.md for how it is carried to the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from server_health import wait_healthy

WORKLOADS: dict[str, dict[str, Any]] = {
    "burst": {"num_prompts": 256, "rate": "inf", "concurrency": None, "chat": False},
    "c1": {"num_prompts": 8, "rate": "inf", "concurrency": 1, "chat": False},
    "poisson": {"num_prompts": 256, "rate": None, "concurrency": None, "chat": False},
    "chat": {"num_prompts": 256, "rate": "inf", "concurrency": None, "chat": True},
}
for _spec in WORKLOADS.values():
    _spec.update(input_len=512, output_len=256)
SERVED_NAME = "model"


def server_command(kind: str, model: str, tokenizer: str, port: int, extra: list[str]) -> list[str]:
    """The server's command line: its defaults, dummy weights, the tokenizer, and ``extra``."""
    common = ["--load-format", "dummy", "--tokenizer", tokenizer, "--port", str(port)]
    common += ["--served-model-name", SERVED_NAME]
    if kind == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *common, *extra]
    return [
        sys.executable,
        "-m",
        "fastdeploy.entrypoints.cli.main",
        "serve",
        "--model",
        model,
        *common,
        *extra,
    ]


CLIENTS = ("vllm", "fastdeploy")


def prompt_seed(workload: str, client: str, repeat: int = 0) -> int:
    """The prompts' seed of one (workload, client, repeat) run: the same on both servers, different
    for every run on one server, so no run finds its prompts in the prefix cache of an earlier one
    (with one seed for all, every run after the first was served from the cache, repeats too)."""
    return 1 + len(CLIENTS) * list(WORKLOADS).index(workload) + CLIENTS.index(client) + 1000 * repeat


def client_command(
    client: str, workload: str, port: int, tokenizer: str, rate: float, out: str, repeat: int = 0
) -> list[str]:
    """One benchmark client run of ``workload`` (its ``repeat``-th again), writing its JSON to ``out``."""
    spec = WORKLOADS[workload]
    url = f"http://127.0.0.1:{port}"
    request_rate = str(rate) if spec["rate"] is None else spec["rate"]
    endpoint = "/v1/chat/completions" if spec["chat"] else "/v1/completions"
    if client == "vllm":
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai-chat" if spec["chat"] else "vllm", "--endpoint", endpoint,
            "--base-url", url, "--model", SERVED_NAME, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(spec["input_len"]),
            "--random-output-len", str(spec["output_len"]),
            "--num-prompts", str(spec["num_prompts"]), "--ignore-eos", "--request-rate", request_rate,
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out),
        ]  # fmt: skip
    else:
        cmd = [
            sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai-chat" if spec["chat"] else "openai", "--endpoint", endpoint,
            "--base-url", url, "--model", SERVED_NAME, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--input-len", str(spec["input_len"]), "--output-len", str(spec["output_len"]),
            "--num-prompts", str(spec["num_prompts"]), "--ignore-eos", "--request-rate", request_rate,
            "--save-result", out, "--disable-tqdm",
        ]  # fmt: skip
    if spec["concurrency"]:
        cmd += ["--max-concurrency", str(spec["concurrency"])]
    return cmd + ["--seed", str(prompt_seed(workload, client, repeat))]


def summarize(client: str, path: str) -> dict[str, Any]:
    """The figures issue #19 compares, from either client's JSON."""
    with open(path) as f:
        data = json.load(f)
    if client == "vllm":
        return {
            "completed": data.get("completed"),
            "output_tok_s": data.get("output_throughput"),
            "request_s": data.get("request_throughput"),
            "median_ttft_ms": data.get("median_ttft_ms"),
            "median_tpot_ms": data.get("median_tpot_ms"),
            "p99_itl_ms": data.get("p99_itl_ms"),
        }
    return {
        "completed": data.get("completed"),
        "output_tok_s": data.get("output_throughput"),
        "request_s": data.get("request_throughput"),
        "median_ttft_ms": data["ttft_ms"]["median"],
        "median_tpot_ms": data["tpot_ms"]["median"],
        "p99_itl_ms": data["itl_ms"]["p99"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("fastdeploy", "vllm"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--rate", type=float, default=0.0, help="poisson requests/s (0: 0.8 x this burst's)")
    parser.add_argument("--clients", default="vllm,fastdeploy")
    parser.add_argument("--workloads", default="burst,c1,poisson,chat")
    parser.add_argument("--start-timeout-s", type=float, default=400)
    parser.add_argument("--smoke", action="store_true", help="8 prompts of 32 / 8 tokens (checks the script)")
    args, extra = parser.parse_known_args()
    if args.smoke:
        for spec in WORKLOADS.values():
            spec.update(num_prompts=min(spec["num_prompts"], 8), input_len=32, output_len=8)
    extra = [a for a in extra if a != "--"]
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"{args.server}_server.log"), "w")
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0")
    cmd = server_command(args.server, args.model, args.tokenizer, args.port, extra)
    print("server:", " ".join(cmd), flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    rows = []
    try:
        wait_healthy(f"http://127.0.0.1:{args.port}", proc, args.start_timeout_s)
        print(f"healthy after {time.monotonic() - started:.0f} s", flush=True)
        rate = args.rate
        workloads = args.workloads.split(",")
        for index, workload in enumerate(workloads):
            run = workloads[:index].count(workload)  # a workload named again is run again (repeats)
            name = f"{workload}{f'_{run + 1}' if run else ''}"
            for client in args.clients.split(","):
                out = os.path.join(args.out, f"{args.server}_{name}_{client}.json")
                ccmd = client_command(client, workload, args.port, args.tokenizer, rate or 1.0, out, run)
                with open(os.path.join(args.out, f"{args.server}_{name}_{client}.log"), "w") as clog:
                    rc = subprocess.run(
                        ccmd, stdout=clog, stderr=subprocess.STDOUT, env=env, timeout=300
                    ).returncode
                row = {"server": args.server, "workload": workload, "client": client, "rc": rc}
                if rc == 0 and os.path.exists(out):
                    row.update(summarize(client, out))
                    if workload == "burst" and not rate and row.get("request_s"):
                        rate = round(0.8 * row["request_s"], 2)
                        print(f"poisson rate: {rate} requests/s", flush=True)
                row["rate"] = rate if workload == "poisson" else WORKLOADS[workload]["rate"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        with open(os.path.join(args.out, f"{args.server}_summary.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(
        "| server | workload | client | output tok/s | median TTFT ms | median TPOT ms | P99 ITL ms | done |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['server']} | {r['workload']} | {r['client']} | {_fmt(r, 'output_tok_s', 0)} | "
            f"{_fmt(r, 'median_ttft_ms')} | {_fmt(r, 'median_tpot_ms', 2)} | {_fmt(r, 'p99_itl_ms')} | "
            f"{r.get('completed', 'rc ' + str(r['rc']))} |"
        )


def _fmt(row: dict[str, Any], key: str, digits: int = 1) -> str:
    value = row.get(key)
    return "" if value is None else f"{value:,.{digits}f}"


if __name__ == "__main__":
    main()
