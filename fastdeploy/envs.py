"""Every environment variable FastDeploy reads, in one place.

Read through the module attribute (``envs.FD_LOG_LEVEL``) so that the value is
taken at access time and tests can monkeypatch the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _default_grammar_threads() -> int:
    """Half the host's cores, 2 to 8: many distinct schemas at once are compile-bound (~60-140 ms
    each for a 128k vocabulary), and the engine loop and the tokenizer need cores too."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


def _optional_int(name: str) -> int | None:
    """An integer variable whose unset, empty or ``auto`` value means "let the engine choose" (None)."""
    value = os.environ.get(name, "").strip().lower()
    return None if value in ("", "auto") else int(value)


def _bool(name: str, default: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "FD_BACKEND": (
        lambda: os.environ.get("FD_BACKEND", "auto").strip().lower() or "auto",
        "Tensor backend: torch, paddle (PaddlePaddle 3.x through its torch-compat proxy, docs/paddle.md) "
        "or auto (torch when installed, else paddle). Set by --backend; child processes inherit it.",
    ),
    "FD_LOG_LEVEL": (lambda: os.environ.get("FD_LOG_LEVEL", "INFO").upper(), "Log level of all processes."),
    "FD_CACHE_DIR": (
        lambda: os.path.expanduser(os.environ.get("FD_CACHE_DIR", "~/.cache/fastdeploy")),
        "Where converted tokenizers and compiled kernels are cached.",
    ),
    "FD_ENGINE_READY_TIMEOUT_S": (
        lambda: float(os.environ.get("FD_ENGINE_READY_TIMEOUT_S", "600")),
        "Seconds the API server waits for the engine to load the model.",
    ),
    "FD_NODE_JOIN_TIMEOUT_S": (
        lambda: float(os.environ.get("FD_NODE_JOIN_TIMEOUT_S", "300")),
        "Seconds a --headless node waits for node 0 (master_addr:master_port) before it gives up.",
    ),
    "FD_HEALTH_CHECK_INTERVAL_S": (
        lambda: float(os.environ.get("FD_HEALTH_CHECK_INTERVAL_S", "0.5")),
        "How often engine and worker processes are checked for liveness.",
    ),
    "FD_FEATURE_DOWNLOAD_PARALLEL": (
        lambda: int(os.environ.get("FD_FEATURE_DOWNLOAD_PARALLEL", "8")),
        "Multimodal feature files fetched in parallel per request (1 = serial).",
    ),
    "FD_FEATURE_FETCH_TIMEOUT_S": (
        lambda: float(os.environ.get("FD_FEATURE_FETCH_TIMEOUT_S", "30")),
        "Seconds one multimodal feature file may take to fetch (connect plus transfer).",
    ),
    "FD_FEATURE_MAX_MB": (
        lambda: float(os.environ.get("FD_FEATURE_MAX_MB", "1024")),
        "Largest multimodal feature file (or inline image_embeds payload) accepted, in MiB.",
    ),
    "FD_FEATURE_REQUEST_MAX_MB": (
        lambda: float(os.environ.get("FD_FEATURE_REQUEST_MAX_MB", "2048")),
        "Most MiB the feature files of one request may take together (its URLs download in parallel, "
        "each under FD_FEATURE_MAX_MB).",
    ),
    "FD_FEATURE_URL_CACHE": (
        _bool("FD_FEATURE_URL_CACHE", "1"),
        "Serve a feature URL seen before from the encoder cache without fetching it again "
        "(feature URLs are taken as immutable; file:// also compares size and mtime).",
    ),
    "FD_BOS_ENDPOINT": (
        lambda: os.environ.get("FD_BOS_ENDPOINT", ""),
        "BOS endpoint for bos:// feature URLs, e.g. bj.bcebos.com or http://host:port.",
    ),
    "FD_BOS_ACCESS_KEY": (
        lambda: os.environ.get("FD_BOS_ACCESS_KEY", ""),
        "BOS access key id (AK) for bos:// feature URLs.",
    ),
    "FD_BOS_SECRET_KEY": (
        lambda: os.environ.get("FD_BOS_SECRET_KEY", ""),
        "BOS secret access key (SK) for bos:// feature URLs.",
    ),
    "FD_STEP_TRACE": (
        _bool("FD_STEP_TRACE", "0"),
        "Record (stage, step id, time) of every model-runner stage in ModelRunner.trace (benchmarks).",
    ),
    "FD_FORWARD_STATS_LOG_S": (
        lambda: float(os.environ.get("FD_FORWARD_STATS_LOG_S", "60")),
        "Seconds between the worker's log lines of its forward passes per path (decode graphs, "
        "mixed-step graphs, eager; worker/forward_stats.py), written while steps run.",
    ),
    "FD_SWITCH_INTERVAL_MS": (
        lambda: float(os.environ.get("FD_SWITCH_INTERVAL_MS", "0")),
        "Python's thread switch interval in the engine core's process, in ms (sys.setswitchinterval): "
        "how long the engine loop may hold the GIL while the grammar-mask threads wait for it. "
        "0 (the default): Python's own (5 ms).",
    ),
    "FD_TORCH_PROFILER_DIR": (
        lambda: os.environ.get("FD_TORCH_PROFILER_DIR", ""),
        "Folder where each worker writes a torch profile (Chrome trace and a text summary) of the "
        "steps FD_PROFILE_STEPS names (worker/step_profiler.py). Unset: no profiling.",
    ),
    "FD_PROFILE_STEPS": (
        lambda: os.environ.get("FD_PROFILE_STEPS", "100:20"),
        "first:count of the steps each worker profiles when FD_TORCH_PROFILER_DIR is set.",
    ),
    "FD_SIDE_STREAM": (
        _bool("FD_SIDE_STREAM", "1"),
        "1 (the default): run a MoE block's shared experts on a second CUDA stream beside its routed "
        "experts (model_executor/layers/side_stream.py; measured in docs/benchmarks.md); 0: one "
        "after the other on one stream.",
    ),
    "FD_USE_UVLOOP": (
        _bool("FD_USE_UVLOOP", "1"),
        "Run the API server on uvloop's event loop when it is installed (a dependency); 0: asyncio's.",
    ),
    "FD_REQUEST_TIMELINE_FILE": (
        lambda: os.environ.get("FD_REQUEST_TIMELINE_FILE", ""),
        "Append one JSON line per finished streamed request to this file: its timeline through the "
        "serving path (core/timeline.py; benchmarks/serving_breakdown.py reads it). Unset: not written.",
    ),
    "FD_DISABLE_CUSTOM_OPS": (
        _bool("FD_DISABLE_CUSTOM_OPS", "0"),
        "Use the torch fallbacks even when fastdeploy_ops is built.",
    ),
    "FD_CPU_OPS_BUILD_TIMEOUT_S": (
        lambda: float(os.environ.get("FD_CPU_OPS_BUILD_TIMEOUT_S", "300")),
        "Seconds a process waits for another process's build of the C++ CPU kernels before it "
        "uses the torch fallback instead.",
    ),
    "FD_SMALL_M_GEMV": (
        _bool("FD_SMALL_M_GEMV", "1"),
        "Use the Triton small-batch linear kernel (and fuse SiLU-and-multiply into down_proj) "
        "for decode steps of at most 4 rows inside CUDA graphs (0: cuBLAS everywhere).",
    ),
    "FD_FP8_SMALL_M_MAX": (
        lambda: int(os.environ.get("FD_FP8_SMALL_M_MAX", "16")),
        "FP8 linear layers of at most this many rows (decode steps) run the w8a16 Triton GEMV "
        "(the fp8 weight dequantized in registers, the activation not quantized, one kernel); "
        "larger ones quantize the activation and run an FP8 GEMM (0: always the latter; at most 256, "
        "the kernel's limit).",
    ),
    "FD_FP8_BLOCK_GEMM": (
        lambda: os.environ.get("FD_FP8_BLOCK_GEMM", "auto").strip().lower() or "auto",
        "GEMM of 128x128 block-scaled FP8 linears above FD_FP8_SMALL_M_MAX rows: scaled_mm "
        "(torch._scaled_mm block-wise, cuBLASLt), triton (the Triton block GEMM, any block size), "
        "or auto (scaled_mm where a start-up probe finds it working on the GPU, else triton).",
    ),
    "FD_CPU_BATCH_INVARIANT": (
        _bool("FD_CPU_BATCH_INVARIANT", "1"),
        "On a CPU, linear layers take 2 to 32 rows a matmul call (a single row beside a zero row), so "
        "that a request's logits are the same bits whatever else shares its step (a seeded or greedy "
        "request gives the same tokens alone or in any batch); 0: one call a layer (faster prefill, "
        "results that vary in the last bits with the batch).",
    ),
    "FD_MOE_ROUTER_SPLIT": (
        _bool("FD_MOE_ROUTER_SPLIT", "1"),
        "MoE routers of decode steps of at most 4 tokens on a GPU: split-K partial logits summed by "
        "the top-k kernel (many programs over the router weight) instead of the small-M GEMV (on by default; 0 turns it off).",
    ),
    "FD_MOE_ROUTER_NORM_FUSION": (
        _bool("FD_MOE_ROUTER_NORM_FUSION", "1"),
        "With the split router (FD_MOE_ROUTER_SPLIT), run the residual add + RMSNorm before a MoE block "
        "inside the router's kernel (one launch fewer a layer at decode steps of at most 4 tokens; on "
        "by default; 0: the norm kernel, then the router).",
    ),
    "FD_FP8_CHANNEL_TRITON_MAX_M": (
        lambda: int(os.environ.get("FD_FP8_CHANNEL_TRITON_MAX_M", "512")),
        "Per-channel FP8 linears (--quantization ptpc_fp8) of more than FD_FP8_SMALL_M_MAX and at most "
        "this many rows run the Triton per-channel GEMM instead of row-wise torch._scaled_mm "
        "(cuBLASLt); 0: never.",
    ),
    "FD_SMALL_M_NORM_FUSION": (
        _bool("FD_SMALL_M_NORM_FUSION", "1"),
        "With FD_SMALL_M_GEMV, run the residual add + RMSNorm inside the next linear, and the "
        "rotary embedding and KV-cache write inside qkv_proj, for decode steps of 1-2 rows "
        "(0: separate kernels).",
    ),
    "FD_MOE_GEMV_MAX_TOKENS": (
        lambda: int(os.environ.get("FD_MOE_GEMV_MAX_TOKENS", "4")),
        "Fused-MoE calls of at most this many tokens run the two GEMV-like expert kernels (no expert "
        "sort, SiLU-and-multiply and the top-k sum fused) instead of the sorted grouped GEMM; "
        "0: always the grouped GEMM.",
    ),
    "FD_MOE_TMA_WEIGHTS": (
        lambda: os.environ.get("FD_MOE_TMA_WEIGHTS", "auto").strip().lower() or "auto",
        "Whether the fused MoE's grouped GEMM reads the expert weights through TMA tensor descriptors "
        "on Hopper and later (the activations' gathered rows stay pointer loads): auto (the default) "
        "for 16-bit weights (bf16 prefill layer 8% faster on an H200), not FP8 (within 1%); 1: every "
        "dtype; 0: never.",
    ),
    "FD_MOE_PERSISTENT_MIN_TOKENS": (
        lambda: int(os.environ.get("FD_MOE_PERSISTENT_MIN_TOKENS", "4096")),
        "Fused-MoE steps of at least this many tokens run the grouped GEMM on a persistent grid (as "
        "many programs as the SMs hold at once, walking the tiles; tile and K loops pipelined together; "
        "fastdeploy/ops/triton_moe_gemm.py; 2% faster at 8,192 tokens on an H200, slower at 256); "
        "0: never (one program a tile).",
    ),
    "FD_MOE_RANKS_IN_ROUTER": (
        _bool("FD_MOE_RANKS_IN_ROUTER", "1"),
        "Whether the MoE routing kernel also takes each (token, expert) pair's rank within its expert "
        "(atomic adds) for the expert sort of steps of more than 256 pairs, one kernel fewer a layer "
        "(fastdeploy/ops/triton_moe_align_atomic.py; a batch-256 FP8 decode step 0.6% faster on an H200).",
    ),
    "FD_MOE_GROUPED_MM_MIN_TOKENS": (
        lambda: int(os.environ.get("FD_MOE_GROUPED_MM_MIN_TOKENS", "0")),
        "Per-channel FP8 MoE steps of at least this many tokens on Hopper run the experts as two "
        "torch._scaled_grouped_mm calls (CUTLASS; ops/fp8_grouped_mm.py) instead of the Triton grouped "
        "GEMM; 0 (the default until measured on a GPU): never.",
    ),
    "FD_MOE_TRITON_SUM": (
        _bool("FD_MOE_TRITON_SUM", "1"),
        "1 (the default): the fused MoE's combine (each token's sum over its top-k expert outputs) is a "
        "Triton kernel (triton_moe_act.sum_pairs), 1.5-2.7% faster layers on an H200 (docs/benchmarks.md, "
        "twenty-third session); 0: torch's sum.",
    ),
    "FD_TRITON_PDL": (
        _bool("FD_TRITON_PDL", "1"),
        "Launch the decode step's Triton kernels with programmatic dependent launch on sm_90+ "
        "(each starts while its predecessor finishes; 0: plain stream order).",
    ),
    "FD_TRITON_DECODE_MAX_BATCH": (
        lambda: int(os.environ.get("FD_TRITON_DECODE_MAX_BATCH", "1024")),
        "Under the flashinfer attention backend, decode-only steps of at most this many requests "
        "run the Triton decode kernel instead (one kernel, no host plan, and faster at every batch "
        "measured on an H200; default: every decode step; 0: never).",
    ),
    "FD_GC_FREEZE": (
        _bool("FD_GC_FREEZE", "1"),
        "Freeze each server process's start-up heap out of Python's garbage collection (shorter "
        "collection pauses under load; platforms/gc_heap.py).",
    ),
    "FD_GRAMMAR_CACHE_SIZE": (
        lambda: int(os.environ.get("FD_GRAMMAR_CACHE_SIZE", "256")),
        "Compiled structured-output grammars the engine core keeps (an LRU keyed by the constraint).",
    ),
    "FD_XGRAMMAR_CACHE_MB": (
        lambda: int(os.environ.get("FD_XGRAMMAR_CACHE_MB", "512")),
        "Memory of xgrammar's compiler cache (MiB): compiled grammars and the token masks of their "
        "rules, which distinct schemas share (a schema whose parts were seen compiles ~10x faster); "
        "0 turns the cache off.",
    ),
    "FD_GRAMMAR_PRIME_LENGTH": (
        lambda: max(0, int(os.environ.get("FD_GRAMMAR_PRIME_LENGTH", "128"))),
        "When xgrammar's compiler is made (the first structured-output request), a JSON string of up "
        "to this many characters is compiled beside the requests' compiles, at their low priority, so "
        "that xgrammar's cache holds the rules of every string with a shorter maxLength (those schemas "
        "then compile in milliseconds); 0: no priming. Needs FD_XGRAMMAR_CACHE_MB > 0.",
    ),
    "FD_STRUCTURED_OUTPUTS_BACKEND": (
        lambda: os.environ.get("FD_STRUCTURED_OUTPUTS_BACKEND", "xgrammar").strip().lower() or "xgrammar",
        "Structured-output backend: xgrammar (default), guidance (llguidance), or auto (llguidance "
        "for a constraint until xgrammar has compiled it, then xgrammar).",
    ),
    "FD_GRAMMAR_COMPILE_THREADS": (
        lambda: int(os.environ.get("FD_GRAMMAR_COMPILE_THREADS", "0")) or _default_grammar_threads(),
        "Threads of the engine core that compile structured-output grammars (off the engine loop); "
        "default: half the CPU cores, between 2 and 8.",
    ),
    "FD_GRAMMAR_MASK_THREADS": (
        lambda: int(os.environ.get("FD_GRAMMAR_MASK_THREADS", "0")) or _default_grammar_threads(),
        "Threads of the engine core that advance the grammar matchers and fill their bitmask rows "
        "each step, in slices; default: half the CPU cores, between 2 and 8.",
    ),
    "FD_GRAMMAR_COMPILE_NICE": (
        lambda: max(0, min(19, int(os.environ.get("FD_GRAMMAR_COMPILE_NICE", "10")))),
        "How much lower the CPU priority of the grammar compiles runs (the nice increment of their "
        "threads, in the engine core or the grammar processes; 0: same priority): a burst of new "
        "schemas then takes no cores from the engine loop and the worker on a busy host.",
    ),
    "FD_GRAMMAR_PROCESSES": (
        lambda: _optional_int("FD_GRAMMAR_PROCESSES"),
        "Helper processes that compile xgrammar grammars and make the structured-output bitmasks, "
        "beside the engine loop with no GIL shared with it (structured_output/grammar_processes.py); "
        "0: threads of the engine core's process; auto (the default): 8 processes where the model runs "
        "on a GPU and the engine core has 16 or more CPU cores of its own (the host's shared by its "
        "data-parallel replicas), threads otherwise.",
    ),
    "FD_API_KEY": (
        lambda: os.environ.get("FD_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
        "The API key when serve gets no --api-key: a key in the environment does not show in the "
        "process list, as a command-line argument does. Unset: vLLM's VLLM_API_KEY, if set.",
    ),
    "FD_RESPONSES_STORE_DIR": (
        lambda: os.environ.get("FD_RESPONSES_STORE_DIR", ""),
        "Directory of the stored /v1/responses (store: true), shared by the API server processes of one "
        "server; set by serve for its API servers (empty: a private temporary directory).",
    ),
    "FD_BATCH_STORE_DIR": (
        lambda: os.environ.get("FD_BATCH_STORE_DIR", ""),
        "Directory of the /v1/files and /v1/batches objects, shared by the API server processes of one "
        "server; set by serve for its API servers (empty: a private temporary directory).",
    ),
    "FD_BATCH_STORE_MB": (
        lambda: float(os.environ.get("FD_BATCH_STORE_MB", "2048")),
        "Most MiB of /v1/files (uploads and batch outputs) one server keeps; an upload past it is a 400 "
        "until files are deleted (0: no uploads).",
    ),
    "FD_RESPONSES_STORE_MB": (
        lambda: float(os.environ.get("FD_RESPONSES_STORE_MB", "256")),
        "Most MiB of stored /v1/responses each API server process keeps; past it, its oldest go first "
        "(0: nothing is stored, and previous_response_id cannot be used).",
    ),
    "FD_CUDA_ARCHS": (
        lambda: os.environ.get("FD_CUDA_ARCHS", "9.0a;8.0+PTX"),
        "GPU architectures setup_ops.py compiles fastdeploy_ops for, ';'-separated "
        "('9.0a' = sm_90a, '+PTX' also embeds portable PTX).",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def describe() -> dict[str, str]:
    """``{variable: description}`` for the docs."""
    return {name: doc for name, (_, doc) in _VARIABLES.items()}
