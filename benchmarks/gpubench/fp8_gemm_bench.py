"""FP8 GEMM speed on one GPU: the Triton block-scaled w8a8 GEMM against ``torch._scaled_mm`` with
row-wise scales (per-channel weights) and bf16 ``torch.mm``, for the dense shapes of Llama-3.1-8B
and Qwen3-30B-A3B at M = 1 .. 8192 rows.

    python benchmarks/gpubench/fp8_gemm_bench.py --out /tmp/fp8_gemm      # H100 / H200
    python benchmarks/gpubench/fp8_gemm_bench.py --smoke --out /tmp/s      # a few shapes, checks the script

Each variant is timed twice: the GEMM alone (operands quantized beforehand) and the whole linear
as the model runs it (the activation quantized in the call: what ``fp8_linear`` costs). Weights
rotate over enough copies to keep them out of L2. Writes ``fp8_gemm.json`` and ``fp8_gemm.md``
(µs and TFLOP/s per shape and M, the fastest path marked) into ``--out``. Also tries the
block-wise ``torch._scaled_mm`` (1x128 activation / 128x128 weight scales), where this torch
build supports it on the GPU, for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from fastdeploy.ops import fp8_quant as fq  # noqa: E402
from gpubench.measure import device_description, error_text, time_per_call  # noqa: E402

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
BLOCK = (128, 128)
ROTATE_BYTES = 256 << 20
"""Weight bytes each variant cycles through (several times the L2 cache of an H100 / H200)."""


def _variants(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """name → a call on these operands (x ``[M, K]`` bf16, w ``[N, K]`` bf16)."""
    from fastdeploy.ops.triton_fp8_gemm import fp8_block_gemm, fp8_block_linear

    wb, wbs = fq.quantize_weight_block(w, BLOCK)
    wc, wcs = fq.quantize_weight_per_channel(w)
    xg, xgs = fq.quantize_activation_per_token_group(x, BLOCK[1])
    xt, xts = fq.quantize_activation_per_token(x)
    wcs_row = wcs.view(1, -1)
    out = {
        "bf16 mm": lambda: torch.mm(x, w.t()),
        "triton block (gemm)": lambda: fp8_block_gemm(xg, xgs, wb, wbs, BLOCK, x.dtype),
        "triton block (linear)": lambda: fp8_block_linear(x, wb, wbs, BLOCK),
        "scaled_mm rowwise (gemm)": lambda: torch._scaled_mm(
            xt, wc.t(), scale_a=xts, scale_b=wcs_row, out_dtype=x.dtype
        ),
        "scaled_mm rowwise (linear)": lambda: _rowwise_linear(x, wc, wcs_row),
    }
    try:  # block-wise scaled_mm: scale_a outer-dim-major [M, K/128], scale_b [N/128, K/128]
        a_scale = xgs.t().contiguous().t()
        b_scale = wbs.t().contiguous().t()
        torch._scaled_mm(xg, wb.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=x.dtype)
        out["scaled_mm blockwise (gemm)"] = lambda: torch._scaled_mm(
            xg, wb.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=x.dtype
        )
    except Exception:  # noqa: BLE001 - not supported by this build / GPU
        pass
    return out


def _rowwise_linear(x: torch.Tensor, wc: torch.Tensor, wcs_row: torch.Tensor) -> torch.Tensor:
    xq, xs = fq.quantize_activation_per_token(x)
    return torch._scaled_mm(xq, wc.t(), scale_a=xs, scale_b=wcs_row, out_dtype=x.dtype)


def bench_shape(
    n: int, k: int, rows: tuple[int, ...], device: torch.device, iters: int
) -> list[dict[str, Any]]:
    """Timings of every variant at every M for one (N, K)."""
    sets = max(1, min(16, ROTATE_BYTES // (n * k)))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(sets)]
    results = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        calls = [_variants(x, w) for w in weights]
        row: dict[str, Any] = {"M": m, "N": n, "K": k}
        for name in calls[0]:
            try:
                seconds = time_per_call(
                    lambda i, name=name, calls=calls: calls[i % sets][name](), device, iters
                )
                row[name] = {"us": seconds * 1e6, "tflops": 2 * m * n * k / seconds / 1e12}
            except Exception:  # noqa: BLE001 - recorded, the run goes on
                row[name] = {"error": error_text()}
        timed = {name: v["us"] for name, v in row.items() if isinstance(v, dict) and "us" in v}
        fp8_linear = {name: us for name, us in timed.items() if name.endswith("(linear)")}
        row["fastest"] = min(timed, key=timed.get) if timed else None
        row["fastest fp8 linear"] = min(fp8_linear, key=fp8_linear.get) if fp8_linear else None
        results.append(row)
    return results


def render(results: dict[str, list[dict[str, Any]]]) -> str:
    """One markdown table per shape: µs (TFLOP/s) per variant and M."""
    lines = []
    for shape, rows in results.items():
        names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
        lines += [f"### {shape} (N={rows[0]['N']}, K={rows[0]['K']})", ""]
        lines.append("| M | " + " | ".join(names) + " | fastest fp8 linear |")
        lines.append("|---" * (len(names) + 2) + "|")
        for row in rows:
            cells = []
            for name in names:
                v = row.get(name, {})
                cell = f"{v['us']:.1f} µs ({v['tflops']:.0f})" if "us" in v else "error"
                cells.append(f"**{cell}**" if name == row["fastest"] else cell)
            lines.append(f"| {row['M']} | " + " | ".join(cells) + f" | {row['fastest fp8 linear']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fp8_gemm_results")
    parser.add_argument("--smoke", action="store_true", help="two shapes, three row counts")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    shapes = dict(list(SHAPES.items())[:2]) if args.smoke else SHAPES
    rows = (1, 64, 1024) if args.smoke else ROWS
    results = {}
    for name, (n, k) in shapes.items():
        print(f"[fp8_gemm_bench] {name} N={n} K={k}", flush=True)
        results[name] = bench_shape(n, k, rows, device, 5 if args.smoke else args.iters)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"device": device_description(device), "torch": torch.__version__, "results": results}
    (out / "fp8_gemm.json").write_text(json.dumps(payload, indent=1))
    table = render(results)
    (out / "fp8_gemm.md").write_text(f"Device: {payload['device']}, torch {torch.__version__}\n\n{table}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
