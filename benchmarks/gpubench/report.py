"""Markdown tables of a ``gpu_benchmark.py`` run, ready to paste into docs/benchmarks.md."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return lines + [""]


def _row_error(row: dict[str, Any]) -> str | None:
    if "error" in row:
        return "error: " + row["error"].strip().splitlines()[-1][:160]
    if "skipped" in row:
        return "skipped: " + row["skipped"]
    return None


def _correctness(r: dict[str, Any]) -> list[str]:
    out = [f"Model: {r['model']}; greedy, `ignore_eos`, float32 on both engines.", ""]
    if "greedy_error" in r:
        out += [f"GPU engine: {_row_error({'error': r['greedy_error']})}", ""]
    else:
        rows = [
            [g["prompt"], g["prompt_tokens"], g["tokens"], g["equal"], g["first_mismatch"]]
            for g in r["greedy_tokens"]
        ]
        out += _table(["prompt", "prompt tokens", "generated", "CPU == GPU", "first mismatch"], rows)
    lg = r.get("logits", {})
    if lg.get("status") == "ok":
        out += _table(
            [
                "prefill tokens",
                "max rel. err (bf16 vs fp32)",
                "mean rel. err",
                "argmax agreement",
                "within 2e-2",
            ],
            [
                [
                    lg["prompt_tokens"],
                    f"{lg['rel_err_max']:.2e}",
                    f"{lg['rel_err_mean']:.2e}",
                    f"{lg['argmax_agreement']:.3f}",
                    lg["within_tolerance"],
                ]
            ],
        )
        out += [
            "Relative error = max |logits_bf16 − logits_fp32| / max |logits_fp32| over the prompt's positions.",
            "",
        ]
    elif lg:
        out += [f"bf16 logits check: {_row_error(lg)}", ""]
    return out


def _ops(r: dict[str, Any]) -> list[str]:
    rows = []
    for row in r["rows"]:
        note = _row_error(row)
        if note:
            rows.append([row["op"], row["kv_cache_dtype"], row["shape"], note, "", "", ""])
            continue
        extra = f"splits {row['num_splits']}" if "num_splits" in row else row.get("implementation", "")
        rows.append([row["op"], row["kv_cache_dtype"], row["shape"], f"{row['seconds_per_call'] * 1e6:,.1f}",
                     f"{row['bytes_per_s'] / 1e12:.2f}", f"{row['fraction_of_copy']:.0%}", extra])  # fmt: skip
    out = [f"Copy bandwidth (read + written): **{r['copy_bytes_per_s'] / 1e12:.2f} TB/s**.", ""]
    out += _table(["op", "KV dtype", "shape", "µs / call", "TB/s", "of copy bw", "notes"], rows)
    out += ["reshape_and_cache_flash bytes: keys + values read, cache rows (and fp8 scales) written, slot mapping read; "
            "decode attention bytes: the KV cache rows read (fp8: plus scales).", ""]  # fmt: skip
    if r.get("gemv_rows"):
        out += _gemv(r["gemv_rows"])
    return out


def _gemv(gemv_rows: list[dict[str, Any]]) -> list[str]:
    rows = []
    for row in gemv_rows:
        name = [row["model"], row["layer"], row["shape"]]
        if "error" in row:
            rows.append(name + [_row_error(row), "", "", "", "", "", ""])
            continue
        base = [f"{row['baseline_seconds'] * 1e6:,.1f}", f"{row['baseline_fraction_of_copy']:.0%}"]
        if "triton_seconds" not in row:
            rows.append(name + base + [_row_error(row) or "", "", "", "", ""])
            continue
        rows.append(name + base + [f"{row['triton_seconds'] * 1e6:,.1f}", f"{row['triton_fraction_of_copy']:.0%}",
                    f"{row['speedup']:.2f}x", f"{row['rel_err_vs_baseline']:.1e}", row.get("config") or ""])  # fmt: skip
    out = ["#### Small-M linear at M = 1 (batch-1 decode): cuBLAS vs the Triton small-M kernel", ""]
    out += _table(["model", "layer", "shape", "baseline µs", "of copy bw", "small_m_linear µs", "of copy bw",
                   "speedup", "rel. err", "config"], rows)  # fmt: skip
    out += ["bf16, no bias. Baseline: `F.linear` (cuBLAS); for `down + silu_and_mul`, `silu_and_mul` then `F.linear` "
            "(two kernels) against `small_m_linear(gate_up, w, silu_mul=True)` (one). Fraction of copy bw = weight "
            "bytes / time / copy bandwidth. Times are CUDA-graph replays of 32+ calls over weight sets larger than L2.",
            ""]  # fmt: skip
    return out


def _itl(r: dict[str, Any]) -> list[str]:
    rows = []
    for row in r["rows"]:
        mode = (
            "CUDA graphs" if row["cuda_graphs"] else "enforce_eager"
        ) + f", {row.get('attention_backend', 'auto')}"
        head = [
            row["model"],
            mode,
            row.get("batch", 1),
            f"{row['weight_bytes'] / 1e9:.2f}",
            f"{row['floor_ms']:.2f}",
        ]
        note = _row_error(row)
        if note:
            rows.append(head + [note, "", "", "", ""])
            continue
        ratio = (
            [f"{row['ratio_to_floor']:.2f}x", f"{row['target_ratio']}x", row["meets_target"]]
            if "ratio_to_floor" in row
            else ["—", "—", "—"]
        )
        rows.append(head + [f"{row['itl_ms_mean']:.2f}", f"{row['itl_ms_p50']:.2f}", *ratio])
    out = [
        f"bf16 dummy weights; floor = weight bytes / copy bandwidth ({r['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        "read + written); the target applies to batch 1. Larger batches (graphs only) show where the "
        "attention backends cross over.",
        "",
    ]
    header = [
        "model",
        "mode",
        "batch",
        "weights (GB)",
        "floor (ms)",
        "ITL mean (ms)",
        "ITL p50 (ms)",
        "ITL / floor",
        "target",
        "met",
    ]
    return out + _table(header, rows)


def _gpu_state(gpu: dict[str, Any] | None) -> str:
    """``1512 MHz, 693 W of 700, capped 100%`` from a GpuMonitor summary (— without samples)."""
    if not gpu:
        return "—"
    return (
        f"{gpu['sm_clock_mhz_mean']:.0f} MHz, {gpu['power_w_mean']:.0f} W of {gpu['power_limit_w']:.0f}, "
        f"capped {gpu['power_capped_share']:.0%}"
    )


def _throughput(r: dict[str, Any]) -> list[str]:
    rows = []
    for row in r["rows"]:
        if row["engine"] == "fastdeploy":
            name = (
                f"fastdeploy (async {'on' if row['async_scheduling'] else 'off'}, "
                f"graphs {'on' if row['cuda_graphs'] else 'off'}, {row.get('attention_backend', 'auto')})"
            )
        else:
            name = f"transformers generate (static batch {row.get('batch_size', '?')})"
        note = _row_error(row)
        if note:
            rows.append([name, row["num_prompts"], note, "", "", "", "", ""])
            continue
        fractions = [
            f"{row[key]:.1%}" if key in row else "—"
            for key in ("fraction_of_compute_floor", "fraction_of_sustained_floor")
        ]
        rows.append([name, row["num_prompts"], f"{row['elapsed_s']:.1f}", f"{row['output_tok_per_s']:,.0f}",
                     f"{row.get('total_tok_per_s', 0):,.0f}" if "total_tok_per_s" in row else "—",
                     *fractions, _gpu_state(row.get("gpu"))])  # fmt: skip
    rate, held = r.get("matmul_flop_per_s"), r.get("sustained_matmul_flop_per_s")
    rates = []
    if rate:
        rates.append(f"{rate / 1e12:.0f} TFLOP/s in a burst")
    if held:
        rates.append(f"{held / 1e12:.0f} TFLOP/s held for seconds")
    out = [
        f"Llama-3.1-8B shape ({r['parameters'] / 1e9:.2f} B parameters), bf16 dummy weights, random prompts of "
        f"{r['input_len']} tokens, {r['output_len']} output tokens each (greedy, ignore_eos). "
        f"Compute floor = prompts × {r['input_len'] + r['output_len']} tokens × 2 × parameters / bf16 matmul rate"
        + (f" ({', '.join(rates)}; {r['matmul_n']}³ torch.mm)." if rates else ".")
        + " GPU: mean SM clock and power during the run, and the share of samples held at the power cap.",
        "",
    ]
    header = ["engine", "prompts", "elapsed (s)", "output tok/s", "total tok/s", "burst floor / elapsed",
              "held floor / elapsed", "GPU"]  # fmt: skip
    return out + _table(header, rows)


def _overlap(r: dict[str, Any]) -> list[str]:
    if r.get("status") == "skipped":
        return [f"Skipped: {r['note']}", ""]
    out = [f"{r['step_pairs_overlapped']} of {r['step_pairs_checked']} consecutive step pairs have save(N−1) between "
           "execute_start(N) and postprocess_end(N). Excerpt (three steps):", "", "```"]  # fmt: skip
    return out + r["excerpt"] + ["```", ""]


RENDERERS = {
    "correctness": _correctness,
    "ops": _ops,
    "itl": _itl,
    "throughput": _throughput,
    "overlap": _overlap,
}
TITLES = {
    "correctness": "Correctness: GPU vs CPU greedy tokens, bf16 vs fp32 logits",
    "ops": "Kernel bandwidth",
    "itl": "Decode inter-token latency at batch 1",
    "throughput": "Offline throughput",
    "overlap": "Overlapped execute_model (FD_STEP_TRACE)",
}


def render_markdown(results: dict[str, Any]) -> str:
    """All sections of ``results`` as markdown, headed by the machine, versions, date and command."""
    meta = results["meta"]
    dev = meta["device_info"]
    lines = [
        f"## GPU benchmarks: {dev.get('gpu')} ({meta['date']})",
        "",
        f"torch {dev.get('torch')}, CUDA {dev.get('cuda')}, Triton {dev.get('triton')}, "
        f"fastdeploy_ops CUDA extension {'loaded' if dev.get('fastdeploy_ops_cuda') else 'not loaded (torch fallbacks)'}.",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
    ]
    for name, section in results["sections"].items():
        lines += [f"### {TITLES.get(name, name)}", ""]
        if section["status"] != "ok":
            lines += [
                f"{section['status']}: `{section.get('error', section.get('note', '')).strip().splitlines()[-1]}`",
                "",
            ]
            continue
        lines += RENDERERS[name](section["result"])
        lines += [f"_(section time: {section['seconds']:.0f} s)_", ""]
    return "\n".join(lines)
