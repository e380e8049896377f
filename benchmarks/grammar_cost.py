"""The engine core's grammar work for the structured-output benchmark's schemas, without a model:
compiling them, then the per-step work of decoding one JSON answer under each.

Compile: every schema is distinct (benchmarks/structured_outputs.py's ``make_schema``) and all
are submitted at once to the engine core's ``StructuredOutputManager``, as the benchmark's
requests arrive. Steps: one matcher per schema walks the tokens of a valid answer; each step
gives every matcher one token (``accept``: the scheduler's part), starts the mask
(``start``: the engine loop's own part of ``StructuredOutputManager.start_bitmask``), waits for the
manager's threads to advance the matchers and fill the rows (``mask``: all of the threads' work
when nothing else runs meanwhile), sends it as the executor does (``wire``: msgpack there and
back) and lays
it into the worker's batch of twice as many rows (``worker``: ``ModelRunner._token_bitmask`` on
a CPU).
Means over the steps, in µs per structured row. Then ``loop_share``: how much a mask being made
slows plain-Python work beside it (the engine loop's own), and what is left to wait for after it.

``FD_XGRAMMAR_CACHE_MB=0`` compiles without xgrammar's cache, ``FD_GRAMMAR_COMPILE_THREADS``
sets the threads (compiles and fills), ``--no-unroll`` keeps bounded repetitions as they are
(``structured_output/repetition.py``).

Examples:
    python benchmarks/grammar_cost.py --vocab-size 128256          # the default model's tokenizer, 8B vocab
    python benchmarks/grammar_cost.py --tokenizer TOK --vocab-size 128256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from structured_outputs import make_schema  # noqa: E402

from fastdeploy import envs  # noqa: E402
from fastdeploy.core.sampling_params import StructuredOutputsParams  # noqa: E402
from fastdeploy.core.step_io import GrammarBitmask  # noqa: E402
from fastdeploy.engine.ipc import decode, encode  # noqa: E402
from fastdeploy.structured_output.manager import StructuredOutputManager  # noqa: E402
from fastdeploy.worker.model_runner import ModelRunner  # noqa: E402


def load_tokenizer(path: str | None):
    """``path``'s tokenizer, or the embedded default model's."""
    if path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from fastdeploy.model_executor.model_loader.default_model import default_model_path
    from fastdeploy.model_executor.model_loader.gguf_loader import load_gguf_tokenizer

    return load_gguf_tokenizer(default_model_path())


def answer(schema: dict) -> str:
    """A valid answer to one of ``make_schema``'s schemas (strings of 10 characters)."""
    values = {}
    for key, prop in schema["properties"].items():
        if "enum" in prop:
            values[key] = prop["enum"][-1]
        else:
            values[key] = {"integer": 417, "boolean": False, "string": "quick fox!"}[prop["type"]]
    return json.dumps(values, separators=(", ", ": "))


def compile_all(manager: StructuredOutputManager, schemas: list[dict]) -> tuple[list, dict]:
    """The compiled grammars and the compile figures."""
    manager.compiler()  # the tokenizer info, built once per engine: not part of a compile
    manager.submit(StructuredOutputsParams(json_object=True)).result()
    start = time.perf_counter()
    futures = [manager.submit(StructuredOutputsParams(json=schema)) for schema in schemas]
    compiled, ready = [], []
    for future in futures:
        compiled.append(future.result())
        ready.append(time.perf_counter() - start)
    total = time.perf_counter() - start
    return compiled, {
        "all_compiled_s": round(total, 3),
        "compile_ms_per_schema": round(total / len(schemas) * 1000, 2),
        "median_ready_ms": round(statistics.median(ready) * 1000, 1),
    }


def step_costs(manager: StructuredOutputManager, compiled: list, answers: list[list[int]], eos: int) -> dict:
    """Median µs per structured row of each part of a step (module docstring)."""
    grammars = [manager.new_request_grammar(c, [eos]) for c in compiled]
    req_ids = [f"r{i}" for i in range(len(grammars))]
    steps = min(len(tokens) for tokens in answers)
    cpu_runner = SimpleNamespace(device=torch.device("cpu"))
    batch = [
        name for req_id in req_ids for name in (req_id, f"plain-{req_id}")
    ]  # every other row constrained
    parts: dict[str, list[float]] = {"accept": [], "start": [], "mask": [], "wire": [], "worker": []}
    received: list[GrammarBitmask] = []
    for step in range(1, steps):
        t0 = time.perf_counter()
        for grammar, tokens in zip(grammars, answers):
            grammar.accept_token(tokens[step - 1])
        t1 = time.perf_counter()
        pending = manager.start_bitmask(req_ids, grammars)
        t2 = time.perf_counter()
        bitmask = pending.result()
        t3 = time.perf_counter()
        wire = decode(encode(["sample_tokens", [bitmask.to_wire()]]))
        received.append(GrammarBitmask(**wire[1][0]))
        t4 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name].append(seconds / len(grammars) * 1e6)
    # The worker's part apart, after the steps: on a GPU it runs in the worker process, and torch's
    # CPU threads, spinning after each op, would otherwise slow the grammar threads here.
    for bitmask in received:
        t0 = time.perf_counter()
        ModelRunner._token_bitmask(cpu_runner, batch, bitmask)
        parts["worker"].append((time.perf_counter() - t0) / len(grammars) * 1e6)
    if any(getattr(g, "failed", False) for g in grammars):
        raise RuntimeError("an answer left its grammar")
    result = {f"{name}_us_per_row": round(statistics.mean(v), 2) for name, v in parts.items()}
    result["steps"] = steps - 1
    return result


def python_work(iterations: int = 20_000) -> int:
    """Plain Python (dict and int operations) standing in for the engine loop's own work."""
    table: dict[int, int] = {}
    total = 0
    for i in range(iterations):
        table[i & 255] = i
        total += table.get((i * 7) & 255, 0)
    return total


def loop_share(manager: StructuredOutputManager, compiled: list, answers: list[list[int]], eos: int) -> dict:
    """How much the mask being made slows the engine loop's Python beside it: each step times the
    same plain-Python work with no mask pending and while one is made (the grammar threads need the
    GIL for what they do outside native calls, and a native call that keeps it stalls the loop),
    then the wait for what is left of the mask. ``loop_slowdown``: the mean ratio of the two times."""
    grammars = [manager.new_request_grammar(c, [eos]) for c in compiled]
    req_ids = [f"r{i}" for i in range(len(grammars))]
    slowdown, left = [], []
    for step in range(1, min(len(tokens) for tokens in answers)):
        for grammar, tokens in zip(grammars, answers):
            grammar.accept_token(tokens[step - 1])
        t0 = time.perf_counter()
        python_work()
        t1 = time.perf_counter()
        pending = manager.start_bitmask(req_ids, grammars)
        t2 = time.perf_counter()
        python_work()
        t3 = time.perf_counter()
        pending.result()
        t4 = time.perf_counter()
        slowdown.append((t3 - t2) / (t1 - t0))
        left.append((t4 - t3) / len(grammars) * 1e6)
    return {
        "loop_work_ms": round((t1 - t0) * 1000, 2),
        "loop_slowdown": round(statistics.mean(slowdown), 2),
        "mask_left_after_loop_work_us_per_row": round(statistics.mean(left), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder; default: the embedded SmolLM2")
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's vocabulary (logits' width)")
    parser.add_argument("--num-schemas", type=int, default=128)
    parser.add_argument("--no-unroll", action="store_true", help="keep bounded repetitions as they are")
    parser.add_argument("--threaded-fill", action="store_true", help="StructuredOutputManager.THREADED_FILL")
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="the interpreter's switch interval (0: Python's 5 ms)",
    )
    args = parser.parse_args()
    StructuredOutputManager.THREADED_FILL = args.threaded_fill
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.no_unroll:
        import fastdeploy.structured_output.grammar as grammar

        grammar.unrolled = lambda g: g

    tokenizer = load_tokenizer(args.tokenizer)
    vocab = args.vocab_size or len(tokenizer)
    eos = tokenizer.eos_token_id
    schemas = [make_schema(2 * i) for i in range(args.num_schemas)]
    manager = StructuredOutputManager(lambda: tokenizer, vocab, [eos])
    try:
        compiled, result = compile_all(manager, schemas)
        answers = [tokenizer.encode(answer(s), add_special_tokens=False) + [eos] for s in schemas]
        result.update(step_costs(manager, compiled, answers, eos))
        result.update(loop_share(manager, compiled, answers, eos))
    finally:
        manager.shutdown()
    head = {"num_schemas": args.num_schemas, "vocab_size": vocab, "unrolled": not args.no_unroll}
    head.update(compile_threads=envs.FD_GRAMMAR_COMPILE_THREADS, xgrammar_cache_mb=envs.FD_XGRAMMAR_CACHE_MB)
    print(json.dumps({**head, **result}))


if __name__ == "__main__":
    main()
