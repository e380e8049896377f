"""Fused-MoE kernel benchmark (:mod:`fastdeploy.ops.triton_fused_moe`) on Qwen3-30B-A3B's expert shapes.

One MoE layer: 128 experts, top-8, hidden 2048, moe_intermediate 768, bf16 and FP8 (128 x 128
block-scaled weights, 1 x 128 dynamic activation scales). For each token count it reports the
time per call of the whole ``fused_experts`` (routing sort, both grouped GEMMs, SiLU-and-multiply,
activation quantization, the top-k sum), eager and replayed from a CUDA graph (what decode
steps run), and:

* small batches: the touched experts' weight bytes / time, also as a fraction of the measured
  copy bandwidth (read + written, as ``measure.copy_bandwidth`` counts it);
* large batches: TFLOP/s (``2 * tokens * top_k * 3 * I * H`` per call);
* the error against the torch path (``FusedMoE.compute_experts_torch``, which for FP8 computes
  the same quantized math), and the bf16 torch path's eager time for comparison.

Routing is uniform at random (each token's k experts distinct). Weights rotate over several
layers' worth of sets at small batches so that the touched experts are read from HBM, not L2.

    python -m benchmarks.gpubench.moe_bench --out /tmp/moe                  # H100 / H200
    python -m benchmarks.gpubench.moe_bench --out /tmp/moe --sweep          # + a config sweep per size
    TRITON_INTERPRET=1 python -m benchmarks.gpubench.moe_bench --smoke --device cpu --out /tmp/s

``--sweep`` times a short list of candidate configurations per (dtype, tokens) and reports the
best next to the table's; its winners are what ``BF16_CONFIGS`` / ``FP8_CONFIGS`` should hold.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastdeploy.model_executor.layers.fused_moe import FusedMoE, select_experts
from fastdeploy.model_executor.layers.quantization import Fp8Config
from fastdeploy.ops import triton_fused_moe as moe

from .measure import copy_bandwidth, device_description, error_text, free_memory, time_per_call


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer's expert shapes."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int


QWEN3_30B_A3B = MoeShape(128, 8, 2048, 768)
SMOKE_SHAPE = MoeShape(8, 2, 128, 128)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 8192, 16384)
SMOKE_TOKENS = (1, 5)
ROTATE_BYTES = 256 << 20
"""Weight bytes touched per pass over the rotated sets at small batches (H100/H200 L2: 50 MiB)."""
MAX_SETS = 4


def _candidates(tokens: int, fp8: bool) -> list[moe.MoEKernelConfig]:
    """The sweep's configurations for ``tokens`` (latency shapes for decode, throughput for prefill)."""
    cfg = moe.MoEKernelConfig
    if tokens <= 128:
        ks = (128,) if fp8 else (64, 128, 256)
        return [cfg(16, n, k, 1, 4, s) for n in (32, 64, 128) for k in ks for s in (3, 4, 5)]
    ks = (128,) if fp8 else (64, 128)
    return [
        cfg(m, n, k, g, w, s)
        for m, n in ((32, 128), (64, 128), (64, 256), (128, 128), (128, 256))
        for k in ks
        for g, w, s in ((16, 4, 3), (16, 4, 4), (16, 8, 4), (1, 8, 3))
    ]


@dataclass
class Layer:
    """One set of expert weights as the kernel takes them (and the FusedMoE holding them)."""

    module: FusedMoE
    weight_bytes_per_expert: int


def make_layer(shape: MoeShape, fp8: bool, device: torch.device, seed: int) -> Layer:
    """Random experts (std 1/sqrt(fan_in)) in a FusedMoE built without allocating its empty weights."""
    with torch.device("meta"):
        layer = FusedMoE(
            shape.experts, shape.top_k, shape.hidden, shape.intermediate, renormalize=True,
            quant_config=Fp8Config() if fp8 else None,
        )  # fmt: skip
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, device=device, dtype=torch.bfloat16, generator=g) * i**-0.5
    layer.gate_up_proj = nn.Parameter(w13, requires_grad=False)
    layer.down_proj = nn.Parameter(w2, requires_grad=False)
    if fp8:
        layer.process_weights_after_loading()  # 128 x 128 block quantization, expert by expert
    per_expert = sum(
        t[0].numel() * t.element_size() for t in layer.parameters() if t.dim() == 3
    )  # weights and their scales
    return Layer(layer, per_expert)


def _routing(shape: MoeShape, tokens: int, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, shape.experts, device=device, generator=g)
    weights, ids = select_experts(logits.to(torch.bfloat16), shape.top_k, renormalize=True)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16, generator=g)
    return x, weights, ids


def _fused(layer: Layer, x, weights, ids, config: moe.MoEKernelConfig | None) -> torch.Tensor:
    m = layer.module
    s13, s2 = m.expert_scales()
    return moe.fused_experts(x, m.gate_up_proj, m.down_proj, weights, ids, s13, s2, config=config)


def _graph_time(calls: list, device: torch.device, iters: int) -> float:
    """Seconds per replay of one CUDA graph per call (rotated), after an eager warm-up."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graphs = []
    for call in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graphs.append(graph)
    return time_per_call(lambda i: graphs[i % len(graphs)].replay(), device, iters)


def bench_row(
    shape: MoeShape, layers: list[Layer], fp8: bool, tokens: int, device: torch.device,
    config: moe.MoEKernelConfig | None = None, torch_baseline: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Time ``fused_experts`` on ``tokens`` tokens, rotating over ``layers``; rates and error."""
    inputs = [_routing(shape, tokens, device, seed=100 + j) for j in range(len(layers))]
    calls = [
        (lambda layer=layer, inp=inp: _fused(layer, *inp, config))
        for layer, inp in zip(layers, inputs, strict=True)
    ]
    chosen = config or moe.default_config(tokens, fp8)
    iters = 20 if tokens <= 1024 else 5
    repeats = 5
    if device.type != "cuda":  # the interpreter: a script check, one timed call
        iters = repeats = 1
    row: dict[str, Any] = {
        "dtype": "fp8" if fp8 else "bf16", "tokens": tokens, "config": asdict(chosen),
    }  # fmt: skip
    row["eager_seconds"] = time_per_call(lambda i: calls[i % len(calls)](), device, iters, 1, repeats)
    seconds = row["eager_seconds"]
    if device.type == "cuda":
        row["graph_seconds"] = _graph_time(calls, device, iters)
        seconds = row["graph_seconds"]
    touched = sum(torch.unique(ids).numel() for _, _, ids in inputs) / len(inputs)
    row["touched_experts"] = touched
    row["weight_bytes"] = touched * layers[0].weight_bytes_per_expert
    row["weight_bytes_per_s"] = row["weight_bytes"] / seconds
    flops = 2 * tokens * shape.top_k * 3 * shape.intermediate * shape.hidden
    row["tflop_per_s"] = flops / seconds / 1e12
    out = calls[0]().double()
    ref = layers[0].module.compute_experts_torch(*inputs[0]).double()
    row["rel_err_vs_torch"] = ((out - ref).norm() / ref.norm()).item()
    if torch_baseline and not fp8:
        module, inp = layers[0].module, inputs[0]
        row["torch_eager_seconds"] = time_per_call(
            lambda i: module.compute_experts_torch(*inp), device, 3, 1, repeats
        )
    return row


def sweep(
    shape: MoeShape, layers: list[Layer], fp8: bool, tokens: int, device: torch.device
) -> dict[str, Any]:
    """The fastest candidate configuration (CUDA-graph time) for one size."""
    best: dict[str, Any] | None = None
    tried = 0
    for config in _candidates(tokens, fp8):
        try:
            row = bench_row(shape, layers, fp8, tokens, device, config, torch_baseline=False)
        except Exception:  # a configuration the compiler refuses (shared memory): skip it
            continue
        tried += 1
        key = row.get("graph_seconds", row["eager_seconds"])
        if best is None or key < best.get("graph_seconds", best["eager_seconds"]):
            best = row
    return {"tried": tried, "best": best}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (dtype, tokens) row of the settings (and the sweep's winners with ``--sweep``)."""
    device = torch.device(args.device)
    shape = SMOKE_SHAPE if args.smoke else QWEN3_30B_A3B
    tokens_list = (
        [int(t) for t in args.tokens.split(",")] if args.tokens else (SMOKE_TOKENS if args.smoke else TOKENS)
    )
    results: dict[str, Any] = {"shape": asdict(shape), "device": device_description(device), "rows": []}
    copy_bw = copy_bandwidth(device, 1 << 30)["bytes_per_s"] if device.type == "cuda" else None
    results["copy_bytes_per_s"] = copy_bw
    for dtype in args.dtypes.split(","):
        fp8 = dtype == "fp8"
        layer_bytes = 3 * shape.experts * shape.hidden * shape.intermediate * (1 if fp8 else 2)
        sets = (
            1 if device.type != "cuda" else max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES * 8 / layer_bytes)))
        )
        layers = [make_layer(shape, fp8, device, seed=j) for j in range(sets)]
        for tokens in tokens_list:
            try:
                row = bench_row(shape, layers if tokens <= 64 else layers[:1], fp8, tokens, device)
                if copy_bw:
                    row["fraction_of_copy"] = row["weight_bytes_per_s"] / copy_bw
                if args.sweep:
                    row["sweep"] = sweep(shape, layers if tokens <= 64 else layers[:1], fp8, tokens, device)
            except Exception:
                row = {"dtype": dtype, "tokens": tokens, "error": error_text()}
            print(json.dumps(row, default=str), flush=True)
            results["rows"].append(row)
        del layers
        free_memory(device)
    return results


def render(results: dict[str, Any]) -> str:
    """Markdown table of the rows (for docs/benchmarks.md)."""
    s = results["shape"]
    lines = [
        f"Fused MoE, {s['experts']} experts top-{s['top_k']}, H={s['hidden']}, I={s['intermediate']} "
        f"({results['device'].get('gpu', results['device'])}; copy bandwidth "
        f"{(results['copy_bytes_per_s'] or 0) / 1e12:.2f} TB/s)",
        "",
        "| dtype | tokens | graph µs | eager µs | weight GB/s | % of copy | TFLOP/s | err vs torch | torch µs | config | sweep best |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['dtype']} | {r['tokens']} | error: {r['error'].splitlines()[-1][:80]} |")
            continue
        c = r["config"]
        best = (r.get("sweep") or {}).get("best")
        best_text = ""
        if best:
            b = best["config"]
            best_text = (
                f"{best.get('graph_seconds', best['eager_seconds']) * 1e6:.1f} µs: M{b['block_m']} N{b['block_n']} "
                f"K{b['block_k']} G{b['group_m']} w{b['num_warps']} s{b['num_stages']}"
            )
        fmt = lambda v, scale=1e6: "" if v is None else f"{v * scale:.1f}"  # noqa: E731
        lines.append(
            f"| {r['dtype']} | {r['tokens']} | {fmt(r.get('graph_seconds'))} | {fmt(r['eager_seconds'])} "
            f"| {r['weight_bytes_per_s'] / 1e9:.0f} | {fmt(r.get('fraction_of_copy'), 100)} "
            f"| {r['tflop_per_s']:.1f} | {r['rel_err_vs_torch']:.1e} | {fmt(r.get('torch_eager_seconds'))} "
            f"| M{c['block_m']} N{c['block_n']} K{c['block_k']} G{c['group_m']} w{c['num_warps']} "
            f"s{c['num_stages']} | {best_text} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for results.json and results.md")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="bf16,fp8", help="comma-separated: bf16, fp8")
    parser.add_argument("--tokens", default="", help="comma-separated token counts (default: 1 to 16384)")
    parser.add_argument("--sweep", action="store_true", help="also time candidate configurations per size")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes (script check, CPU + TRITON_INTERPRET=1)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available (use --device cpu --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 1
    results = run(args)
    results["command"] = "python -m benchmarks.gpubench.moe_bench " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(render(results))
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
