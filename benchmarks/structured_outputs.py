"""Structured-output throughput: N chat requests, half under different JSON schemas, against the same
load unconstrained; plus the first-token latency of a request with a new schema.

The structured run goes first; the unconstrained run then gives every request exactly the number of
output tokens it produced there (``ignore_eos``), so both runs do the same token work and the ratio
of their output tokens/s is the cost of the grammars (compiles, matchers, bitmask fill and masking).
``grammar_wait_us_per_structured_token``: the time the engine loop spent advancing matchers and
filling bitmasks, per structured output token. With ``FD_STEP_TRACE=1`` (and one process, TP=1)
``launch_to_sampled_ms_*``: the median host time from a step's forward launch to its sampling
launch, each run (how long grammar rows wait for their bitmask; None without the trace). Each of
the N/2 schemas is distinct, so every one is compiled during the run, off the engine loop; its
request's prompt is prefilled meanwhile and its first token waits for the compile
(``grammar_ready_wait_ms_*``, from arrival); the ``last_end_s_*`` say which requests end each run
(a request that starts late and runs to ``max_tokens`` makes the structured run longer). The run
starts once the compiler's priming (``FD_GRAMMAR_PRIME_LENGTH``) has ended (``priming_wait_s``: how
long after the warm-up that was), as on a server that has been up a while. ``phases_ms_*``: the
engine loop's milliseconds in each of its phases, each run (:func:`time_engine_phases`).

Examples:
    python benchmarks/structured_outputs.py                         # GPU: 256 requests, bfloat16
    python benchmarks/structured_outputs.py --num-requests 16 --output-len 48 --dtype float32   # CPU
    python benchmarks/structured_outputs.py --model benchmarks/configs/llama-3.1-8b --load-format dummy \
        --tokenizer TOKENIZER_DIR                                   # GPU: the 8B shape, random weights
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.sampling_params import StructuredOutputsParams

_WORDS = ["alpha", "bravo", "city", "delta", "echo", "fox", "gold", "hotel", "india", "jade", "kilo", "lima"]


def make_schema(i: int) -> dict:
    """A distinct, bounded JSON schema for request ``i`` (3 to 5 fields of mixed types)."""
    props: dict[str, dict] = {}
    for j in range(3 + i % 3):
        name = f"{_WORDS[(i + j) % len(_WORDS)]}_{i}_{j}"
        kind = (i + j) % 4
        if kind == 0:
            props[name] = {"type": "integer", "minimum": 0, "maximum": 1000}
        elif kind == 1:
            props[name] = {"type": "boolean"}
        elif kind == 2:
            props[name] = {"type": "string", "enum": [f"{w}{i}" for w in _WORDS[j : j + 3]]}
        else:
            props[name] = {"type": "string", "maxLength": 12}
    return {"type": "object", "properties": props, "required": list(props)}


def chat_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request {i}: describe item number {i} as a JSON object."}]


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    """The token ids of the N chat prompts (the chat template applied, as ``LLM.chat`` does)."""
    tokenizer = llm.get_tokenizer()
    texts = [
        tokenizer.apply_chat_template(chat_messages(i), tokenize=False, add_generation_prompt=True)
        for i in range(n)
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def run(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], tag: str
) -> tuple[float, list, list, float]:
    """Every prompt at once through the engine (as ``LLM.generate``): seconds for all, the final
    outputs in prompt order, each request's end (seconds from the start) and the start
    (``time.perf_counter``)."""
    engine = llm.engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt, sp in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, sp)
    finished, ended = {}, {}
    while len(finished) < len(ids):
        for output in engine.step(final_only=True):
            if output.finished:
                finished[output.request_id], ended[output.request_id] = output, time.perf_counter() - start
    return time.perf_counter() - start, [finished[i] for i in ids], [ended[i] for i in ids], start


def time_engine_phases(llm: LLM) -> dict[str, float]:
    """Wrap the engine loop's phases (methods of this engine's core, scheduler and executor, on the
    instances) so that each adds its host seconds to the returned totals: where the loop's time
    goes in each run (``phases_ms_*``; ``outside_step``: the run's wall time outside the core's
    ``step``, i.e. the front end's output handling)."""
    core = llm.engine.core
    totals: dict[str, float] = dict.fromkeys(
        ["step", "set_grammars", "schedule", "sample_pending", "execute", "start_mask", "update"], 0.0
    )
    targets = [
        ("step", core, "step"),
        ("set_grammars", core, "_set_compiled_grammars"),
        ("schedule", core.scheduler, "schedule"),
        ("sample_pending", core, "_sample_pending"),
        ("execute", core.executor, "execute_model_overlap"),
        ("execute", core.executor, "execute_model"),  # (without async scheduling)
        ("start_mask", core, "_start_grammar_bitmask"),
        ("update", core.scheduler, "update_from_output"),
    ]
    for name, owner, attr in targets:
        method = getattr(owner, attr)

        def timed(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(owner, attr, timed)
    return totals


def phase_delta(totals: dict[str, float], before: dict[str, float], wall_s: float) -> dict[str, float]:
    """The phases' milliseconds since ``before`` (a copy of ``totals``), and the wall time outside ``step``."""
    delta = {k: round((totals[k] - before[k]) * 1000, 1) for k in totals}
    delta["outside_step"] = round(wall_s * 1000 - delta["step"], 1)
    return delta


def timed_run(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], tag: str, phases: dict[str, float]
) -> tuple[float, list, list, float, dict[str, float]]:
    """:func:`run`, and the engine loop's phase milliseconds over it (``phases``: the totals of
    :func:`time_engine_phases`)."""
    before = dict(phases)
    seconds, outputs, ends, start = run(llm, prompts, params, tag)
    return seconds, outputs, ends, start, phase_delta(phases, before, seconds)


def trace_stats(llm: LLM, split_s: float | None = None, start: float = 0.0) -> dict[str, Any]:
    """From the steps traced since the last call (``FD_STEP_TRACE=1``, single process; all None
    without a trace): ``launch_to_sampled_ms``, the median host time from a step's forward being
    launched (run, on a CPU) to its sampling being launched (grammar rows wait there for the
    engine's advance and fill); ``step_ms_before`` / ``step_ms_after``, the median time between
    consecutive forward launches before and after ``split_s`` seconds from ``start`` (the steps
    with structured rows against those without, when ``split_s`` is when the last one ended)."""
    stats: dict[str, Any] = {
        "launch_to_sampled_ms": None,
        "step_ms_before": None,
        "step_ms_after": None,
    }
    runner = getattr(getattr(llm.engine.core.executor, "worker", None), "runner", None)
    if runner is None or runner.trace is None:
        return stats
    launched = {step: t for stage, step, t in runner.trace if stage == "execute_end"}
    entered = [t for stage, _, t in runner.trace if stage == "execute_start"]
    gaps = [
        t - launched[step]
        for stage, step, t in runner.trace
        if stage == "postprocess_end" and step in launched
    ]
    runner.trace.clear()
    if gaps:
        stats["launch_to_sampled_ms"] = round(statistics.median(gaps) * 1000, 2)
    times = sorted(launched.values())
    if split_s is not None and len(times) > 2:
        pairs = list(zip(times, times[1:]))
        before_pairs = [(a, b) for a, b in pairs if b - start <= split_s]
        before = [b - a for a, b in before_pairs]
        after = [b - a for a, b in pairs if a - start > split_s]
        stats["step_ms_before"] = round(statistics.median(before) * 1000, 2) if before else None
        stats["step_ms_after"] = round(statistics.median(after) * 1000, 2) if after else None
        stats["steps_before"], stats["steps_after"] = len(before), len(after)
        # the longest steps before the split: (ms from the start, step ms)
        longest = sorted(((b - start, b - a) for a, b in before_pairs), key=lambda p: -p[1])
        stats["longest_steps_before"] = [(round(t * 1000), round(d * 1000, 1)) for t, d in longest[:6]]
        # the time the steps before the split took past their median, and when the first one started
        if before:
            median = statistics.median(before)
            stats["step_excess_ms_before"] = round(sum(d - median for d in before) * 1000, 1)
        stats["first_launch_ms"] = round((times[0] - start) * 1000, 1)
        stats["first_execute_start_ms"] = round((min(entered) - start) * 1000, 1) if entered else None
        stats["first_steps"] = [(round((a - start) * 1000), round((b - a) * 1000, 1)) for a, b in pairs[:8]]
    counts = runner.forward_stats.steps
    stats["forward_paths"] = {path: counts[path] - _last_paths.get(path, 0) for path in counts}
    _last_paths.update(counts)
    return stats


_last_paths: dict[str, int] = {}


def first_token_latency(llm: LLM, params: SamplingParams, tag: str) -> float:
    """Seconds from submitting one chat request to its first output token, on an idle engine."""
    engine = llm.engine
    prompt = llm.get_tokenizer().apply_chat_template(
        chat_messages(7), tokenize=False, add_generation_prompt=True
    )
    start = time.perf_counter()
    engine.add_request(f"ttft-{tag}", prompt, params.clone(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (for a --load-format dummy model)"
    )
    parser.add_argument(
        "--load-format", default="auto", help="auto, or dummy: random weights of --model's config"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256, help="max_tokens of every request")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    parser.add_argument(
        "--repeat-structured",
        action="store_true",
        help="run the structured requests again after the unconstrained run, their grammars compiled "
        "(the per-step cost of the grammars without their compiles)",
    )
    parser.add_argument(
        "--warm-run",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the batch once, unconstrained and 8 tokens long, before the measured runs: the "
        "structured run goes first, and without it its prompts alone would miss the prefix cache "
        "(the later runs reuse them), a full prefill against the others' last block",
    )
    parser.add_argument(
        "--grammar-slice-rows",
        type=int,
        default=0,
        help="fewest grammar rows per mask thread (StructuredOutputManager.SLICE_ROWS; 0: as built)",
    )
    parser.add_argument(
        "--threaded-fill",
        action="store_true",
        help="fill the grammar rows with xgrammar's threaded fill (StructuredOutputManager.THREADED_FILL)",
    )
    args = parser.parse_args()
    from fastdeploy.structured_output.manager import StructuredOutputManager

    if args.grammar_slice_rows:
        StructuredOutputManager.SLICE_ROWS = args.grammar_slice_rows
    StructuredOutputManager.THREADED_FILL = args.threaded_fill

    kwargs = {} if args.async_scheduling == "auto" else {"async_scheduling": args.async_scheduling == "on"}
    if args.tokenizer:
        kwargs["tokenizer"] = args.tokenizer
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        load_format=args.load_format,
        **kwargs,
    )
    n = args.num_requests
    prompts = chat_prompts(llm, n)
    structured = [
        SamplingParams(
            temperature=0,
            max_tokens=args.output_len,
            structured_outputs=StructuredOutputsParams(json=make_schema(i)) if i % 2 == 0 else None,
        )
        for i in range(n)
    ]
    warm = [
        SamplingParams(max_tokens=4),
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json_object=True)),
    ]
    llm.chat([chat_messages(0)] * 2, warm, use_tqdm=False)  # loads the tokenizer info, warms the kernels
    if args.warm_run:
        # the whole batch once, unconstrained and short: every measured run then finds the prompts
        # in the prefix cache (without it the first run, the structured one, prefilled ~3x the tokens)
        run(llm, prompts, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * n, "warm")
    # the compiler, made by the warm-up, primes its cache in the background (FD_GRAMMAR_PRIME_LENGTH;
    # in-process compiles): a server that has been up a while has done it, so the run starts after
    primed = getattr(llm.engine.core.structured, "primed", None)
    priming_start = time.perf_counter()
    if primed is not None:
        primed.result()
    priming_wait_s = time.perf_counter() - priming_start

    core = llm.engine.core
    waited, ready = core.grammar_wait_s, dataclasses.replace(core.grammar_ready_waits)
    trace_stats(llm)  # (drops the warm-up's trace)
    phases = time_engine_phases(llm)
    structured_s, outputs, ends, started, structured_phases = timed_run(
        llm, prompts, structured, "structured", phases
    )
    split_s = max(ends[0::2])  # when the last structured request ended
    structured_trace = trace_stats(llm, split_s, started)
    waited = core.grammar_wait_s - waited
    ready_count = core.grammar_ready_waits.count - ready.count
    ready_mean_s = (core.grammar_ready_waits.total_s - ready.total_s) / max(ready_count, 1)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    structured_tokens = sum(lengths[0::2])
    valid = 0
    for i, o in enumerate(outputs):
        if i % 2 == 0:
            try:
                json.loads(o.outputs[0].text)
                valid += 1
            except ValueError:
                pass
    plain = [SamplingParams(temperature=0, max_tokens=max(k, 1), ignore_eos=True) for k in lengths]
    plain_s, plain_outputs, plain_ends, started, plain_phases = timed_run(
        llm, prompts, plain, "plain", phases
    )
    plain_trace = trace_stats(llm, max(plain_ends[0::2]), started)
    tokens = sum(lengths)
    assert sum(len(o.outputs[0].token_ids) for o in plain_outputs) == sum(max(k, 1) for k in lengths)
    repeat: dict[str, Any] = {}
    if args.repeat_structured:
        again_s, again_outputs, again_ends, started, again_phases = timed_run(
            llm, prompts, structured, "again", phases
        )
        repeat = {
            "cached_grammars_structured_s": round(again_s, 3),
            "cached_grammars_ratio": round(plain_s / again_s, 3),
            "phases_ms_cached_grammars": again_phases,
            **{
                f"{k}_cached_grammars": v for k, v in trace_stats(llm, max(again_ends[0::2]), started).items()
            },
        }

    new_schema = SamplingParams(
        temperature=0, structured_outputs=StructuredOutputsParams(json=make_schema(10**6))
    )
    ttft_new = first_token_latency(llm, new_schema, "new")
    ttft_cached = first_token_latency(llm, new_schema, "cached")
    ttft_plain = first_token_latency(llm, SamplingParams(temperature=0), "plain")
    result = {
        "num_requests": n,
        "structured_requests": (n + 1) // 2,
        "valid_json": valid,
        "output_tokens": tokens,
        "async_scheduling": llm.engine.core.async_scheduling,
        "priming_wait_s": round(priming_wait_s, 3) if primed is not None else None,
        "structured_s": round(structured_s, 3),
        "unconstrained_s": round(plain_s, 3),
        "structured_tok_s": round(tokens / structured_s, 1),
        "unconstrained_tok_s": round(tokens / plain_s, 1),
        "throughput_ratio": round(plain_s / structured_s, 3),
        "grammar_wait_us_per_structured_token": round(waited / max(structured_tokens, 1) * 1e6, 1),
        "grammar_ready_wait_ms_mean": round(ready_mean_s * 1000, 1),
        "grammar_ready_wait_ms_max": round(core.grammar_ready_waits.max_s * 1000, 1),
        "last_end_s_structured_requests": round(max(ends[0::2]), 3),
        "last_end_s_other_requests": round(max(ends[1::2]), 3),
        "last_end_s_unconstrained_run_same_requests": round(max(plain_ends[0::2]), 3),
        "phases_ms_structured": structured_phases,
        "phases_ms_unconstrained": plain_phases,
        **{f"{key}_structured": value for key, value in structured_trace.items()},
        **{f"{key}_unconstrained": value for key, value in plain_trace.items()},
        **repeat,
        "ttft_new_schema_ms": round(ttft_new * 1000, 1),
        "ttft_cached_schema_ms": round(ttft_cached * 1000, 1),
        "ttft_unconstrained_ms": round(ttft_plain * 1000, 1),
    }
    print(f"{'metric':<24}{'value':>12}")
    for key, value in result.items():
        print(f"{key:<24}{value!s:>12}")
    if args.json:
        print(json.dumps(result))
    llm.shutdown()


if __name__ == "__main__":
    main()
