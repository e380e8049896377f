"""``fastdeploy bench serve | throughput | latency``: the benchmark suite's command line.

The measuring code lives in :mod:`fastdeploy.benchmarks`; this module only
parses flags, builds the inputs and prints / saves the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from fastdeploy.benchmarks.datasets import add_dataset_args

SERVE_DESCRIPTION = """\
Load-test an OpenAI-compatible server (ours or another) with streamed requests
and report throughput, TTFT, TPOT, ITL and end-to-end latency (see
docs/benchmark_metrics.md). Prompt lengths are counted with --tokenizer if
given, else with the server's /tokenize and /detokenize endpoints.
"""


def _save_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
        print(f"results saved to {path}")


# --------------------------------------------------------------------------- serve


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    from fastdeploy.benchmarks.serve import BACKENDS, ENDPOINTS

    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="Server URL. [default: %(default)s]"
    )
    parser.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        default="openai",
        help="API flavour, as vLLM's client names them: openai (/v1/completions) or openai-chat "
        "(/v1/chat/completions); sets the default --endpoint. [default: %(default)s]",
    )
    parser.add_argument(
        "--endpoint", choices=ENDPOINTS, default=None, help="[default: the --backend's endpoint]"
    )
    parser.add_argument(
        "--model", default=None, help="Model name to request. [default: the first of /v1/models]"
    )
    parser.add_argument("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'.")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="Local tokenizer to size prompts (HF folder/name, a .gguf file, or 'default' for the "
        "embedded model's). [default: the server's /tokenize]",
    )
    add_dataset_args(parser)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second, Poisson arrivals; inf sends all at once. [default: inf]",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="Ask the server to ignore EOS (exact output lengths)."
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="[default: 0, greedy]")
    parser.add_argument("--num-warmups", type=int, default=0, help="Untimed requests sent before the run.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompts and arrival times.")
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. 'ttft:500 tpot:50' (names: ttft, tpot, e2el).",
    )
    parser.add_argument("--save-result", default=None, metavar="FILE", help="Write the result as JSON.")
    parser.add_argument(
        "--save-detailed", action="store_true", help="Also save per-request timings and errors."
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    parser.add_argument(
        "--no-return-token-ids",
        action="store_true",
        help="Do not ask for return_token_ids (for servers that refuse unknown fields); chunks "
        "whose tokens decode to no text then go uncounted.",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Build the dataset, run the load, print the table; exit code 1 if no request succeeded."""
    from fastdeploy.benchmarks.datasets import (
        HFTokenizer,
        ServerTokenizer,
        TokenizerUnavailableError,
        make_dataset,
    )
    from fastdeploy.benchmarks.metrics import format_table, parse_goodput
    from fastdeploy.benchmarks.serve import BACKENDS, ServeConfig, first_model, run_benchmark

    try:
        slos = parse_goodput(args.goodput)
    except ValueError as exc:
        print(f"fastdeploy bench serve: error: {exc}", file=sys.stderr)
        return 2
    args.endpoint = args.endpoint or BACKENDS[args.backend]
    model = args.model or asyncio.run(first_model(args.base_url, args.api_key))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    tokenizer = (
        HFTokenizer.load(args.tokenizer) if args.tokenizer else ServerTokenizer(args.base_url, None, headers)
    )
    num_prompts = args.num_prompts
    args.num_prompts += args.num_warmups  # warm-ups get their own prompts, drawn from the same dataset
    try:
        samples = make_dataset(args, tokenizer)
    except TokenizerUnavailableError as exc:
        print(
            f"fastdeploy bench serve: error: cannot size prompts with the server's tokenizer ({exc}); "
            "pass --tokenizer (an HF name or folder, a .gguf file, or 'default')",
            file=sys.stderr,
        )
        return 2
    finally:
        args.num_prompts = num_prompts
        if isinstance(tokenizer, ServerTokenizer):
            tokenizer.close()
    cfg = ServeConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        num_warmups=args.num_warmups,
        disable_tqdm=args.disable_tqdm,
        return_token_ids=not args.no_return_token_ids,
    )
    warmups, samples = samples[: args.num_warmups], samples[args.num_warmups :]
    metrics, results = asyncio.run(run_benchmark(cfg, samples, slos, warmups))
    print(format_table(metrics))
    data: dict[str, Any] = {
        "backend": args.backend,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        **metrics.to_dict(),
    }
    if args.save_detailed:
        data["requests"] = [
            {
                "success": r.success,
                "error": r.error,
                "prompt_len": r.prompt_len,
                "output_tokens": r.output_tokens,
                "ttft": r.ttft,
                "tpot": r.tpot,
                "latency": r.latency,
                "itl": r.itl,
            }
            for r in results
        ]
    _save_json(args.save_result, data)
    return 0 if metrics.completed else 1


# --------------------------------------------------------------------------- offline


def _engine_parser_args(parser: argparse.ArgumentParser) -> None:
    from fastdeploy.entrypoints.cli.args import add_engine_and_server_args

    add_engine_and_server_args(parser)


def run_throughput(args: argparse.Namespace) -> int:
    from fastdeploy.platforms.backend import activate

    activate(getattr(args, "backend", "auto"))  # before the engine imports torch
    from fastdeploy import LLM
    from fastdeploy.benchmarks.datasets import HFTokenizer, make_dataset
    from fastdeploy.benchmarks.throughput import run_throughput as measure
    from fastdeploy.entrypoints.cli.args import engine_config_from_args, resolve_args

    ns = resolve_args(args)
    config = engine_config_from_args(ns)  # validates the flags before the model loads
    llm = LLM(**_config_kwargs(ns))
    try:
        ns.seed = ns.seed if ns.seed is not None else 0
        samples = make_dataset(ns, HFTokenizer(llm.get_tokenizer()))
        result = measure(llm, samples, ignore_eos=not ns.no_ignore_eos)
    finally:
        llm.engine.shutdown()
    print(result.table())
    _save_json(
        ns.save_result, {"dataset_name": ns.dataset_name, "dtype": config.model.dtype, **result.to_dict()}
    )
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from fastdeploy.platforms.backend import activate

    activate(getattr(args, "backend", "auto"))  # before the engine imports torch
    from fastdeploy.benchmarks.latency import run_latency as measure
    from fastdeploy.engine.llm_engine import LLMEngine
    from fastdeploy.entrypoints.cli.args import engine_config_from_args, resolve_args

    ns = resolve_args(args)
    engine = LLMEngine(engine_config_from_args(ns))
    try:
        result = measure(
            engine,
            ns.batch_size,
            ns.input_len,
            ns.output_len,
            ns.num_iters,
            ns.num_warmup_iters,
            ns.seed if ns.seed is not None else 0,
        )
    finally:
        engine.shutdown()
    print(result.table())
    _save_json(ns.save_result, result.to_dict())
    return 0


def _config_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine config fields of a resolved namespace, as ``LLM(**kwargs)`` takes them."""
    from fastdeploy.entrypoints.cli.args import engine_flag_specs

    return {spec.key: getattr(ns, spec.key) for spec in engine_flag_specs()}


# --------------------------------------------------------------------------- registration


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` with its ``serve``, ``throughput`` and ``latency`` subcommands."""
    bench = subparsers.add_parser("bench", help="Benchmark a server or the offline engine.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    serve = sub.add_parser(
        "serve",
        help="Load-test an OpenAI-compatible server.",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_args(serve)
    serve.set_defaults(func=run_serve)

    throughput = sub.add_parser(
        "throughput",
        help="Offline engine throughput on a dataset.",
        description="Generate a dataset's prompts with the offline engine (all submitted at once, ignore_eos) "
        "and report requests/s and tokens/s. Engine flags are those of 'fastdeploy serve'.",
    )
    add_dataset_args(throughput)
    throughput.add_argument(
        "--no-ignore-eos", action="store_true", help="Stop at EOS instead of exact lengths."
    )
    throughput.add_argument("--save-result", default=None, metavar="FILE", help="Write the result as JSON.")
    _engine_parser_args(throughput)
    throughput.set_defaults(func=run_throughput)

    latency = sub.add_parser(
        "latency",
        help="Prefill and per-token decode time of one batch.",
        description="Step one batch of random prompts through the engine and report prefill time and "
        "per-token decode time (mean/p50/p90). Engine flags are those of 'fastdeploy serve'.",
    )
    latency.add_argument("--batch-size", type=int, default=8, help="[default: %(default)s]")
    latency.add_argument("--input-len", type=int, default=32, help="[default: %(default)s]")
    latency.add_argument("--output-len", type=int, default=128, help="[default: %(default)s]")
    latency.add_argument("--num-iters", type=int, default=3, help="Timed iterations. [default: %(default)s]")
    latency.add_argument(
        "--num-warmup-iters", type=int, default=1, help="Untimed iterations. [default: %(default)s]"
    )
    latency.add_argument("--save-result", default=None, metavar="FILE", help="Write the result as JSON.")
    _engine_parser_args(latency)
    latency.set_defaults(func=run_latency)
    return bench
