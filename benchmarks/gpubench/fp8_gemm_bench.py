"""FP8 linear speed on one GPU, eager and replayed from CUDA graphs (what decode steps run), for
the dense shapes of Llama-3.1-8B and Qwen3-30B-A3B at M = 1 .. 8192 rows.

    python -m benchmarks.gpubench.fp8_gemm_bench --out /tmp/fp8_gemm                 # H100 / H200
    python -m benchmarks.gpubench.fp8_gemm_bench --out /tmp/fp8_sweep --sweep gemm    # + Triton block GEMM configs
    python -m benchmarks.gpubench.fp8_gemm_bench --out /tmp/fp8_sweep --sweep gemm-channel  # + per-channel ones
    python -m benchmarks.gpubench.fp8_gemm_bench --out /tmp/fp8_sweep --sweep gemv    # + w8a16 GEMV configs
    python -m benchmarks.gpubench.fp8_gemm_bench --smoke --out /tmp/s                 # a few shapes, checks the script

Variants (``gemm``: operands quantized beforehand; ``linear``: the activation quantized in the
call, as a model runs it):

* ``bf16 mm`` (``torch.mm``) and, at M <= 4, ``bf16 small-M`` (the Triton GEMV bf16 decode runs in
  graphs): the baseline;
* ``fp8 gemv block`` / ``fp8 gemv channel``: the w8a16 GEMV (:mod:`fastdeploy.ops.triton_fp8_gemv`)
  on 128 x 128 block-scaled / per-channel weights, up to its 64 rows;
* ``triton block``, ``triton channel``, ``scaled_mm rowwise``, ``scaled_mm blockwise`` (where this
  torch build runs it): the w8a8 GEMMs, ``(gemm)`` and ``(linear)``;
* ``engine block`` / ``engine channel``: :func:`fastdeploy.ops.fp8_linear.fp8_linear` as the model
  calls it, with the path it chose for that M (the ``path`` columns).

Each cell is ``graph µs / eager µs`` per call: the graph holds one call per rotated weight set
(several times the L2 cache), replayed; eager is the same calls launched from Python (launch-bound
at small M). Writes ``fp8_gemm.json`` and ``fp8_gemm.md`` into ``--out``.

``--sweep gemm`` times candidate :class:`~fastdeploy.ops.triton_fp8_gemm.Fp8GemmConfig` s of the
Triton block GEMM per (shape, M) under graphs and reports the best beside the table's default
(its winners are what ``triton_fp8_gemm.CONFIGS`` should hold), ``--sweep gemm-channel`` those of the
per-channel GEMM (``CHANNEL_CONFIGS``); ``--sweep gemv`` does the same for
the GEMV's configurations (what ``triton_fp8_gemv`` should autotune over).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fastdeploy.ops import fp8_linear as fl
from fastdeploy.ops import fp8_quant as fq

from .measure import device_description, error_text, time_per_call

SHAPES: dict[str, tuple[int, int]] = {
    "llama8b.qkv": (6144, 4096),
    "llama8b.o": (4096, 4096),
    "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336),
    "qwen3_30b_a3b.qkv": (5120, 2048),
    "qwen3_30b_a3b.o": (2048, 4096),
}
"""name → (N, K) of the dense linears (Qwen3-30B-A3B's MLPs are experts: the fused-MoE benchmark's)."""
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SWEEP_ROWS = {
    "gemm": (16, 64, 256, 1024, 4096),
    "gemm-channel": (32, 64, 128, 256, 512),
    "gemv": (1, 2, 4, 8, 16),
}
BLOCK = (128, 128)
ROTATE_BYTES = 256 << 20
"""Bytes of bf16 weights each variant cycles through (several times the L2 cache of an H100 / H200)."""
MIN_GRAPH_CALLS = 16
"""Calls per captured graph at least (the rotation repeated), so that a replay outlasts its launch."""


def _weights(n: int, k: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Rotated weight sets: bf16, 128 x 128 block-quantized, per-channel-quantized."""
    sets = max(1, min(16, ROTATE_BYTES // (2 * n * k)))
    out = []
    for _ in range(sets):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        wb, wbs = fq.quantize_weight_block(w, BLOCK)
        wc, wcs = fq.quantize_weight_per_channel(w)
        out.append({"w": w, "wb": wb, "wbs": wbs, "wc": wc, "wcs": wcs})
    return out


def _variants(
    x: torch.Tensor, ws: dict[str, torch.Tensor], backend: fl.Fp8LinearBackend
) -> dict[str, Callable[[], torch.Tensor]]:
    """name → a call on these operands (x ``[M, K]`` bf16, one weight set)."""
    from fastdeploy.ops import triton_fp8_gemv as gemv
    from fastdeploy.ops import triton_fp8_quant as tq
    from fastdeploy.ops import triton_gemv
    from fastdeploy.ops.triton_fp8_gemm import fp8_block_gemm, fp8_block_linear, fp8_channel_gemm

    m = x.shape[0]
    w, wb, wbs, wc, wcs = ws["w"], ws["wb"], ws["wbs"], ws["wc"], ws["wcs"]
    xg, xgs = tq.quantize_activation_per_token_group(x, BLOCK[1])
    xt, xts = tq.quantize_activation_per_token(x)
    wcs_row = wcs.view(1, -1)
    out: dict[str, Callable[[], torch.Tensor]] = {"bf16 mm": lambda: torch.mm(x, w.t())}
    if m <= triton_gemv.SMALL_M_MAX:
        out["bf16 small-M"] = lambda: triton_gemv.small_m_linear(x, w)
    if m <= gemv.MAX_M:
        out["fp8 gemv block"] = lambda: gemv.fp8_small_m_linear(x, wb, wbs, BLOCK)
        out["fp8 gemv channel"] = lambda: gemv.fp8_small_m_linear(x, wc, wcs, None)
    out["triton block (gemm)"] = lambda: fp8_block_gemm(xg, xgs, wb, wbs, BLOCK, x.dtype)
    out["triton block (linear)"] = lambda: fp8_block_linear(x, wb, wbs, BLOCK)
    out["triton channel (gemm)"] = lambda: fp8_channel_gemm(xt, xts, wc, wcs, x.dtype)
    out["triton channel (linear)"] = lambda: fl.fp8_linear_kernels(
        x, wc, wcs, None, None, fl.Fp8LinearBackend(0, False, channel_triton_max_m=1 << 30)
    )
    out["scaled_mm rowwise (gemm)"] = lambda: torch._scaled_mm(
        xt, wc.t(), scale_a=xts, scale_b=wcs_row, out_dtype=x.dtype
    )
    out["scaled_mm rowwise (linear)"] = lambda: fl.fp8_linear_kernels(
        x, wc, wcs, None, None, fl.Fp8LinearBackend(0, False)
    )
    if backend.block_scaled_mm:
        xb, xbs = tq.quantize_activation_per_token_group(x, BLOCK[1], column_major_scale=True)
        out["scaled_mm blockwise (gemm)"] = lambda: torch._scaled_mm(
            xb, wb.t(), scale_a=xbs, scale_b=wbs.t(), out_dtype=x.dtype
        )
        out["scaled_mm blockwise (linear)"] = lambda: fl.fp8_linear_kernels(
            x, wb, wbs, BLOCK, None, fl.Fp8LinearBackend(0, True)
        )
    out["engine block"] = lambda: fl.fp8_linear(x, wb, wbs, BLOCK, None, backend)
    out["engine channel"] = lambda: fl.fp8_linear(x, wc, wcs, None, None, backend)
    return out


def graph_seconds(calls: list[Callable[[], Any]], device: torch.device, iters: int) -> float:
    """Seconds per call replaying one CUDA graph that holds ``calls`` (repeated to at least
    :data:`MIN_GRAPH_CALLS`), after an eager warm-up on a side stream."""
    calls = calls * max(1, -(-MIN_GRAPH_CALLS // len(calls)))
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return time_per_call(lambda _: graph.replay(), device, max(2, iters // 5), repeats=3) / len(calls)


def _engine_path(x: torch.Tensor, ws: dict[str, torch.Tensor], block, backend: fl.Fp8LinearBackend) -> str:
    wq = ws["wb"] if block else ws["wc"]
    ready = x.shape[0] <= backend.small_m_max and fl._small_m_ready(x, wq, block, None)
    return fl.select_path(x.shape[0], wq.shape[0], wq.shape[1], block, backend, ready).value


def bench_shape(
    n: int, k: int, rows: tuple[int, ...], device: torch.device, iters: int, backend: fl.Fp8LinearBackend
) -> list[dict[str, Any]]:
    """Eager and graph timings of every variant at every M for one (N, K)."""
    from fastdeploy.ops import triton_fp8_gemv as gemv

    weights = _weights(n, k, device)
    sets = len(weights)
    results = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        calls = [_variants(x, ws, backend) for ws in weights]
        row: dict[str, Any] = {"M": m, "N": n, "K": k}
        m_iters = iters if m < 1024 else max(5, iters // 5)  # long calls: fewer suffice
        for name in calls[0]:
            try:
                eager = time_per_call(
                    lambda i, name=name, calls=calls: calls[i % sets][name](), device, m_iters
                )
                graph = graph_seconds([c[name] for c in calls], device, m_iters)
                row[name] = {"eager_us": eager * 1e6, "graph_us": graph * 1e6,
                             "tflops": 2 * m * n * k / graph / 1e12}  # fmt: skip
                if name == "fp8 gemv block":
                    calls[0][name]()
                    row["gemv_config"] = gemv.last_tuned_config()
            except Exception:  # noqa: BLE001 - recorded, the run goes on
                row[name] = {"error": error_text()}
        row["engine block path"] = _engine_path(x, weights[0], BLOCK, backend)
        row["engine channel path"] = _engine_path(x, weights[0], None, backend)
        bf16 = row["bf16 mm"].get("graph_us")
        if m <= 4 and "graph_us" in row.get("bf16 small-M", {}):
            bf16 = min(bf16, row["bf16 small-M"]["graph_us"])
        for key in ("engine block", "engine channel"):
            if bf16 and "graph_us" in row[key]:
                row[f"{key} vs bf16"] = bf16 / row[key]["graph_us"]
        print(json.dumps({k2: v for k2, v in row.items() if not isinstance(v, dict)}), flush=True)
        results.append(row)
    return results


def _gemm_candidates(m: int, per_channel: bool = False) -> list[Any]:
    """Tile configurations to time at ``m`` rows (per channel: also 256-column K steps, which the
    block-scaled GEMM's one-scale-per-step cannot take)."""
    from fastdeploy.ops.triton_fp8_gemm import Fp8GemmConfig as C

    block_ms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * m)]
    out = []
    for bm in block_ms:
        for bn in (64, 128, 256):
            for bk in (128, 256) if per_channel else (128,):
                for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4), (4, 5)):
                    if bm * bn >= 128 * 256 and warps == 4 or bk == 256 and stages == 5:
                        continue
                    out.append(C(bm, bn, bk, 1 if bm <= 32 else 8, warps, stages))
    return out


def _gemv_candidates(m: int) -> list[dict[str, Any]]:
    from fastdeploy.ops import triton_fp8_gemv as gemv

    out = []
    for bn in (8, 16, 32, 64):
        for bk in (128, 256, 512, 1024):
            for stages in (3, 4, 6):
                out.append({"BLOCK_N": bn, "BLOCK_K": bk, "DOT": False, "STAGES": stages, "num_warps": 4})
    # long loads a program at one or two rows (the batch-1 qkv / o GEMVs ran at ~1.4 TB/s in the
    # twenty-fifth session's profile): whole K rows of few outputs, 8 warps for more bytes in flight
    for bn, bk, stages, warps in ((2, 2048, 2, 4), (4, 2048, 2, 4), (4, 2048, 2, 8), (4, 1024, 3, 8),
                                  (8, 1024, 3, 8), (8, 2048, 2, 8), (16, 1024, 3, 8), (16, 2048, 2, 8),
                                  (32, 256, 4, 8), (32, 512, 3, 8)):  # fmt: skip
        out.append({"BLOCK_N": bn, "BLOCK_K": bk, "DOT": False, "STAGES": stages, "num_warps": warps})
    for bn in (16, 32, 64, 128):
        for bk in (64, 128):
            for stages in (3, 4, 6):
                for warps in (4, 8):
                    out.append(
                        {"BLOCK_N": bn, "BLOCK_K": bk, "DOT": True, "STAGES": stages, "num_warps": warps}
                    )
    m_pad = 1 << (m - 1).bit_length()
    return [c for c in out if gemv.config_fits(c, m_pad, *BLOCK)]


def sweep_shape(n: int, k: int, what: str, device: torch.device, iters: int) -> list[dict[str, Any]]:
    """The fastest candidate configuration (graph time) per M for ``what`` (gemm, gemm-channel or gemv)."""
    from fastdeploy.ops import triton_fp8_gemv as gemv
    from fastdeploy.ops import triton_fp8_quant as tq
    from fastdeploy.ops.triton_fp8_gemm import default_config, fp8_block_gemm, fp8_channel_gemm

    weights = _weights(n, k, device)
    results = []
    for m in SWEEP_ROWS[what]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        if what == "gemm":
            xg, xgs = tq.quantize_activation_per_token_group(x, BLOCK[1])

            def make(config, xg=xg, xgs=xgs, x=x):
                return [lambda ws=ws: fp8_block_gemm(xg, xgs, ws["wb"], ws["wbs"], BLOCK, x.dtype, config)
                        for ws in weights]  # fmt: skip

            candidates, default = _gemm_candidates(m), default_config(m)
        elif what == "gemm-channel":
            xt, xts = tq.quantize_activation_per_token(x)

            def make(config, xt=xt, xts=xts, x=x):
                return [lambda ws=ws: fp8_channel_gemm(xt, xts, ws["wc"], ws["wcs"], x.dtype, config)
                        for ws in weights]  # fmt: skip

            candidates, default = _gemm_candidates(m, per_channel=True), default_config(m, per_channel=True)
        else:

            def make(config, x=x):
                def call(ws):
                    out = torch.empty(x.shape[0], n, device=device, dtype=x.dtype)
                    gemv.launch_kernel(x, ws["wb"], ws["wbs"], BLOCK, None, out, config)
                    return out

                return [lambda ws=ws: call(ws) for ws in weights]

            candidates, default = _gemv_candidates(m), None
        timed = []
        for config in candidates:
            try:
                timed.append((graph_seconds(make(config), device, iters) * 1e6, config))
            except Exception:  # noqa: BLE001 - a configuration the compiler refuses (shared memory)
                continue
        default_us = graph_seconds(make(default), device, iters) * 1e6
        timed.sort(key=lambda t: t[0])
        show = lambda c: asdict(c) if what != "gemv" else c  # noqa: E731
        row = {"M": m, "N": n, "K": k, "default_us": default_us, "tried": len(timed),
               "best": [{"us": us, "config": show(c)} for us, c in timed[:3]]}  # fmt: skip
        if what == "gemv":
            row["default_config"] = gemv.last_tuned_config()
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def _cell(v: dict[str, Any] | None, best: bool) -> str:
    if not v:
        return ""
    if "graph_us" not in v:
        return "error"
    text = f"{v['graph_us']:.1f} / {v['eager_us']:.1f}"
    return f"**{text}**" if best else text


def render(results: dict[str, list[dict[str, Any]]]) -> str:
    """One markdown table per shape: graph / eager µs per variant and M, the engine's paths."""
    lines = []
    for shape, rows in results.items():
        names = sorted({k for r in rows for k, v in r.items() if isinstance(v, dict)}, key=_order)
        lines += [f"### {shape} (N={rows[0]['N']}, K={rows[0]['K']}): graph µs / eager µs per call", ""]
        lines.append(
            "| M | "
            + " | ".join(names)
            + " | engine block path | engine channel path | fp8 engine vs bf16 (block, channel) |"
        )
        lines.append("|---" * (len(names) + 4) + "|")
        for row in rows:
            graphs = {n: row[n]["graph_us"] for n in names if "graph_us" in row.get(n, {})}
            fastest = min(graphs, key=graphs.get) if graphs else None
            cells = [_cell(row.get(n), n == fastest) for n in names]
            ratio = ", ".join(
                f"{row[key]:.2f}x" for key in ("engine block vs bf16", "engine channel vs bf16") if key in row
            )
            lines.append(
                f"| {row['M']} | " + " | ".join(cells)
                + f" | {row['engine block path']} | {row['engine channel path']} | {ratio} |"
            )  # fmt: skip
        gemv_configs = {r["M"]: r["gemv_config"] for r in rows if r.get("gemv_config")}
        if gemv_configs:
            lines += [
                "",
                "GEMV autotuned (block weights): "
                + "; ".join(f"M={m}: {c}" for m, c in gemv_configs.items()),
            ]
        lines.append("")
    return "\n".join(lines)


_ORDER = ["bf16 mm", "bf16 small-M", "fp8 gemv block", "fp8 gemv channel", "engine block", "engine channel"]


def _order(name: str) -> tuple[int, str]:
    return (_ORDER.index(name) if name in _ORDER else len(_ORDER), name)


def render_sweep(results: dict[str, list[dict[str, Any]]], what: str) -> str:
    lines = [f"### sweep: {what} (graph µs)", "", "| shape | M | default µs | best µs | best config | tried |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for shape, rows in results.items():
        for r in rows:
            best = r["best"][0] if r["best"] else {"us": float("nan"), "config": None}
            lines.append(
                f"| {shape} | {r['M']} | {r['default_us']:.1f} | {best['us']:.1f} | {best['config']} | {r['tried']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fp8_gemm_results")
    parser.add_argument("--smoke", action="store_true", help="two shapes, three row counts")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--shapes", default="", help="comma-separated names of SHAPES (default: all)")
    parser.add_argument("--rows", default="", help="comma-separated row counts (default: 1 .. 8192)")
    parser.add_argument(
        "--sweep", choices=("gemm", "gemm-channel", "gemv"), help="time candidate configurations instead"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_gemm_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    shapes = dict(SHAPES)
    if args.shapes:
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    elif args.smoke:
        shapes = dict(list(SHAPES.items())[:2])
    rows = (1, 16, 1024) if args.smoke else ROWS
    if args.rows:
        rows = tuple(int(r) for r in args.rows.split(","))
    iters = 5 if args.smoke else args.iters
    backend = fl.Fp8LinearBackend.for_device(device)
    print(f"[fp8_gemm_bench] engine backend: {backend}", flush=True)
    results = {}
    for name, (n, k) in shapes.items():
        print(f"[fp8_gemm_bench] {name} N={n} K={k}", flush=True)
        if args.sweep:
            results[name] = sweep_shape(n, k, args.sweep, device, iters)
        else:
            results[name] = bench_shape(n, k, rows, device, iters, backend)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": device_description(device), "torch": torch.__version__, "backend": asdict(backend),
        "command": "python -m benchmarks.gpubench.fp8_gemm_bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "results": results,
    }  # fmt: skip
    (out / "fp8_gemm.json").write_text(json.dumps(payload, indent=1, default=str))
    table = render_sweep(results, args.sweep) if args.sweep else render(results)
    header = f"Device: {payload['device']}, torch {torch.__version__}, engine backend {asdict(backend)}\n\n"
    (out / "fp8_gemm.md").write_text(header + table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
