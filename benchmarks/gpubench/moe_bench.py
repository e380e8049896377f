"""Fused-MoE layer benchmark on Qwen3-30B-A3B's expert shapes: the whole layer, against its floor.

One MoE layer: 128 experts, top-8, hidden 2048, moe_intermediate 768, bf16, ``fp8`` (128 x 128
block-scaled weights) and ``ptpc_fp8`` (per-channel weight scales, per-token activation scales). Each row times ``FusedMoE.forward`` from the router logits: the top-k
softmax routing (and the load statistic), the expert sort/pad, both expert GEMMs with
SiLU-and-multiply (and FP8 activation quantization), the weighted top-k combine; eager and
replayed from a CUDA graph (what decode steps run). For each token count and path:

* ``floor``: the touched experts' weight bytes (with their scales) over the measured copy
  bandwidth (bytes read + written per second, as ``measure.copy_bandwidth`` counts them) — the
  time a layer that only streamed the weights it needs would take; ``x floor`` = graph / floor;
* weight GB/s and TFLOP/s (``2 * tokens * top_k * 3 * I * H`` per call);
* ``route+align``: the routing and the expert sort alone in a CUDA graph, Triton
  (``topk_softmax`` + ``moe_align_block_size``) against the torch versions
  (``select_experts_torch`` + ``align_block_size_torch``) they replace;
* the error against the torch path (``compute_experts_torch`` on the same routing; for FP8 it
  computes w8a8, which the grouped GEMM matches, the w8a16 GEMV path only to FP8 precision).

Paths: ``gemv`` (the few-token kernels of :mod:`fastdeploy.ops.triton_moe_gemv`) and ``grouped``
(the sorted grouped GEMM), both timed up to 16 tokens so that ``FD_MOE_GEMV_MAX_TOKENS`` can be set
where they cross; ``grouped`` beyond. Routing is random (each token's k experts distinct).
Weights rotate over several layers' worth of sets at small batches so that the touched experts
are read from HBM, not L2.

    python -m benchmarks.gpubench.moe_bench --out /tmp/moe                  # H100 / H200
    python -m benchmarks.gpubench.moe_bench --out /tmp/moe --sweep          # + a config sweep per size
    TRITON_INTERPRET=1 python -m benchmarks.gpubench.moe_bench --smoke --device cpu --out /tmp/s

``--sweep`` times a short list of candidate grouped-GEMM configurations per (dtype, tokens) and
reports the best next to the table's; its winners are what ``BF16_CONFIGS`` / ``FP8_CONFIGS``
should hold. ``--sweep-split`` tunes the two GEMMs apart (``fused_experts``' ``down_config``; the
down GEMM's K loop is short): on the H200 the down GEMM's best was the shared table's (twenty-fourth
session), so the tables hold one configuration for both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastdeploy.model_executor.layers.fused_moe import FusedMoE, select_experts, select_experts_torch
from fastdeploy.model_executor.layers.quantization import Fp8Config, PtpcFp8Config
from fastdeploy.ops import triton_fused_moe as moe
from fastdeploy.ops import triton_moe_gemv as gemv
from fastdeploy.ops.triton_moe_align_atomic import new_pair_ranks
from fastdeploy.ops.triton_moe_routing import moe_align_block_size

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
TOKENS = (1, 2, 4, 8, 16, 64, 256, 512, 4096, 8192)
SMOKE_TOKENS = (1, 5)
GEMV_COMPARE_MAX = 16
"""Up to this many tokens both paths are timed."""
ROTATE_BYTES = 256 << 20
"""Weight bytes touched per pass over the rotated sets at small batches (H100/H200 L2: 50 MiB)."""
MAX_SETS = 4


QUANT_CONFIGS = {"bf16": None, "fp8": Fp8Config, "ptpc_fp8": PtpcFp8Config}
"""The dtypes a run can take (``--dtypes``) and the quantization each builds its layer with."""


def _is_fp8(dtype: str) -> bool:
    return QUANT_CONFIGS[dtype] is not None


def _candidates(tokens: int, dtype: str) -> list[moe.MoEKernelConfig]:
    """The sweep's configurations for ``tokens`` (latency shapes for decode, throughput for prefill;
    block-scaled FP8 needs ``block_k`` dividing its 128-column scale blocks)."""
    cfg = moe.MoEKernelConfig
    if tokens <= 128:
        ks = {"fp8": (128,), "ptpc_fp8": (128, 256)}.get(dtype, (64, 128, 256))
        return [cfg(16, n, k, 1, 4, s) for n in (32, 64, 128) for k in ks for s in (3, 4, 5)]
    ks = (128,) if _is_fp8(dtype) else (64, 128)
    return [
        cfg(m, n, k, g, w, s)
        for m, n in ((16, 128), (16, 256), (32, 128), (64, 128), (64, 256), (128, 128), (128, 256))
        for k in ks
        for g, w, s in ((16, 4, 3), (16, 4, 4), (8, 4, 4), (16, 8, 4), (1, 8, 3))
        if m >= 64 or tokens <= 2048  # 16-32-row tiles: decode batches (~16 pairs an expert at 256 tokens)
    ]


@dataclass
class Layer:
    """One set of expert weights as the kernel takes them (and the FusedMoE holding them)."""

    module: FusedMoE
    weight_bytes_per_expert: int


def make_layer(shape: MoeShape, dtype: str, device: torch.device, seed: int) -> Layer:
    """Random experts (std 1/sqrt(fan_in)) in a FusedMoE built without allocating its empty weights."""
    with torch.device("meta"):
        layer = FusedMoE(
            shape.experts, shape.top_k, shape.hidden, shape.intermediate, renormalize=True,
            quant_config=QUANT_CONFIGS[dtype]() if _is_fp8(dtype) else None,
        )  # fmt: skip
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, device=device, dtype=torch.bfloat16, generator=g) * i**-0.5
    layer.gate_up_proj = nn.Parameter(w13, requires_grad=False)
    layer.down_proj = nn.Parameter(w2, requires_grad=False)
    layer.routed_tokens = torch.zeros(shape.experts, dtype=torch.int64, device=device)
    if _is_fp8(dtype):
        layer.process_weights_after_loading()  # block or per-channel quantization, expert by expert
    per_expert = sum(t[0].numel() * t.element_size() for t in layer.parameters())  # weights and scales
    return Layer(layer, per_expert)


def _inputs(shape: MoeShape, tokens: int, device: torch.device, seed: int):
    """Hidden states and router logits (bf16, as the model's router gives them)."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, shape.experts, device=device, generator=g).to(torch.bfloat16)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16, generator=g)
    return x, logits


@contextlib.contextmanager
def _path(path: str):
    """``FD_MOE_GEMV_MAX_TOKENS`` for one path (read at each call, so also at graph capture)."""
    settings = {"FD_MOE_GEMV_MAX_TOKENS": str(0 if path == "grouped" else 1 << 30)}
    old = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _forward(
    layer: Layer, x, logits, config: moe.MoEKernelConfig | None, down: moe.MoEKernelConfig | None = None
) -> torch.Tensor:
    """The whole layer from its router logits: what ``FusedMoE.forward`` runs on CUDA (routing with
    the load statistic, then ``fused_experts``), called directly so that the interpreter's CPU
    smoke run takes the kernels too."""
    m = layer.module
    ranked = (
        moe.pair_ranks_for(x, m.gate_up_proj, m.down_proj, _block(m), m.top_k) if config is None else None
    )
    weights, ids = select_experts(logits, m.top_k, m.renormalize, None, m.routed_tokens, ranked=ranked)
    s13, s2 = m.expert_scales()
    return moe.fused_experts(
        x, m.gate_up_proj, m.down_proj, weights, ids, s13, s2, _block(m), config=config, down_config=down,
        ranked=ranked,
    )  # fmt: skip


def _block(m: FusedMoE) -> tuple[int, int] | None:
    """The scale layout the kernels take for ``m``'s experts (None: per channel)."""
    return m.fp8.block if m.fp8 is not None else (128, 128)


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


def _time(calls: list, device: torch.device, iters: int, repeats: int) -> tuple[float, float | None]:
    """(eager, CUDA-graph or None off CUDA) seconds per call."""
    eager = time_per_call(lambda i: calls[i % len(calls)](), device, iters, 1, repeats)
    return eager, (_graph_time(calls, device, iters) if device.type == "cuda" else None)


def route_align_times(shape: MoeShape, tokens: int, block_m: int, device: torch.device) -> dict[str, Any]:
    """Routing + expert sort alone: the Triton kernels (from a CUDA graph off the interpreter)
    against the torch versions (eager: their ``nonzero`` reads the device on the host, so they
    cannot be captured)."""
    _, logits = _inputs(shape, tokens, device, seed=7)
    k, e = shape.top_k, shape.experts

    in_router = moe.router_takes_ranks(tokens * k)

    def triton_call(_=0):
        ranked = new_pair_ranks(tokens * k, e, device) if in_router else None  # (FD_MOE_RANKS_IN_ROUTER)
        _, ids = select_experts(logits, k, True, ranked=ranked)
        return moe_align_block_size(ids, block_m, e, ranked)

    def torch_call(_=0):
        _, ids = select_experts_torch(logits, k, True)
        return moe.align_block_size_torch(ids, block_m, e)

    iters, repeats = (20, 5) if device.type == "cuda" else (1, 1)
    row = {}
    eager, graph = _time([triton_call], device, iters, repeats)
    row["route_align_triton_seconds"] = graph if graph is not None else eager
    row["route_align_torch_seconds"] = time_per_call(lambda i: torch_call(), device, iters, 1, repeats)
    return row


def bench_row(
    shape: MoeShape, layers: list[Layer], dtype: str, tokens: int, device: torch.device, path: str,
    config: moe.MoEKernelConfig | None = None, down: moe.MoEKernelConfig | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Time the whole layer on ``tokens`` tokens along ``path``, rotating over ``layers``; rates and error
    (``config``: both GEMMs' meta-parameters, ``down``: the down GEMM's; None: the tables')."""
    inputs = [_inputs(shape, tokens, device, seed=100 + j) for j in range(len(layers))]
    calls = [
        (lambda layer=layer, inp=inp: _forward(layer, *inp, config, down))
        for layer, inp in zip(layers, inputs, strict=True)
    ]
    iters = 20 if tokens <= 1024 else 5
    repeats = 5
    if device.type != "cuda":  # the interpreter: a script check, one timed call
        iters = repeats = 1
    row: dict[str, Any] = {"dtype": dtype, "tokens": tokens, "path": path}
    if path == "grouped":
        row["config"] = asdict(config or _default_config(tokens, dtype))
        row["down_config"] = asdict(down or _default_down_config(tokens, dtype, config))
    with _path(path):
        row["eager_seconds"], row["graph_seconds"] = _time(calls, device, iters, repeats)
        out = calls[0]().double()
    seconds = row["graph_seconds"] or row["eager_seconds"]
    m = layers[0].module
    touched = []
    for j, (_, logits) in enumerate(inputs):
        weights, ids = select_experts(logits, m.top_k, m.renormalize)
        touched.append(torch.unique(ids).numel())
        if j == 0:
            ref = m.compute_experts_torch(inputs[0][0], weights, ids).double()
    row["touched_experts"] = sum(touched) / len(touched)
    row["weight_bytes"] = row["touched_experts"] * layers[0].weight_bytes_per_expert
    row["weight_bytes_per_s"] = row["weight_bytes"] / seconds
    flops = 2 * tokens * shape.top_k * 3 * shape.intermediate * shape.hidden
    row["tflop_per_s"] = flops / seconds / 1e12
    row["rel_err_vs_torch"] = ((out - ref).norm() / ref.norm()).item()
    return row


def _default_config(tokens: int, dtype: str) -> moe.MoEKernelConfig:
    return moe.default_config(tokens, _is_fp8(dtype), per_channel=dtype == "ptpc_fp8")


def _default_down_config(
    tokens: int, dtype: str, config: moe.MoEKernelConfig | None = None
) -> moe.MoEKernelConfig:
    """The down GEMM's configuration beside ``config`` (None: the table's, which both GEMMs share)."""
    return config or _default_config(tokens, dtype)


def sweep_split(
    shape: MoeShape, layers: list[Layer], dtype: str, tokens: int, device: torch.device,
    max_candidates: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The two grouped GEMMs' configurations apart, by coordinate descent from the tables': the
    down GEMM's over :func:`_down_candidates` (gate_up at the table's), then gate_up's over the
    sweep's candidates with the same ``block_m``, with that down. Times the whole layer (CUDA graphs)."""
    gate_up, down = _default_config(tokens, dtype), _default_down_config(tokens, dtype)
    candidates = {  # (the smoke run: a few)
        "down": _down_candidates(gate_up.block_m, dtype)[:max_candidates],
        "gate_up": [c for c in _candidates(tokens, dtype) if c.block_m == gate_up.block_m][:max_candidates],
    }
    tried = 0

    def seconds(up: moe.MoEKernelConfig, dn: moe.MoEKernelConfig) -> float | None:
        nonlocal tried
        try:
            row = bench_row(shape, layers, dtype, tokens, device, "grouped", up, dn)
        except Exception:  # a configuration the compiler refuses (shared memory): skip it
            return None
        tried += 1
        return row["graph_seconds"] or row["eager_seconds"]

    default_seconds = best_seconds = seconds(gate_up, down)
    for which in ("down", "gate_up"):
        for c in candidates[which]:
            t = seconds(gate_up, c) if which == "down" else seconds(c, down)
            if t is not None and (best_seconds is None or t < best_seconds):
                best_seconds = t
                gate_up, down = (gate_up, c) if which == "down" else (c, down)
    return {
        "tried": tried, "default_seconds": default_seconds, "best_seconds": best_seconds,
        "gate_up": asdict(gate_up), "down": asdict(down),
    }  # fmt: skip


def _down_candidates(block_m: int, dtype: str) -> list[moe.MoEKernelConfig]:
    """More shapes for the down GEMM (K = the intermediate size, a short loop): narrow and wide
    column tiles, deep K steps."""
    ks = (128, 256) if dtype != "fp8" else (128,)
    return [
        moe.MoEKernelConfig(block_m, n, k, g, w, st)
        for n in (64, 128, 256)
        for k in ks
        for g, w, st in ((1, 4, 3), (8, 4, 4), (16, 4, 5), (16, 8, 3))
    ]


def sweep(
    shape: MoeShape, layers: list[Layer], dtype: str, tokens: int, device: torch.device
) -> dict[str, Any]:
    """The fastest candidate configuration (CUDA-graph time) for one size."""
    best: dict[str, Any] | None = None
    tried = 0
    for config in _candidates(tokens, dtype):
        try:
            row = bench_row(shape, layers, dtype, tokens, device, "grouped", config)
        except Exception:  # a configuration the compiler refuses (shared memory): skip it
            continue
        tried += 1
        key = row["graph_seconds"] or row["eager_seconds"]
        if best is None or key < (best["graph_seconds"] or best["eager_seconds"]):
            best = row
    return {"tried": tried, "best": best}


def _gemv_candidates(fp8: bool) -> list[gemv.GemvConfig]:
    """The GEMV sweep's configurations of one kernel (FP8: tiles of at most 128 rows, whose block
    scales then multiply the activations, so ``block_k`` may span several scale blocks)."""
    if os.environ.get("MOE_GEMV_CANDIDATES"):  # "n,k,warps,stages;..." instead of the grid below
        return [
            gemv.GemvConfig(*map(int, c.split(","))) for c in os.environ["MOE_GEMV_CANDIDATES"].split(";")
        ]
    ks = (128, 256, 512)
    # narrow tiles too: at one token the down kernel's 2048 / 8 = 256 programs each loop over
    # 8 experts' rows, latency-bound (12 µs against a 5.9 µs floor in bf16, tenth session)
    ns = (4, 8, 16, 32) if fp8 else (2, 4, 8, 16)
    return [gemv.GemvConfig(n, k, 4, s) for n in ns for k in ks for s in (3, 4)]


def _routed(shape: MoeShape, count: int, tokens: int, device: torch.device) -> list[tuple[Any, Any, Any]]:
    """``count`` sets of (hidden states, routing weights, expert ids) for ``tokens`` tokens."""
    routed = []
    for j in range(count):
        x, logits = _inputs(shape, tokens, device, seed=100 + j)
        routed.append((x, *select_experts(logits, shape.top_k, True)))
    return routed


def _experts_seconds(
    layers: list[Layer], routed: list[tuple[Any, Any, Any]], device: torch.device, experts: Any, **config: Any
) -> float:
    """Seconds a call (CUDA graph; eager off CUDA) of ``experts`` (a few-token experts function:
    :func:`~fastdeploy.ops.triton_moe_gemv.fused_experts_gemv` or the one-pass one) on each layer's
    weights and routing in turn, with ``config`` (its configuration keyword)."""
    calls = []
    for layer, (x, w, ids) in zip(layers, routed, strict=True):
        m = layer.module
        s13, s2 = m.expert_scales()
        calls.append(
            lambda m=m, x=x, w=w, ids=ids, s13=s13, s2=s2: experts(
                x, m.gate_up_proj, m.down_proj, w, ids, s13, s2, _block(m), **config
            )
        )
    cuda = device.type == "cuda"
    eager, graph = _time(calls, device, 20 if cuda else 1, 3 if cuda else 1)
    return graph if graph is not None else eager


def sweep_gemv(
    shape: MoeShape, layers: list[Layer], dtype: str, tokens: int, device: torch.device
) -> dict[str, Any]:
    """The two GEMV kernels' fastest configurations by coordinate descent: gate_up's with the
    default down, then down's with that gate_up. Times the experts alone (routing precomputed)."""
    routed = _routed(shape, len(layers), tokens, device)
    fp8 = _is_fp8(dtype)

    def seconds(configs: tuple[gemv.GemvConfig, gemv.GemvConfig]) -> float:
        return _experts_seconds(layers, routed, device, gemv.fused_experts_gemv, configs=configs)

    rounds = [
        lambda best: [(c, best[1]) for c in _gemv_candidates(fp8)],
        lambda best: [(best[0], c) for c in _gemv_candidates(fp8)],
    ]
    best, timing = _descend(seconds, gemv.default_configs(fp8, tokens), rounds)
    return {**timing, "gate_up": asdict(best[0]), "down": asdict(best[1])}


def _descend(
    seconds: Callable[[Any], float], start: Any, rounds: list[Callable[[Any], list[Any]]]
) -> tuple[Any, dict[str, Any]]:
    """Coordinate descent from ``start``: each round times the candidates it makes from the best so
    far (one the compiler or the layout refuses is skipped). The best, and ``tried`` /
    ``default_seconds`` (the start's) / ``best_seconds``."""
    best = start
    default_seconds = best_seconds = seconds(start)
    tried = 1
    for candidates in rounds:
        for cand in candidates(best):
            if cand == best:
                continue
            try:
                t = seconds(cand)
            except Exception:  # noqa: BLE001 - a configuration that does not compile or fit
                continue
            tried += 1
            if t < best_seconds:
                best, best_seconds = cand, t
    return best, {"tried": tried, "default_seconds": default_seconds, "best_seconds": best_seconds}


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
        fp8 = _is_fp8(dtype)
        layer_bytes = 3 * shape.experts * shape.hidden * shape.intermediate * (1 if fp8 else 2)
        sets = (
            1 if device.type != "cuda" else max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES * 8 / layer_bytes)))
        )
        layers = [make_layer(shape, dtype, device, seed=j) for j in range(sets)]
        for tokens in tokens_list:
            use = layers if tokens <= 64 else layers[:1]
            paths = ("gemv", "grouped") if tokens <= GEMV_COMPARE_MAX else ("grouped",)
            route = {}
            try:
                route = route_align_times(shape, tokens, _default_config(tokens, dtype).block_m, device)
            except Exception:
                route = {"route_align_error": error_text()}
            for path in paths:
                try:
                    row = bench_row(shape, use, dtype, tokens, device, path)
                    row.update(route)
                    if copy_bw:
                        row["floor_seconds"] = row["weight_bytes"] / copy_bw
                        row["x_floor"] = (row["graph_seconds"] or row["eager_seconds"]) / row["floor_seconds"]
                    if args.sweep:
                        search = {"grouped": sweep, "gemv": sweep_gemv}[path]
                        row["sweep"] = search(shape, use, dtype, tokens, device)
                    if args.sweep_split and path == "grouped":
                        row["sweep"] = sweep_split(
                            shape, use, dtype, tokens, device, 2 if args.smoke else None
                        )
                except Exception:
                    row = {"dtype": dtype, "tokens": tokens, "path": path, "error": error_text()}
                print(json.dumps(row, default=str), flush=True)
                results["rows"].append(row)
        del layers
        free_memory(device)
    return results


def _tile_text(c: dict[str, Any]) -> str:
    """A kernel configuration in short: ``M64 N128 K128 G8 w4 s3`` (a GEMV's has no M or G)."""
    m = f"M{c['block_m']} " if "block_m" in c else ""
    g = f"G{c['group_m']} " if "group_m" in c else ""
    return f"{m}N{c['block_n']} K{c['block_k']} {g}w{c['num_warps']} s{c['num_stages']}"


def render(results: dict[str, Any]) -> str:
    """Markdown table of the rows (for docs/benchmarks.md)."""
    s = results["shape"]
    lines = [
        f"Fused-MoE layer (routing + sort + experts + combine), {s['experts']} experts top-{s['top_k']}, "
        f"H={s['hidden']}, I={s['intermediate']} ({results['device'].get('gpu', results['device'])}; "
        f"copy bandwidth {(results['copy_bytes_per_s'] or 0) / 1e12:.2f} TB/s)",
        "",
        "| dtype | tokens | path | graph µs | eager µs | floor µs | x floor | weight GB/s | TFLOP/s "
        "| route+align µs (Triton / torch) | err vs torch | config | sweep best |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]

    def fmt(v, scale=1e6, digits=1):
        return "" if v is None else f"{v * scale:.{digits}f}"

    for r in results["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['dtype']} | {r['tokens']} | {r['path']} | error: {r['error'].splitlines()[-1][:80]} |"
            )
            continue
        c = r.get("config")
        conf = _tile_text(c) if c else ""
        best = (r.get("sweep") or {}).get("best")
        best_text = ""
        if r.get("sweep") and "gate_up" in r["sweep"]:  # the GEMV / split sweeps: each kernel's best
            w = r["sweep"]
            best_text = (
                f"{'layer' if r['path'] == 'grouped' else 'experts'} {w['best_seconds'] * 1e6:.1f} µs "
                f"(default {w['default_seconds'] * 1e6:.1f}, {w['tried']} tried): "
                + ", ".join(
                    f"{name} {_tile_text(c)}" for name, c in (("gate_up", w["gate_up"]), ("down", w["down"]))
                )
            )
        if best:
            b = best["config"]
            best_text = f"{(best['graph_seconds'] or best['eager_seconds']) * 1e6:.1f} µs: {_tile_text(b)}"
        route = f"{fmt(r.get('route_align_triton_seconds'))} / {fmt(r.get('route_align_torch_seconds'))}"
        lines.append(
            f"| {r['dtype']} | {r['tokens']} | {r['path']} | {fmt(r.get('graph_seconds'))} | {fmt(r['eager_seconds'])} "
            f"| {fmt(r.get('floor_seconds'))} | {fmt(r.get('x_floor'), 1, 2)} | {r['weight_bytes_per_s'] / 1e9:.0f} "
            f"| {r['tflop_per_s']:.1f} | {route} | {r['rel_err_vs_torch']:.1e} | {conf} | {best_text} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for results.json and results.md")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--dtypes", default="bf16,fp8,ptpc_fp8", help="comma-separated: " + ", ".join(QUANT_CONFIGS)
    )
    parser.add_argument("--tokens", default="", help="comma-separated token counts (default: 1 to 8192)")
    parser.add_argument("--sweep", action="store_true", help="also time candidate configurations per size")
    parser.add_argument(
        "--sweep-split", action="store_true", help="grouped rows: the two GEMMs' configurations apart"
    )
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
