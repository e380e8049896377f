"""RMSNorm (after the residual add) fused into the next small-M linear, and optionally the
rotary embedding and KV-cache write fused after it: batch-1 and batch-2 decode on a GPU.

A Llama decoder layer at batch 1 is a chain of small kernels whose launches and
ramp-ups, not their bytes, set the step time once the linears run near the copy rate.
Two of them carry almost no bytes: the residual add + RMSNorm before ``qkv_proj`` and
before ``gate_up_proj``, and the rotary + cache write after ``qkv_proj``. This kernel
runs them inside the linear (one kernel where there were two or three):

* **Prologue (always).** The linear reads its whole input row anyway (a program covers
  ``BLOCK_N`` output columns over all of K), so each program forms ``h = x + residual``
  as it streams K, accumulates ``w * (h * norm_weight)`` and ``h * h`` side by side, and
  scales its sums by ``rsqrt(mean(h²) + eps)`` at the end: one pass, no serial
  prologue. Program 0 also stores ``h``, the next residual, into a new buffer (the input
  buffers are read by every program, so nothing is updated in place).
* **Epilogue (``qkv_proj`` only).** Each program's columns are (first half, second half)
  pairs of the same head, so it can rotate its q and k sums and write k and v to their
  cache slots itself. The v columns take programs of their own, without rotation.

Rounding: ``h`` is rounded to the activation dtype as the unfused add does; the
normalized input is not (the unfused path rounds it twice), so results differ from the
unfused path by bf16 rounding noise, not more. The rotary rounding points are those of
:mod:`fastdeploy.ops.triton_layer_ops` (the linear's output, cos and sin rounded first).
bf16/fp16 caches only (an fp8 cache needs each head's absmax before its scale).

Rows: 1 to :data:`NORM_FUSE_MAX_M`. Like :mod:`fastdeploy.ops.triton_gemv`, the first call
of each shape autotunes (synchronizing the device), so warm up before CUDA graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_gemv import ACC_ELEMENTS, BROADCAST_CONFIGS, DTYPES, autotune_bench, launch
from fastdeploy.ops.triton_layer_ops import load_cos_sin
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue, pdl_trigger

NORM_FUSE_MAX_M = 2
"""Most rows: every program recomputes the normalized input over the whole K for each row,
work that grows with M (as the SiLU prologue of :mod:`fastdeploy.ops.triton_gemv`)."""


@dataclass(frozen=True)
class RotaryCache:
    """The epilogue's inputs: rotate q and k of each row at ``positions`` (NeoX halves, the
    ``cos``/``sin`` tables of :class:`~fastdeploy.model_executor.layers.rotary_embedding.RotaryEmbedding`)
    and write k and v into NHD caches ``[blocks, block_size, num_kv_heads, head_dim]`` at
    ``slot_mapping`` (negative: skip)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


@triton.jit
def _residual_sum(
    x_row, r_row, r_out_row, cols, k_mask, store_end, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr
):
    """``x + residual`` at ``cols`` in float32, rounded as the unfused add; stored at ``cols < store_end``."""
    if EVEN_K:
        x = tl.load(x_row + cols).to(tl.float32)
    else:
        x = tl.load(x_row + cols, mask=k_mask, other=0.0).to(tl.float32)
    if not HAS_RES:
        return x
    if EVEN_K:
        r = tl.load(r_row + cols).to(tl.float32)
    else:
        r = tl.load(r_row + cols, mask=k_mask, other=0.0).to(tl.float32)
    dtype = r_out_row.dtype.element_ty
    h = (x + r).to(dtype)
    tl.store(r_out_row + cols, h, mask=cols < store_end)
    return h.to(tl.float32)


@triton.jit
def _rotary_store(
    out_row,
    y,
    col_a,
    col_b,
    is_rot,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    row,
    kv_col0,
    KV_DIM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate one row's (first half, second half) pairs, store them and their cache copies."""
    dtype = out_row.dtype.element_ty
    y = y.to(dtype).to(tl.float32)  # the linear's output rounding
    a, b = tl.split(tl.reshape(y, [BLOCK_H, 2]))
    c, s = load_cos_sin(pos_ptr, cos_ptr, sin_ptr, row, col_a % HEAD_DIM, HALF, dtype)  # v programs: unused
    ra = tl.where(is_rot, a * c - b * s, a).to(dtype)
    rb = tl.where(is_rot, b * c + a * s, b).to(dtype)
    tl.store(out_row + col_a, ra)
    tl.store(out_row + col_b, rb)
    slot = tl.full([BLOCK_H], 0, tl.int64) + tl.load(slot_ptr + row).to(tl.int64)
    cached = (col_a >= kv_col0) & (slot >= 0)
    ka = col_a - kv_col0
    kb = col_b - kv_col0
    base = slot * KV_DIM
    tl.store(kc_ptr + base + ka, ra, mask=cached & (ka < KV_DIM))
    tl.store(kc_ptr + base + kb, rb, mask=cached & (kb < KV_DIM))
    tl.store(vc_ptr + base + ka - KV_DIM, ra, mask=cached & (ka >= KV_DIM))
    tl.store(vc_ptr + base + kb - KV_DIM, rb, mask=cached & (kb >= KV_DIM))


@triton.jit
def _norm_linear_kernel(
    x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, out_ptr,
    pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr,
    N, K, eps, stride_xm, stride_rm, stride_wn, stride_om, num_rot_cols,
    M: tl.constexpr, HAS_RES: tl.constexpr, ROTARY: tl.constexpr,
    KV_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    if ROTARY:
        BLOCK_H: tl.constexpr = BLOCK_N // 2
        HALF: tl.constexpr = HEAD_DIM // 2
        pairs = tl.arange(0, BLOCK_H)
        rot_programs = num_rot_cols // BLOCK_N
        is_rot = tl.full([BLOCK_H], 0, tl.int32) + pid < rot_programs  # a vector: the interpreter's masks
        j = pid * BLOCK_H + pairs  # the rotated pair (q and k heads), or a v column pair
        rot_a = (j // HALF) * HEAD_DIM + j % HALF
        v_a = num_rot_cols + (pid - rot_programs) * BLOCK_N + 2 * pairs
        col_a = tl.where(is_rot, rot_a, v_a)
        col_b = tl.where(is_rot, rot_a + HALF, v_a + 1)
        offs_n = tl.reshape(tl.join(col_a, col_b), [BLOCK_N])
        rows = offs_n.to(tl.int64)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    store_res = tl.where(pid == 0, K, 0)  # program 0 stores the new residual
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss0 = tl.zeros([BLOCK_K], dtype=tl.float32)
    ss1 = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        cols = k0 + offs_k
        k_mask = cols < K
        if EVEN_K:
            w = tl.load(w_ptrs + k0).to(tl.float32)
            nw = tl.load(nw_ptr + cols).to(tl.float32)
        else:
            w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        h0 = _residual_sum(x_ptr, res_ptr, res_out_ptr, cols, k_mask, store_res, HAS_RES, EVEN_K)
        ss0 += h0 * h0
        acc0 += w * (h0 * nw)[None, :]
        if M > 1:
            h1 = _residual_sum(
                x_ptr + stride_xm,
                res_ptr + stride_rm,
                res_out_ptr + K,
                cols,
                k_mask,
                store_res,
                HAS_RES,
                EVEN_K,
            )
            ss1 += h1 * h1
            acc1 += w * (h1 * nw)[None, :]
    pdl_trigger(USE_PDL)
    y0 = tl.sum(acc0, axis=1) * tl.rsqrt(tl.sum(ss0, axis=0) / K + eps)
    y1 = tl.sum(acc1, axis=1) * tl.rsqrt(tl.sum(ss1, axis=0) / K + eps)
    if ROTARY:
        kv_col0 = num_rot_cols - KV_DIM
        _rotary_store(
            out_ptr, y0, col_a, col_b, is_rot, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, 0,
            kv_col0, KV_DIM, HEAD_DIM, HALF, BLOCK_H,
        )  # fmt: skip
        if M > 1:
            _rotary_store(
                out_ptr + stride_om, y1, col_a, col_b, is_rot, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr,
                vc_ptr, 1, kv_col0, KV_DIM, HEAD_DIM, HALF, BLOCK_H,
            )  # fmt: skip
    else:
        n_mask = offs_n < N
        tl.store(out_ptr + offs_n, y0.to(out_ptr.dtype.element_ty), mask=n_mask)
        if M > 1:
            tl.store(out_ptr + stride_om + offs_n, y1.to(out_ptr.dtype.element_ty), mask=n_mask)


# triton_gemv's broadcast-form configurations (the dot form takes no prologue), without DOT.
_CONFIGS = [
    triton.Config(
        {k: c.kwargs[k] for k in ("BLOCK_N", "BLOCK_K", "STAGES")},
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    for c in BROADCAST_CONFIGS
]
_INTERPRETER_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 64, "STAGES": 1}


def _prune(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """With the rotary epilogue a program's column pairs must stay inside one head half."""
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    rotary = kwargs.get("ROTARY", named_args.get("ROTARY"))
    m = kwargs.get("M", named_args.get("M"))
    kept = [
        c
        for c in configs
        if m * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= ACC_ELEMENTS
        and (not rotary or (head_dim // 2) % (c.kwargs["BLOCK_N"] // 2) == 0)
    ]
    return kept or configs[:1]


_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_norm_linear_kernel)
_tuned_kernel = triton.autotune(
    configs=_CONFIGS,
    key=["N", "K", "M", "HAS_RES", "ROTARY", "HEAD_DIM"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=autotune_bench,
)(_kernel)

_warmed: set[tuple[Any, ...]] = set()


def _warm_key(
    x: torch.Tensor, weight: torch.Tensor, has_res: bool, rotary: RotaryCache | None
) -> tuple[Any, ...]:
    head_dim = rotary.head_dim if rotary is not None else 0
    return (x.shape[0], weight.shape[0], weight.shape[1], x.dtype, has_res, head_dim, x.get_device())


def is_warmed_up(
    x: torch.Tensor, weight: torch.Tensor, has_residual: bool, rotary: RotaryCache | None = None
) -> bool:
    """Whether :func:`norm_small_m_linear` already ran on these shapes outside graph capture
    (only then is a call free of autotuning, and so safe to capture)."""
    return _warm_key(x, weight, has_residual, rotary) in _warmed


def _check(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor
) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and weight must share a dtype of {DTYPES}, got {x.dtype} and {weight.dtype}")
    m, k = x.shape
    if not 1 <= m <= NORM_FUSE_MAX_M:
        raise ValueError(f"x must have 1 to {NORM_FUSE_MAX_M} rows, got {m}")
    if weight.shape[1] != k or weight.shape[0] == 0 or k == 0:
        raise ValueError(f"weight {tuple(weight.shape)} does not take x of {k} columns")
    if tuple(norm_weight.shape) != (k,):
        raise ValueError(f"norm_weight must have shape ({k},), got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}")
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("norm_weight", norm_weight)):
        if t is not None and (t.stride(-1) != 1 or t.device != x.device):
            raise ValueError(f"{name} must be on {x.device} with unit stride in its last dimension")


def _check_rotary(rotary: RotaryCache, m: int, n: int, dtype: torch.dtype) -> None:
    d, hq, hkv = rotary.head_dim, rotary.num_q_heads, rotary.num_kv_heads
    if n != (hq + 2 * hkv) * d or d % 2:
        raise ValueError(f"weight has {n} rows, not (q heads + 2 kv heads) x head_dim = {(hq + 2 * hkv) * d}")
    for name in ("key_cache", "value_cache"):
        cache = getattr(rotary, name)
        if cache.dtype != dtype or not cache.is_contiguous() or tuple(cache.shape[-2:]) != (hkv, d):
            raise ValueError(
                f"{name} must be a contiguous [..., {hkv}, {d}] {dtype} cache, got {tuple(cache.shape)}"
            )
    if rotary.positions.shape[0] < m or rotary.slot_mapping.shape[0] < m:
        raise ValueError(f"positions and slot_mapping must cover the {m} rows")
    if rotary.cos.shape[-1] != d // 2 or rotary.sin.shape != rotary.cos.shape:
        raise ValueError(f"cos/sin tables must have head_dim / 2 = {d // 2} columns")


def norm_small_m_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    rotary: RotaryCache | None = None,
    config: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x + residual) @ weight.T`` and the new residual ``x + residual``, in one kernel.

    ``x`` (and ``residual``, when not None) is ``[M, K]`` with 1 <= M <= :data:`NORM_FUSE_MAX_M`;
    ``weight`` ``[N, K]`` with contiguous rows. Without a residual the norm applies to ``x``
    and ``x`` itself is returned as the residual. With ``rotary`` the weight is a fused
    qkv projection and the kernel also rotates q and k and writes k and v to the cache.
    ``config`` pins the meta-parameters (tests); None autotunes on a GPU.
    """
    _check(x, residual, norm_weight, weight)
    m, k = x.shape
    n = weight.shape[0]
    if rotary is not None:
        _check_rotary(rotary, m, n, x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    d = rotary.head_dim if rotary is not None else 2
    if rotary is not None:
        r = rotary
        extra = (r.positions, r.cos, r.sin, r.slot_mapping, r.key_cache, r.value_cache)
        num_rot_cols, kv_dim = (r.num_q_heads + r.num_kv_heads) * d, r.num_kv_heads * d
    else:
        extra = (x,) * 6  # unused pointers
        num_rot_cols, kv_dim = 0, 0
    res = x if residual is None else residual
    args = (x, res, res_out, norm_weight, weight, out, *extra)
    args += (n, k, eps, x.stride(0), res.stride(0), weight.stride(0), out.stride(0), num_rot_cols)
    const = dict(M=m, HAS_RES=residual is not None, ROTARY=rotary is not None, KV_DIM=kv_dim, HEAD_DIM=d)
    const.update(pdl_kwargs(x))
    tuned = config is None and not triton_interpreting()
    if rotary is not None and not tuned:
        if config is None:  # the interpreter's configuration, narrowed to the head size
            config = {**_INTERPRETER_CONFIG, "BLOCK_N": min(_INTERPRETER_CONFIG["BLOCK_N"], d)}
        if (d // 2) % (config["BLOCK_N"] // 2):
            raise ValueError(f"BLOCK_N {config['BLOCK_N']} splits the head halves of head_dim {d}")
    launch(_tuned_kernel, _kernel, n, args, const, config, _INTERPRETER_CONFIG)
    if tuned and x.is_cuda and not torch.cuda.is_current_stream_capturing():
        _warmed.add(_warm_key(x, weight, residual is not None, rotary))
    return out, res_out
