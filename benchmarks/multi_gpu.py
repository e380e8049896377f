"""Multi-GPU benchmark of issue #22: tensor and data parallelism on one host, with correctness.

One run writes ``results.json`` and prints a markdown summary; every section is independent
(a failure is recorded and the run goes on)::

    python benchmarks/multi_gpu.py --out /tmp/mgpu                       # every section, 2 GPUs
    python benchmarks/multi_gpu.py --sections correctness --default-model /tmp/SmolLM2.gguf
    python benchmarks/multi_gpu.py --sections dp --tokenizer /path/to/tokenizer_dir
    python benchmarks/multi_gpu.py --device cpu --smoke --out /tmp/smoke   # checks the script (gloo)

Sections:

* ``correctness``: greedy tokens in float32 at TP=1 and TP=N on the same device kind: a tiny
  random Llama and a tiny random Qwen3-MoE (saved with ``transformers`` in a temporary folder,
  whose ``generate`` is the reference too) and, with ``--default-model``, the default model; the
  tiny MoE also at TP=N with expert parallelism and through ``fastdeploy serve`` at DP=N with
  expert parallelism (attention data-parallel, experts spread over the N ranks).
* ``tp``: the Llama-3.1-8B shape with dummy bf16 weights at TP=1 and TP=N: batch-1 inter-token
  latency (CUDA graphs on) and offline output tokens/s for ``--num-prompts`` x ``--input-len``
  / ``--output-len`` (greedy, EOS ignored).
* ``dp``: ``fastdeploy serve`` at DP=1 and DP=N on the same model, each driven by
  ``fastdeploy bench serve`` (random prompts, all sent at once): online output tokens/s and
  the DP=N / DP=1 ratio (issue target: >= 1.9x at N=2). Needs ``--tokenizer``.
* ``moe``: as ``tp`` on the Qwen3-30B-A3B shape (``--moe-model``), on one GPU and at TP=N with
  expert parallelism, in bf16 and (on CUDA) with ``quantization="fp8"``.
* ``moe_dp``: as ``dp`` on the MoE shape, DP=N with ``--enable-expert-parallel`` (attention
  data-parallel, experts expert-parallel) against one GPU, per ``--moe-quantizations``.
* ``vllm_tp``: vLLM's offline engine (``vllm_offline.py``) on the ``tp`` workload, TP=1 and TP=N.

``--server vllm`` runs the ``dp`` sections against ``vllm serve`` instead (same client, same
workload); ``--dp-extra "--api-server-count 2"`` adds serve arguments at DP=N only, ``--serve-extra`` at every size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off (device tool's rule)
os.environ.setdefault("PYTHONUNBUFFERED", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpubench.engine_bench import greedy, measure_itl  # noqa: E402
from gpubench.measure import error_text, free_memory, random_prompts  # noqa: E402
from gpubench.settings import CONFIGS, MODEL_8B, TINY_OVERRIDES  # noqa: E402
from server_health import free_port, wait_healthy  # noqa: E402
from serving_compare import server_command as serve_command  # noqa: E402

MODEL_MOE = str(CONFIGS / "qwen3-30b-a3b")

SECTIONS = ("correctness", "tp", "dp", "moe", "moe_dp", "vllm_tp")
ITL_PROMPT_LEN = 32
"""Prompt tokens of the batch-1 latency request."""


def log(message: str) -> None:
    """One timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- correctness ---------------------------------------------------------------------------------


def save_tiny_models(folder: Path) -> dict[str, Path]:
    """A tiny random Llama and Qwen3-MoE saved with ``transformers`` (float32, fixed seeds)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    specs = {
        "tiny-llama": (LlamaForCausalLM, LlamaConfig(intermediate_size=128, **common)),
        "tiny-qwen3-moe": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                intermediate_size=128,
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                **common,
            ),
        ),  # fmt: skip
    }
    paths = {}
    for name, (cls, config) in specs.items():
        torch.manual_seed(0)
        model = cls(config).float().eval()
        paths[name] = folder / name
        model.save_pretrained(paths[name])
    return paths


def engine_tokens(
    model: str, prompts: list[list[int]], tp: int, device: str, max_tokens: int, **engine: Any
) -> list[list[int]]:
    """The offline engine's greedy tokens in float32 at tensor-parallel size ``tp`` (plus ``engine``
    arguments, e.g. ``enable_expert_parallel``)."""
    from fastdeploy import LLM

    llm = LLM(model=model, tensor_parallel_size=tp, dtype="float32", device=device, max_model_len=256,
              kv_cache_memory=0.05, num_threads=1 if device == "cpu" else None, **engine)  # fmt: skip
    try:
        outs = llm.generate(prompts, greedy(max_tokens))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
        del llm  # the in-process engine's KV cache lives as long as the object
        free_memory(torch.device(device))


def served_tokens(
    args: argparse.Namespace, model: str, prompts: list[list[int]], *serve_args: str
) -> list[list[int]]:
    """``fastdeploy serve``'s greedy float32 tokens (``serve_args`` added, e.g. data-parallel
    attention with expert-parallel experts), every prompt in flight at once."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--model", model, "--port", str(port),
             "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256", "--device", args.device,
             *serve_args]  # fmt: skip
    if args.device == "cpu":
        serve += ["--kv-cache-memory", "0.05", "--num-threads", "1"]
    proc = subprocess.Popen(serve, stdout=sys.stderr, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, args.server_timeout_s)
        body = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "temperature": 0,
                "max_tokens": args.correctness_tokens, "ignore_eos": True, "return_token_ids": True}  # fmt: skip

        def tokens(prompt: list[int]) -> list[int]:
            reply = httpx.post(url + "/v1/completions", json={**body, "prompt": prompt}, timeout=300)
            reply.raise_for_status()
            return reply.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(tokens, prompts))
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group; SIGKILL if it is not gone within a minute."""
    with contextlib.suppress(ProcessLookupError):  # a server that failed to start is gone already
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def reference_tokens(model: str, prompts: list[list[int]], device: str, max_tokens: int) -> list[list[int]]:
    """``transformers`` ``generate`` (greedy, EOS ignored) on the same float32 checkpoint."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = ref.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
            out.append(ids[0, len(p) :].tolist())
    del ref
    return out


def correctness(args: argparse.Namespace) -> dict[str, Any]:
    """TP=1 and TP=N greedy tokens (and transformers' for the tiny models) on each model."""
    rows = []
    prompts = [[5, 17, 42, 99, 3], [250, 1, 7], [11] * 9, list(range(30, 70))]
    with tempfile.TemporaryDirectory() as tmp:
        models: dict[str, tuple[str, bool]] = {
            n: (str(p), True) for n, p in save_tiny_models(Path(tmp)).items()
        }
        if args.default_model:
            models["default (SmolLM2-135M GGUF)"] = (args.default_model, False)
        for name, (path, has_reference) in models.items():
            row: dict[str, Any] = {"model": name, "tp": args.tp}
            try:
                one = engine_tokens(path, prompts, 1, args.device, args.correctness_tokens)
                many = engine_tokens(path, prompts, args.tp, args.device, args.correctness_tokens)
                row["tp1_equals_tpn"] = one == many
                if "moe" in name:
                    with_ep = engine_tokens(path, prompts, args.tp, args.device, args.correctness_tokens,
                                            enable_expert_parallel=True)  # fmt: skip
                    row["tp1_equals_tpn_ep"] = one == with_ep
                    served = served_tokens(args, path, prompts, "--data-parallel-size", str(args.tp),
                                           "--enable-expert-parallel")  # fmt: skip
                    row["tp1_equals_dpn_ep_served"] = one == served
                if has_reference:
                    row["tp1_equals_transformers"] = one == reference_tokens(
                        path, prompts, args.device, args.correctness_tokens
                    )
                row["tokens_tp1"], row["tokens_tpn"] = one, many
            except Exception:
                row["error"] = error_text()
            log(f"correctness {name}: { ({k: v for k, v in row.items() if not k.startswith('tokens')}) }")
            rows.append(row)
    return {"rows": rows}


# ---- tensor parallelism: latency and offline throughput -------------------------------------------


def smoke_overrides(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """``hf_config_overrides`` of a ``--smoke`` run (tiny shapes; MoE configs keep 8 experts, top-2)."""
    if not args.smoke:
        return {}
    if "qwen3" in Path(model).name:
        return {**TINY_OVERRIDES, "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2}
    return dict(TINY_OVERRIDES)


def dummy_engine(args: argparse.Namespace, model: str, tp: int, **kwargs: Any) -> Any:
    """The dummy-weight bf16 engine of ``model`` at tensor-parallel size ``tp``."""
    from fastdeploy import LLM

    extra: dict[str, Any] = {"hf_config_overrides": smoke_overrides(args, model)}
    if args.device == "cpu":
        extra.update(num_threads=1, kv_cache_memory=0.05)
    return LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
               seed=0, device=args.device, tensor_parallel_size=tp, **extra, **kwargs)  # fmt: skip


def tp_run(args: argparse.Namespace, model: str, tp: int, **engine: Any) -> dict[str, Any]:
    """Batch-1 ITL and offline throughput of ``model`` at tensor-parallel size ``tp`` (one engine
    for both; ``engine``: more engine arguments, e.g. ``quantization``, ``enable_expert_parallel``)."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import resolve_model

    overrides = smoke_overrides(args, model)
    vocab = resolve_model(ModelConfig(model=model, hf_config_overrides=overrides)).arch.vocab_size
    max_len = -(-(max(args.input_len + args.output_len, ITL_PROMPT_LEN + args.itl_tokens) + 1) // 16) * 16
    llm = dummy_engine(args, model, tp, max_model_len=max_len, max_num_seqs=args.num_prompts,
                       max_num_batched_tokens=args.max_num_batched_tokens, **engine)  # fmt: skip
    try:
        row: dict[str, Any] = {"model": Path(model).name, "tp": tp, **engine}
        row["max_num_batched_tokens"] = llm.config.scheduler.max_num_batched_tokens
        itl_prompts = random_prompts(1, ITL_PROMPT_LEN, vocab, 1)
        row |= {f"batch1_{k}": v for k, v in measure_itl(llm, itl_prompts, args.itl_tokens).items()}
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, 0)
        llm.generate(random_prompts(min(32, args.num_prompts), args.input_len, vocab, 2), greedy(4))
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy(args.output_len))
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row |= {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed}
        row["moe_load_imbalance"] = last_moe_load_imbalance(llm)
        return row
    finally:
        llm.shutdown()
        del llm
        free_memory(torch.device(args.device))


def last_moe_load_imbalance(llm: Any) -> float | None:
    """The engine's last MoE load-balance reading (max / mean pairs per expert over the 48 layers'
    sum, the last ~0.5 s of the run; None for a dense model or an engine core in another process):
    ~1 when the routing spreads over the experts as a trained router's does, up to E / top-k when
    every token picks the same experts (vLLM's dummy weights; docs/benchmarks.md, 23rd session)."""
    scheduler = getattr(getattr(llm.engine, "core", None), "scheduler", None)
    return getattr(scheduler, "moe_load_imbalance", None)


def engine_runs(args: argparse.Namespace, model: str, layouts: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`tp_run` of ``model`` for each layout (``tp`` plus engine arguments)."""
    rows = []
    for layout in layouts:
        try:
            rows.append(tp_run(args, model, **layout))
        except Exception:
            rows.append({"model": Path(model).name, **layout, "error": error_text()})
        log(f"{Path(model).name} {layout}: {rows[-1]}")
    return {"rows": rows}


def moe_layouts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The MoE section's layouts: one GPU and TP=N with expert parallelism, per ``--moe-quantizations``."""
    quants = [None if q == "none" else q for q in args.moe_quantizations.split(",") if q]
    return [
        {
            "tp": tp,
            **({"enable_expert_parallel": True} if tp > 1 else {}),
            **({"quantization": q} if q else {}),
        }
        for q in quants
        for tp in one_and_n(args)
    ]


def one_and_n(args: argparse.Namespace) -> list[int]:
    """The sizes compared: 1 and ``--tp`` (only ``--tp`` with ``--skip-one-gpu``)."""
    return [args.tp] if args.skip_one_gpu else sorted({1, args.tp})


# ---- data parallelism: online throughput through fastdeploy serve ---------------------------------


def server_command(args: argparse.Namespace, model: str, dp: int, port: int) -> list[str]:
    """``serving_compare.py``'s command for ``--server`` (its defaults, dummy weights, the tokenizer)
    in bf16 at data-parallel size ``dp``, with the workload's context length."""
    max_len = str(-(-(args.input_len + args.output_len + 1) // 16) * 16)
    extra = ["--dtype", "bfloat16", "--data-parallel-size", str(dp), "--max-model-len", max_len]
    if args.server == "fastdeploy":
        extra += ["--device", args.device]
        if args.smoke:
            tiny = {**smoke_overrides(args, model), "vocab_size": 49152}  # the tokenizer's ids must fit
            extra += [
                "--hf-config-overrides",
                json.dumps(tiny),
                "--num-threads",
                "1",
                "--kv-cache-memory",
                "0.05",
            ]
    return serve_command(args.server, model, args.tokenizer, port, extra)


def serve_and_bench(args: argparse.Namespace, model: str, dp: int, out: Path, *extra: str) -> dict[str, Any]:
    """Start the server of ``model`` at data-parallel size ``dp`` (plus ``extra`` serve
    arguments), run ``fastdeploy bench serve`` against it, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tag = f"{args.server}_{Path(model).name}_dp{dp}{''.join(extra).replace('-', '_')}"
    serve = server_command(args, model, dp, port) + list(extra)
    log_file = open(out / f"serve_{tag}.log", "w")
    proc = subprocess.Popen(serve, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, args.server_timeout_s)
        result = out / f"bench_{tag}.json"
        bench = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "bench", "serve", "--base-url", url,
                 "--dataset-name", "random", "--num-prompts", str(args.num_prompts), "--input-len",
                 str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm",
                 "--tokenizer", args.tokenizer, "--save-result", str(result)]  # fmt: skip
        done = subprocess.run(bench, capture_output=True, text=True, timeout=args.server_timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"bench serve failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}"
            )
        data = json.loads(result.read_text())
        keys = (
            "output_throughput",
            "request_throughput",
            "completed",
            "failed",
            "total_output_tokens",
            "duration",
        )
        row = {"server": args.server, "model": Path(model).name, "dp": dp, "serve_args": " ".join(extra)} | {
            k: data.get(k) for k in keys
        }
        return row | {"median_ttft_ms": data["ttft_ms"]["median"], "median_tpot_ms": data["tpot_ms"]["median"],
                      "p99_itl_ms": data["itl_ms"]["p99"]}  # fmt: skip
    finally:
        stop_server(proc)
        log_file.close()


def data_parallel(
    args: argparse.Namespace, model: str, out: Path, common: tuple[str, ...] = (), at_n: tuple[str, ...] = ()
) -> dict[str, Any]:
    """:func:`serve_and_bench` at DP=1 and DP=N (serve arguments ``common`` at both, ``at_n``
    and ``--dp-extra`` at DP=N only), and the ratio."""
    if not args.tokenizer:
        return {"error": "--tokenizer is needed for the dp sections"}
    rows = []
    common = (*common, *shlex.split(args.serve_extra))
    sizes = [(1, common)] if not args.skip_one_gpu else []
    if args.tp > 1:  # --tp 1: the one-GPU row alone
        sizes.append((args.tp, (*common, *at_n, *shlex.split(args.dp_extra))))
    for dp, more in sizes:
        try:
            rows.append(serve_and_bench(args, model, dp, out, *more))
        except Exception:
            rows.append({"server": args.server, "model": Path(model).name, "dp": dp, "error": error_text()})
        log(f"{args.server} {Path(model).name} dp={dp} {' '.join(more)}: {rows[-1]}")
    result: dict[str, Any] = {"rows": rows}
    if len(rows) == 2 and all(r.get("output_throughput") for r in rows):
        result["dp_speedup"] = rows[1]["output_throughput"] / rows[0]["output_throughput"]
    return result


def moe_data_parallel(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """:func:`data_parallel` of the MoE model per ``--moe-quantizations``, expert-parallel at DP=N."""
    runs = {}
    for quant in [q for q in args.moe_quantizations.split(",") if q]:
        common = () if quant == "none" else ("--quantization", quant)
        runs[quant] = data_parallel(args, args.moe_model, out, common, ("--enable-expert-parallel",))
    return {"rows": [r for run in runs.values() for r in run["rows"]],
            "dp_speedup": {q: run.get("dp_speedup") for q, run in runs.items()}}  # fmt: skip


def vllm_offline(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``benchmarks/vllm_offline.py`` (vLLM's ``LLM``) on the ``tp`` section's model and workload,
    at TP=1 and TP=N (only N with ``--skip-one-gpu``), each in its own process."""
    rows = []
    for tp in one_and_n(args):
        result = out / f"vllm_offline_tp{tp}.json"
        command = [sys.executable, str(Path(__file__).parent / "vllm_offline.py"), "--model", args.model,
                   "--tokenizer", args.tokenizer, "--tp", str(tp), "--num-prompts", str(args.num_prompts),
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--itl-tokens", str(args.itl_tokens), "--out", str(result)]  # fmt: skip
        with open(out / f"vllm_offline_tp{tp}.log", "w") as log_file:
            done = subprocess.run(
                command, stdout=log_file, stderr=subprocess.STDOUT, timeout=args.server_timeout_s
            )
        if done.returncode == 0 and result.exists():
            rows.append(
                {"model": Path(args.model).name, "tp": tp, "engine": "vllm", **json.loads(result.read_text())}
            )
        else:
            rows.append({"model": Path(args.model).name, "tp": tp, "engine": "vllm",
                         "error": f"exit {done.returncode}, log {log_file.name}"})  # fmt: skip
        log(f"vllm offline tp={tp}: {rows[-1]}")
    return {"rows": rows}


# ---- report ---------------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> str:
    """Markdown tables of the measured numbers (for docs/benchmarks.md)."""
    lines = [f"device: {results.get('device')}", ""]
    corr = results.get("correctness", {}).get("rows", [])
    if corr:
        lines += [
            "| model | TP=1 == TP=N | TP=1 == TP=N+EP | TP=1 == DP=N+EP (served) | TP=1 == transformers |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [f"| {r['model']} | {r.get('tp1_equals_tpn', r.get('error', '')[-80:])} | "
                  f"{r.get('tp1_equals_tpn_ep', '-')} | {r.get('tp1_equals_dpn_ep_served', '-')} | "
                  f"{r.get('tp1_equals_transformers', '-')} |" for r in corr]  # fmt: skip
        lines.append("")
    for section in ("tp", "moe", "vllm_tp"):
        rows = results.get(section, {}).get("rows", [])
        if not rows:
            continue
        lines += ["| model | layout | batch-1 ITL mean (ms) | p50 (ms) | offline output tok/s |",
                  "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
        for r in rows:
            layout = ", ".join(
                f"{k}={v}"
                for k, v in r.items()
                if k in ("engine", "tp", "enable_expert_parallel", "quantization")
            )
            if "error" in r:
                lines.append(f"| {r['model']} | {layout} | error: {r['error'][-120:]} | | |")
            else:
                mean = r.get(
                    "batch1_itl_ms_mean", r.get("batch1_itl_ms")
                )  # vLLM's: one difference of two runs
                p50 = f"{r['batch1_itl_ms_p50']:.2f}" if "batch1_itl_ms_p50" in r else "-"
                lines.append(
                    f"| {r['model']} | {layout} | {mean:.2f} | {p50} | {r['output_tok_per_s']:,.0f} |"
                )
        lines.append("")
    for section in ("dp", "moe_dp"):
        dp = results.get(section, {})
        if not dp.get("rows"):
            continue
        lines += ["| server | model | DP | serve args | online output tok/s | median TTFT (ms) | median TPOT (ms) | P99 ITL (ms) |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for r in dp["rows"]:
            if "error" in r:
                lines.append(
                    f"| {r['server']} | {r['model']} | {r['dp']} | | error: {r['error'][-120:]} | | | |"
                )
            else:
                lines.append(f"| {r['server']} | {r['model']} | {r['dp']} | {r['serve_args']} | {r['output_throughput']:,.0f} | "
                             f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | {r['p99_itl_ms']:.0f} |")  # fmt: skip
        if dp.get("dp_speedup"):
            lines.append(f"\nDP speed-up: {dp['dp_speedup']}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, saving results.json after each."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--out", default="multi_gpu_results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tp", type=int, default=2, help="the parallel size compared with 1 (TP and DP)")
    parser.add_argument(
        "--model", default=MODEL_8B, help="dummy-weight config folder of the tp and dp sections"
    )
    parser.add_argument(
        "--moe-model", default=MODEL_MOE, help="dummy-weight MoE config folder (moe sections)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for the dp and vllm sections")
    parser.add_argument("--server", choices=("fastdeploy", "vllm"), default="fastdeploy", help="dp sections")
    parser.add_argument("--dp-extra", default="", help="dp sections: more serve arguments at DP=N only")
    parser.add_argument("--serve-extra", default="", help="dp sections: more serve arguments at every size")
    parser.add_argument(
        "--moe-quantizations", default="none,fp8", help="moe section: none (bf16) and/or fp8 (needs a GPU)"
    )
    parser.add_argument("--default-model", default=None, help="path of the default model's GGUF file")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default: the offline engine's (16,384 on a large GPU)",
    )
    parser.add_argument("--itl-tokens", type=int, default=128)
    parser.add_argument("--correctness-tokens", type=int, default=24)
    parser.add_argument("--server-timeout-s", type=float, default=400)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script only")
    parser.add_argument(
        "--skip-one-gpu", action="store_true", help="tp and moe sections: only the --tp layouts (no baseline)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.itl_tokens = 4, 16, 8, 8
        args.max_num_batched_tokens, args.correctness_tokens = 64, 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = (
        torch.cuda.get_device_name(0) + f" x{torch.cuda.device_count()}" if args.device == "cuda" else "cpu"
    )
    results: dict[str, Any] = {"device": device, "args": vars(args)}
    sections = [s for s in args.sections.split(",") if s]
    for name in sections:
        start = time.perf_counter()
        log(f"section {name}")
        try:
            if name == "correctness":
                results[name] = correctness(args)
            elif name == "tp":
                results[name] = engine_runs(args, args.model, [{"tp": tp} for tp in one_and_n(args)])
            elif name == "dp":
                results[name] = data_parallel(args, args.model, out)
            elif name == "moe":
                results[name] = engine_runs(args, args.moe_model, moe_layouts(args))
            elif name == "moe_dp":
                results[name] = moe_data_parallel(args, out)
            elif name == "vllm_tp":
                results[name] = vllm_offline(args, out)
            else:
                raise SystemExit(f"unknown section {name}; choose from {', '.join(SECTIONS)}")
        except Exception:
            results[name] = {"error": error_text()}
        results[name]["wall_s"] = time.perf_counter() - start
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
