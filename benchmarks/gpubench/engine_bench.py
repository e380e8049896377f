"""Engine-level sections: correctness, inter-token latency, throughput (and transformers), overlap.

Every engine is built, used and shut down inside :func:`with_engine`, and GPU memory is
released before the next one; a failing configuration becomes an ``error`` entry of its
row instead of ending the section.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .measure import GpuMonitor, error_text, find_runner, free_memory, parameter_count, random_prompts, sync
from .settings import Settings

CORRECTNESS_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "List three facts about the moon:\n1.",
    "Once upon a time, in a small village by the sea,",
)
LOGITS_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels; later, stored programs let the same hardware run many tasks. Compilers turned symbolic "
    "instructions into machine code, and operating systems shared one computer among many users. "
) * 3
BF16_LOGITS_TOLERANCE = 2e-2


def with_engine(
    s: Settings, model: str | None, fn: Callable[[Any], Any], device: str | None = None, **kwargs: Any
) -> Any:
    """Build ``LLM(model, ...)``, return ``fn(llm)``, then shut it down and free its memory.

    ``model`` None is the embedded default model (real weights and tokenizer); any other
    path is a dummy-weight config folder. ``device`` defaults to the benchmarked one.
    """
    from fastdeploy import LLM

    base: dict[str, Any] = s.dummy_kwargs() if model is not None else {}
    target = device or s.device.type
    if target == s.device.type:
        base.update(s.engine_extra)
    base.update(kwargs)
    free_memory(s.device)  # whatever an engine that failed to start left behind
    llm = LLM(model=model, device=target, **base)
    try:
        return fn(llm)
    finally:
        llm.shutdown()
        del llm
        free_memory(s.device)


def greedy(max_tokens: int) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored, so every run has the same length)."""
    from fastdeploy import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def arch_of(s: Settings, model: str | None) -> Any:
    """The ``ModelArchConfig`` of ``model`` as the engine sees it (with the run's config overrides)."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import resolve_model

    overrides = s.overrides if model is not None else {}
    return resolve_model(ModelConfig(model=model, hf_config_overrides=dict(overrides))).arch


# ---- 1. correctness --------------------------------------------------------------------------


def correctness(s: Settings) -> dict[str, Any]:
    """Greedy tokens of the device engine (float32) against the CPU engine; bf16 vs fp32 prefill logits."""
    model = s.correctness_model
    small = dict(max_num_seqs=4, max_model_len=512)

    def cpu_run(llm: Any) -> tuple[list[list[int]], list[list[int]], list[int]]:
        tokenizer = llm.get_tokenizer()
        if tokenizer is not None:
            prompts = [tokenizer.encode(t) for t in CORRECTNESS_TEXTS[: s.correctness_prompts]]
            logits_ids = tokenizer.encode(LOGITS_TEXT)
        else:
            vocab = llm.engine.source.arch.vocab_size
            prompts = random_prompts(s.correctness_prompts, 12, vocab, s.seed)
            logits_ids = random_prompts(1, 64, vocab, s.seed + 1)[0]
        outs = llm.generate(prompts, greedy(s.correctness_tokens))
        return prompts, [list(o.outputs[0].token_ids) for o in outs], logits_ids

    prompts, cpu_tokens, logits_ids = with_engine(
        s, model, cpu_run, device="cpu", dtype="float32", kv_cache_memory=0.25, **small
    )
    result: dict[str, Any] = {
        "model": model or "default (SmolLM2-135M-Instruct GGUF)",
        "cpu_tokens": cpu_tokens,
    }
    try:
        result.update(compare_device_tokens(s, model, prompts, cpu_tokens, small))
    except Exception:
        result["greedy_error"] = error_text()
    try:
        result["logits"] = logits_check(s, model, logits_ids)
    except Exception:
        result["logits"] = {"status": "error", "error": error_text()}
    return result


def compare_device_tokens(
    s: Settings,
    model: str | None,
    prompts: list[list[int]],
    cpu_tokens: list[list[int]],
    small: dict[str, int],
) -> dict[str, Any]:
    """Greedy float32 tokens of the engine on the benchmarked device, compared token by token with the CPU's."""

    def run(llm: Any) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(s.correctness_tokens))]

    blocks = small["max_num_seqs"] * small["max_model_len"] // 16 + 8
    device_tokens = with_engine(s, model, run, dtype="float32", num_gpu_blocks_override=blocks, **small)
    rows = []
    for i, (ref, got) in enumerate(zip(cpu_tokens, device_tokens)):
        mismatch = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if mismatch is None and len(ref) != len(got):
            mismatch = min(len(ref), len(got))
        rows.append({"prompt": i, "prompt_tokens": len(prompts[i]), "tokens": len(ref),
                     "equal": mismatch is None, "first_mismatch": mismatch})  # fmt: skip
    return {
        "greedy_tokens": rows,
        "greedy_equal": all(r["equal"] for r in rows),
        "device_tokens": device_tokens,
    }


def prefill_logits(s: Settings, model: str | None, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    """Float32 logits of one prefill of ``ids`` by the model loaded directly (no engine, no KV cache)."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import load_model, resolve_model

    kwargs = s.dummy_kwargs() if model is not None else {}
    kwargs.pop("skip_tokenizer_init", None)
    kwargs.pop("quantization", None)  # the logits check compares bf16 with fp32, unquantized
    kwargs["dtype"] = str(dtype).replace("torch.", "")
    config = ModelConfig(model=model, **kwargs)
    net = load_model(config, resolve_model(config), s.device, dtype)
    with torch.inference_mode():
        tokens = torch.tensor(ids, device=s.device)
        logits = net.compute_logits(net(tokens, torch.arange(len(ids), device=s.device))).float().cpu()
    del net
    free_memory(s.device)
    return logits


def logits_check(s: Settings, model: str | None, ids: list[int]) -> dict[str, Any]:
    """Relative error of bf16 prefill logits against fp32: max |bf16 - fp32| / max |fp32|."""
    ref = prefill_logits(s, model, torch.float32, ids)
    low = prefill_logits(s, model, torch.bfloat16, ids)
    diff = (low - ref).abs()
    rel_max = float(diff.max() / ref.abs().max())
    return {
        "status": "ok",
        "prompt_tokens": len(ids),
        "rel_err_max": rel_max,
        "rel_err_mean": float(diff.mean() / ref.abs().mean()),
        "argmax_agreement": float((low.argmax(-1) == ref.argmax(-1)).float().mean()),
        "tolerance": BF16_LOGITS_TOLERANCE,
        "within_tolerance": rel_max <= BF16_LOGITS_TOLERANCE,
    }


# ---- 3. inter-token latency -----------------------------------------------------------------


def measure_itl(llm: Any, prompts: list[list[int]], num_tokens: int) -> dict[str, Any]:
    """Step ``len(prompts)`` requests through the engine together and time the arrival of each
    token of the first one (all of them decode in lockstep)."""
    llm.generate(prompts, greedy(8))  # warm-up: kernels compiled, graphs captured
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"itl-{i}", prompt, greedy(num_tokens))
    arrivals: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "itl-0":
                now = time.perf_counter()
                arrivals.extend([now] * (len(out.outputs[0].token_ids) - len(arrivals)))
    if len(arrivals) < 2:
        raise RuntimeError(f"got {len(arrivals)} tokens; need at least 2 to time")
    gaps = np.diff(arrivals) * 1000.0
    runner = find_runner(llm)
    weights = None
    if runner is not None and getattr(runner, "model", None) is not None:
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return {
        "tokens": len(arrivals),
        "itl_ms_mean": (arrivals[-1] - arrivals[0]) * 1000.0 / (len(arrivals) - 1),
        "itl_ms_p50": float(np.percentile(gaps, 50)),
        "itl_ms_p90": float(np.percentile(gaps, 90)),
        "runner_weight_bytes": weights,
    }


def weight_bytes_per_token(arch: Any, quantization: str | None) -> int:
    """Weight bytes one decode step reads: bf16 everywhere, or (fp8) one byte per decoder-layer
    weight with the embedding and LM head in bf16 (the block scales add 1/16384 and are left out)."""
    params = parameter_count(arch)
    if quantization != "fp8":
        return params * 2
    embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return params + embeddings


def itl(s: Settings, copy_bytes_per_s: float) -> dict[str, Any]:
    """Decode latency of the 1B and 8B shapes per attention backend, graphs on and off, at batch 1
    against the weight-read floor (and at the other ``--itl-batch-sizes``, for the backends' crossover)."""
    rows = []
    batches = sorted(set(s.itl_batch_sizes) | {1})
    max_seqs = max(8, batches[-1])
    for name, path, target in (("Llama-3.2-1B", s.model_1b, 1.5), ("Llama-3.1-8B", s.model_8b, 1.2)):
        arch = arch_of(s, path)
        weight_bytes = weight_bytes_per_token(arch, s.quantization)
        floor_ms = weight_bytes / copy_bytes_per_s * 1000.0
        prompts = random_prompts(batches[-1], s.itl_prompt_len, arch.vocab_size, s.seed)
        max_len = -(-(s.itl_prompt_len + s.itl_tokens + 16) // 16) * 16
        for backend, eager in itertools.product(s.attention_backends, (False, True)):

            def run(
                llm: Any, sizes: list[int] = batches if not eager else [1], ps=prompts
            ) -> list[dict[str, Any]]:
                return [
                    {"batch": b} | measure_itl(llm, ps[:b], s.itl_tokens) | backend_of(llm) for b in sizes
                ]

            base: dict[str, Any] = {
                "model": name,
                "cuda_graphs": not eager,
                "attention_backend": backend,
                "weight_bytes": weight_bytes,
                "floor_ms": floor_ms,
                "target_ratio": target,
            }
            try:
                measured = with_engine(
                    s, path, run, enforce_eager=eager, max_num_seqs=max_seqs, max_model_len=max_len,
                    num_gpu_blocks_override=max_seqs * max_len // 16 + 8, attention_backend=backend,
                )  # fmt: skip
            except Exception:
                rows.append(base | {"batch": 1, "error": error_text()})
                continue
            for m in measured:
                row = base | m
                if m["batch"] == 1:
                    row["ratio_to_floor"] = row["itl_ms_mean"] / floor_ms
                    row["meets_target"] = row["ratio_to_floor"] <= target
                rows.append(row)
    return {"rows": rows, "copy_bytes_per_s": copy_bytes_per_s}


# ---- 4. throughput -----------------------------------------------------------------------------


def backend_of(llm: Any) -> dict[str, Any]:
    """The attention backend the engine's runner actually uses (``auto`` resolved)."""
    runner = find_runner(llm)
    return {"attention_backend": runner.attn_backend.name} if runner is not None else {}


def engine_throughput(
    s: Settings, prompts: list[list[int]], async_on: bool, graphs_on: bool, backend: str = "auto"
) -> dict[str, Any]:
    """Output tokens/s of ``LLM.generate`` over all prompts (greedy, ignore_eos) after a warm-up batch."""
    vocab = arch_of(s, s.model_8b).vocab_size
    warmup = random_prompts(min(32, len(prompts)), s.input_len, vocab, s.seed + 1)

    def run(llm: Any) -> dict[str, Any]:
        llm.generate(warmup, greedy(4))
        sync(s.device)
        with GpuMonitor(s.device) as monitor:
            start = time.perf_counter()
            outs = llm.generate(prompts, greedy(s.output_len))
            sync(s.device)
            elapsed = time.perf_counter() - start
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / elapsed,
                "total_tok_per_s": (out_tokens + sum(map(len, prompts))) / elapsed,
                "gpu": monitor.summary()} | backend_of(llm)  # fmt: skip

    return with_engine(
        s, s.model_8b, run, async_scheduling=async_on, enforce_eager=not graphs_on,
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=-(-(s.input_len + s.output_len + 1) // 16) * 16, attention_backend=backend,
    )  # fmt: skip


def hf_throughput(s: Settings, prompts: list[list[int]]) -> dict[str, Any]:
    """transformers ``generate`` (greedy, exactly ``output_len`` new tokens) in static batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(s.model_8b)
    for key, value in s.overrides.items():
        setattr(config, key, value)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(s.device):  # random init directly on the device
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(previous)
    kwargs = dict(do_sample=False, max_new_tokens=s.output_len, min_new_tokens=s.output_len, pad_token_id=0)
    try:
        with torch.inference_mode():
            model.generate(
                torch.tensor(prompts[:1], device=s.device),
                **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4},
            )
            sync(s.device)
            with GpuMonitor(s.device) as monitor:
                start, generated = time.perf_counter(), 0
                for i in range(0, len(prompts), s.hf_batch_size):
                    ids = torch.tensor(prompts[i : i + s.hf_batch_size], device=s.device)
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                    generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
                sync(s.device)
                elapsed = time.perf_counter() - start
    finally:
        del model
        free_memory(s.device)
    return {"num_prompts": len(prompts), "batch_size": s.hf_batch_size, "elapsed_s": elapsed,
            "output_tokens": generated, "output_tok_per_s": generated / elapsed,
            "total_tok_per_s": (generated + sum(map(len, prompts))) / elapsed, "gpu": monitor.summary()}  # fmt: skip


def throughput(
    s: Settings, matmul_flop_per_s: float | None, sustained_flop_per_s: float | None = None
) -> dict[str, Any]:
    """Engine tokens/s per async/graphs mode, the transformers baseline, and the compute floor.

    The floor is the workload's FLOPs at the burst matmul rate (the issue's measure), and
    also at the rate the GPU holds for seconds: a multi-second run at the power limit can
    not reach the burst rate, so the held rate is the floor such a run can approach.
    """
    from .settings import THROUGHPUT_MODES

    arch = arch_of(s, s.model_8b)
    params = parameter_count(arch)
    prompts = random_prompts(s.num_prompts, s.input_len, arch.vocab_size, s.seed)
    rows = []
    for backend, mode in itertools.product(s.attention_backends, s.throughput_modes):
        async_on, graphs_on = THROUGHPUT_MODES[mode]
        row: dict[str, Any] = {
            "engine": "fastdeploy",
            "async_scheduling": async_on,
            "cuda_graphs": graphs_on,
            "attention_backend": backend,
            "num_prompts": len(prompts),
        }
        try:
            row.update(engine_throughput(s, prompts, async_on, graphs_on, backend))
        except Exception:
            row["error"] = error_text()
        rows.append(row)
    hf_prompts = prompts[: s.hf_num_prompts]
    hf_row: dict[str, Any] = {"engine": "transformers generate", "num_prompts": len(hf_prompts)}
    try:
        hf_row.update(hf_throughput(s, hf_prompts))
    except Exception:
        hf_row["error"] = error_text()
    rows.append(hf_row)
    for row in rows:
        if "elapsed_s" not in row:
            continue
        flops = row["num_prompts"] * (s.input_len + s.output_len) * 2 * params
        if matmul_flop_per_s:
            row["compute_floor_s"] = flops / matmul_flop_per_s
            row["fraction_of_compute_floor"] = row["compute_floor_s"] / row["elapsed_s"]
        if sustained_flop_per_s:
            row["sustained_floor_s"] = flops / sustained_flop_per_s
            row["fraction_of_sustained_floor"] = row["sustained_floor_s"] / row["elapsed_s"]
    return {"parameters": params, "input_len": s.input_len, "output_len": s.output_len,
            "matmul_flop_per_s": matmul_flop_per_s, "sustained_matmul_flop_per_s": sustained_flop_per_s,
            "matmul_n": s.matmul_n, "rows": rows}  # fmt: skip


# ---- 5. overlap ----------------------------------------------------------------------------------


def analyze_trace(trace: list[tuple[str, int, float]], excerpt_steps: int = 3) -> dict[str, Any]:
    """Check that save(N-1) lies between execute_start(N) and postprocess_end(N) for consecutive steps."""
    by_step: dict[Any, dict[str, float]] = {}
    for stage, step, t in trace:
        by_step.setdefault(step, {}).setdefault(stage, t)
    order = [
        sid
        for _, sid in sorted((d["execute_start"], sid) for sid, d in by_step.items() if "execute_start" in d)
    ]
    checks = []
    for prev, cur in zip(order, order[1:]):
        p, c = by_step[prev], by_step[cur]
        if "save_start" not in p or "postprocess_end" not in c:
            continue
        save_end = p.get("save_end", p["save_start"])
        checks.append((prev, cur, c["execute_start"] <= p["save_start"] and save_end <= c["postprocess_end"]))
    middle = max(0, len(order) // 2 - 1)
    shown = set(order[middle : middle + excerpt_steps])
    events = sorted((t, step, stage) for stage, step, t in trace if step in shown)
    t0 = events[0][0] if events else 0.0
    excerpt = [f"{(t - t0) * 1000:9.3f} ms  step {step!s:>5}  {stage}" for t, step, stage in events]
    overlapped = sum(ok for _, _, ok in checks)
    return {"status": "ok", "trace_events": len(trace), "step_pairs_checked": len(checks),
            "step_pairs_overlapped": overlapped, "all_overlapped": bool(checks) and overlapped == len(checks),
            "excerpt": excerpt}  # fmt: skip


def overlap(s: Settings) -> dict[str, Any]:
    """Run a few decode steps with ``FD_STEP_TRACE=1`` and async scheduling; analyse the runner's trace."""
    arch = arch_of(s, s.model_1b)
    prompts = random_prompts(4, 64 if not s.smoke else 8, arch.vocab_size, s.seed)

    def run(llm: Any) -> dict[str, Any]:
        llm.generate(prompts, greedy(16))
        runner = find_runner(llm)
        trace = getattr(runner, "trace", None) if runner is not None else None
        if trace is None:
            where = "no in-process runner found" if runner is None else "ModelRunner has no 'trace' attribute"
            return {"status": "skipped", "note": f"{where} (FD_STEP_TRACE not available in this build)"}
        return analyze_trace(list(trace))

    previous = os.environ.get("FD_STEP_TRACE")
    os.environ["FD_STEP_TRACE"] = "1"
    try:
        return with_engine(s, s.model_1b, run, async_scheduling=True, max_num_seqs=8, max_model_len=256,
                           num_gpu_blocks_override=8 * 256 // 16 + 8)  # fmt: skip
    finally:
        if previous is None:
            os.environ.pop("FD_STEP_TRACE", None)
        else:
            os.environ["FD_STEP_TRACE"] = previous
