"""Paged attention in Triton: a unified kernel for any batch and a split-KV decode kernel.

Both read the NHD paged cache (``[num_blocks, block_size, kv_heads, head_dim]``) in place
through the block table, support GQA (every program serves one KV head and all the query
heads that share it), fp8_e4m3 caches with per-slot scales, and optional per-token mask
limits. Softmax is online, in fp32 and base 2 (``qk_scale`` carries ``log2(e)``).

* ``unified_attention``: grid ``(num_tokens // BLOCK_Q + num_reqs, kv_heads)``; a program
  finds its request by binary search over ``query_start_loc`` and attends ``BLOCK_Q`` of
  its query tokens (``BLOCK_M = BLOCK_Q * group`` rows) over their visible keys.
* ``decode_attention``: one query token per request; grid ``(num_reqs, kv_heads, splits)``.
  Each split takes an equal, tile-aligned share of its sequence (computed in the kernel
  from ``seq_lens``), and a reduction kernel merges the splits by their log-sum-exp.

Nothing here reads a device value on the host, so the launches are graph-capturable.
Under ``TRITON_INTERPRET=1`` (CPU tests) matrix products run in fp32, because the
interpreter's ``tl.dot`` mishandles bf16 operands; operands are still rounded to the
query dtype first, so the numerics match the GPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.ops.triton_env import triton_interpreting
from fastdeploy.ops.triton_pdl import pdl_kwargs, pdl_prologue, pdl_trigger

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256
"""Decode splits are only added while each still covers this many tokens of the static bound."""
MAX_SPLITS = 16
SPLIT_INTERIOR = True
"""Whether the unified kernel walks the key tiles that every row sees in full without masks, then
the rest (the causal diagonal) masked (``benchmarks/gpubench/attention_sweep.py --prefill`` times
both; docs/benchmarks.md, twenty-ninth session)."""
LONGEST_FIRST = True
"""Whether the unified kernel's programs take the query blocks in reverse order, each request's last
(longest under the causal mask) first, so that the last wave holds the shortest."""
DECODE_INTERIOR_BELOW_PROGRAMS = 1024
"""Decode grids of fewer programs walk a split's whole key tiles without masks (only its last,
partial tile masked); larger grids (smaller tiles) mask every tile, which timed faster there."""
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _find_request(query_start_ptr, program, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose q-block range holds ``program`` (request i's blocks start at qsl[i] // BLOCK_Q + i)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32; operands widened to fp32 first under the interpreter."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_rows(ptrs, in_range, MASKED: tl.constexpr):
    """``ptrs`` (one row per key) loaded, the keys out of range as zeros when ``MASKED``."""
    if MASKED:
        return tl.load(ptrs, mask=in_range[:, None], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _load_keys(ptrs, in_range, MASKED: tl.constexpr):
    """One value per key (block ids, fp8 scales), those out of range as zeros when ``MASKED``."""
    if MASKED:
        return tl.load(ptrs, mask=in_range, other=0)
    return tl.load(ptrs)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, kv_end, limit, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_row_ptr, kv_head, block_size, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr = True,
):  # fmt: skip
    """One online-softmax step over keys ``start:start+TILE_N`` (those < kv_end; row r sees keys < limit[r]).
    ``MASKED=False``: every key of the tile is below ``kv_end`` and every row's limit (no masks)."""
    offs_n = start + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_n < kv_end
    block = _load_keys(block_row_ptr + offs_n // block_size, in_range, MASKED).to(tl.int64)
    slot = offs_n % block_size
    k_ptrs = (
        k_cache_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)[:, None] + offs_d[None, :]
    )
    k = _load_rows(k_ptrs, in_range, MASKED)
    s = _dot(q, tl.trans(k.to(q.dtype)), DOT_FP32, DOT_PRECISION) * qk_scale
    scale_off = block * stride_sb + slot * stride_ss + kv_head * stride_sh
    if FP8:
        s = s * _load_keys(k_scale_ptr + scale_off, in_range, MASKED)[None, :]
    if MASKED:
        s = tl.where(offs_n[None, :] < limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = (
        v_cache_ptr + (block * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None] + offs_d[None, :]
    )
    v = _load_rows(v_ptrs, in_range, MASKED)
    if FP8:  # P @ (v * v_scale) == (P * v_scale) @ v
        p = p * _load_keys(v_scale_ptr + scale_off, in_range, MASKED)[None, :]
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_FP32, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_keys(
    q, m_i, l_i, acc, first, full_end, kv_end, limit, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_row_ptr, kv_head, block_size, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_INTERIOR: tl.constexpr,
):  # fmt: skip
    """The online softmax over keys ``first:kv_end``, :func:`_attend_tile` by tile; with
    ``SPLIT_INTERIOR`` the tiles below ``full_end`` (every row sees all their keys) without masks."""
    masked_from = first
    if SPLIT_INTERIOR:
        for start in range(first, full_end, TILE_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, kv_end, limit, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                block_row_ptr, kv_head, block_size, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                TILE_N, HEAD_DIM, FP8, DOT_FP32, DOT_PRECISION, MASKED=False,
            )  # fmt: skip
        masked_from = full_end
    for start in range(masked_from, kv_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, kv_end, limit, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_row_ptr, kv_head, block_size, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
            TILE_N, HEAD_DIM, FP8, DOT_FP32, DOT_PRECISION,
        )  # fmt: skip
    return m_i, l_i, acc


# stride_bt is the width of the step's block table, trimmed to its longest request: were it
# specialized (== 1, % 16), a step whose width crossed a class would compile a new variant
# in the middle of serving; unspecialized, the start-up warm-up compiles every variant.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
def _unified_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr,
    query_start_ptr, limits_ptr, qk_scale, num_reqs, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, FP8: tl.constexpr, HAS_LIMITS: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, SPLIT_INTERIOR: tl.constexpr = False,
    LONGEST_FIRST: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    if LONGEST_FIRST:
        pid = tl.num_programs(0) - 1 - pid
    kv_head = tl.program_id(1)
    req = _find_request(query_start_ptr, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_local = q_block * BLOCK_Q + offs_m // GROUP
    valid = (offs_m // GROUP < BLOCK_Q) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    head = kv_head * GROUP + offs_m % GROUP
    if HAS_LIMITS:
        limit = tl.minimum(tl.load(limits_ptr + token, mask=valid, other=0), seq_len)
    else:
        limit = seq_len - q_len + q_local + 1
    limit = tl.where(valid, limit, 0)
    kv_end = tl.max(limit, 0)
    q = tl.load(
        q_ptr + (token * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    full_end = 0
    if SPLIT_INTERIOR:  # the whole tiles below every row's limit (the causal diagonal)
        full_end = tl.min(tl.where(valid, limit, kv_end), 0) // TILE_N * TILE_N
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, 0, full_end, kv_end, limit, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        block_row_ptr, kv_head, block_size, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
        TILE_N, HEAD_DIM, FP8, DOT_FP32, DOT_PRECISION, SPLIT_INTERIOR,
    )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (token * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid[:, None],
    )


@triton.jit(do_not_specialize=["stride_bt"])  # see _unified_kernel
def _decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_table_ptr, seq_lens_ptr, query_start_ptr, limits_ptr, qk_scale, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, stride_bt,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FP8: tl.constexpr, HAS_LIMITS: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, SPLIT_INTERIOR: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_ptr + req).to(tl.int64)
    limit = tl.load(seq_lens_ptr + req)
    if HAS_LIMITS:
        limit = tl.minimum(tl.load(limits_ptr + token), limit)
    split_len = tl.cdiv(tl.cdiv(limit, NUM_SPLITS), TILE_N) * TILE_N
    start = split * split_len
    end = tl.minimum(start + split_len, limit)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_h < GROUP
    head = kv_head * GROUP + offs_h
    q = tl.load(
        q_ptr + (token * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    row_limit = tl.zeros([BLOCK_H], tl.int32) + end
    block_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    full_end = start
    if SPLIT_INTERIOR:  # the split's whole tiles (only a last partial one needs masks)
        full_end = start + tl.maximum(end - start, 0) // TILE_N * TILE_N
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, start, full_end, end, row_limit, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        block_row_ptr, kv_head, block_size, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
        TILE_N, HEAD_DIM, FP8, DOT_FP32, DOT_PRECISION, SPLIT_INTERIOR,
    )  # fmt: skip
    pdl_trigger(USE_PDL)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + (token * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        part = (req.to(tl.int64) * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_ok)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_ptr + req).to(tl.int64)
    part = (req.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    lse = tl.load(part_lse_ptr + part)
    m = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    offs_d = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def decode_num_splits(num_reqs: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """KV splits per decode request: enough programs for ~2 waves on ``num_sms`` SMs, no more than
    ``max_kv_len // MIN_SPLIT_TOKENS`` and ``MAX_SPLITS``; a power of two. ``max_kv_len`` is a static
    bound (block table width * block size), so the result is stable across steps of one batch size."""
    want = -(-2 * num_sms // max(1, num_reqs * num_kv_heads))
    splits = max(1, min(want, max_kv_len // MIN_SPLIT_TOKENS, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def unified_config(dtype: torch.dtype, head_dim: int, group: int, max_query_len: int) -> dict[str, int]:
    """Tile sizes of the unified kernel: BLOCK_M query rows (BLOCK_Q tokens x group heads) by TILE_N keys.

    Prefill-heavy 16-bit steps take 128-row blocks (8 warps; head_dim <= 128) or 64-row blocks
    (4 warps) with two pipeline stages; other steps 16 rows. TILE_N * HEAD_DIM <= 4096 (2048 in
    fp32). Nothing spills on sm_90 (checked with the ptxas resource report). Measured on an H200
    (16 causal prompts of 512 tokens, 32 query / 8 KV heads of 128, bf16): 183 µs per call
    against 309 with the former 64 rows / 8 warps / 3 stages.
    """
    fp32 = dtype == torch.float32
    rows = max_query_len * group
    config = dict(TILE_N=max(16, (2048 if fp32 else 4096) // head_dim))
    if not fp32 and rows >= 128 and head_dim <= 128:
        config.update(BLOCK_M=128, num_warps=8, num_stages=2)
    elif not fp32 and rows >= 64:
        config.update(BLOCK_M=64, num_warps=8 if head_dim >= 256 else 4, num_stages=2)
    else:
        config.update(BLOCK_M=16, num_warps=8 if head_dim >= 256 else 4)
    config["BLOCK_M"] = max(config["BLOCK_M"], triton.next_power_of_2(group))
    config["BLOCK_Q"] = config["BLOCK_M"] // group
    config.update(SPLIT_INTERIOR=SPLIT_INTERIOR, LONGEST_FIRST=LONGEST_FIRST)
    return config


DECODE_SMALL_TILE_MIN_PROGRAMS = 1024
"""Decode grids of at least this many programs (requests x KV heads x splits) take 32-key tiles."""


def decode_config(dtype: torch.dtype, head_dim: int, group: int, programs: int = 0) -> dict[str, int]:
    """Tile sizes of the decode kernel: the group's heads (padded to >= 16 rows for tl.dot) by TILE_N keys.

    16-bit: two warps and two pipeline stages per program, so that many programs share an SM
    and keep loads in flight; 64-key tiles, or 32 once the grid has at least
    ``DECODE_SMALL_TILE_MIN_PROGRAMS`` programs. Measured on an H200 (bf16, 32 query / 8 KV heads
    of 128, blocks of 16; µs per call, the former 64 keys / 4 warps / 3 stages → these):
    batch 1 x 8k context (16 splits) 94.7 → 63.6, 64 x 2k 185.7 → 131.6, 128 x 1k 152.1 → 128.5,
    256 x 640 189.8 → 163.8, 256 x 2k 570.7 → 495.4 (4.33 TB/s of KV read); 16 x 2k unchanged.
    Eight or more query heads per KV head (32 / 4 heads of 128): four warps, 64-key tiles, or 128
    below ``DECODE_SMALL_TILE_MIN_PROGRAMS`` programs (``benchmarks/gpubench/attention_sweep.py``, H200:
    256 x 640 109.9 → 90.6 µs, 64 x 2k 100.7 → 71.1 µs with one split). Grids of fewer than
    ``DECODE_INTERIOR_BELOW_PROGRAMS`` programs walk the whole tiles without masks.
    """
    block_h = max(16, triton.next_power_of_2(group))
    interior = programs < DECODE_INTERIOR_BELOW_PROGRAMS
    if dtype == torch.float32:
        return dict(BLOCK_H=block_h, TILE_N=max(16, 2048 // head_dim), num_warps=4, SPLIT_INTERIOR=interior)
    many_programs = programs >= DECODE_SMALL_TILE_MIN_PROGRAMS
    if group >= 8:  # few KV heads (Qwen3-30B-A3B: 32/4): fewer, fuller programs take bigger tiles
        tile, warps = (64 if many_programs else 128), 4
    else:
        tile, warps = (32 if many_programs else 64), (2 if block_h * head_dim <= 16 * 128 else 4)
    return dict(
        BLOCK_H=block_h, TILE_N=min(tile, 8192 // head_dim), num_warps=warps, num_stages=2,
        SPLIT_INTERIOR=interior,
    )  # fmt: skip


def _common_args(q, key_cache, value_cache, k_scale, v_scale, block_table, scale) -> tuple[dict, list]:
    """Validates the inputs; returns the constexprs shared by both kernels and the cache arguments."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.dtype == torch.uint8:  # fp8 caches may be allocated as bytes
        key_cache, value_cache = key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"triton attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if q.dtype not in _DTYPES:
        raise TypeError(f"queries must be fp16/bf16/fp32, got {q.dtype}")
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if not fp8 and key_cache.dtype != q.dtype:
        raise TypeError(
            f"cache dtype {key_cache.dtype} must equal the query dtype {q.dtype} or be float8_e4m3fn"
        )
    if value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape:
        raise ValueError("key and value caches must have the same shape and dtype")
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of q and the caches must be contiguous")
    if fp8:
        if k_scale is None or v_scale is None:
            raise ValueError(
                "an fp8 cache needs k_scale and v_scale of shape [num_blocks, block_size, kv_heads]"
            )
        if (
            k_scale.shape != key_cache.shape[:3]
            or v_scale.shape != k_scale.shape
            or v_scale.stride() != k_scale.stride()
        ):
            raise ValueError(f"k_scale/v_scale must both be {tuple(key_cache.shape[:3])} with equal strides")
        scales, scale_strides = [k_scale.float(), v_scale.float()], list(k_scale.stride())
    else:
        scales, scale_strides = [key_cache, value_cache], [0, 0, 0]
    dot_fp32 = triton_interpreting()
    constexprs = dict(
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        FP8=fp8,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or dot_fp32 else "tf32",
    )
    strides = [*key_cache.stride()[:3], *value_cache.stride()[:3], *scale_strides, block_table.stride(0)]
    cache_args = [key_cache, value_cache, *scales]
    return constexprs, [scale * LOG2E, strides, cache_args]


def unified_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    mask_limits: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> None:
    """Attention for any batch (prefills, chunks with cached context, decodes) into ``out`` [T, Hq, D].

    Request ``i``'s query tokens ``query_start_loc[i]:[i+1]`` are the last of its ``seq_lens[i]``
    keys. ``mask_limits`` (int32 per token) is the exclusive bound of the keys a token sees;
    None means causal. The grid depends only on ``num_tokens``, ``num_reqs`` and the KV heads.
    ``config`` overrides :func:`unified_config`'s tile sizes (benchmark sweeps; ``BLOCK_M`` a
    multiple of the query heads per KV head, ``BLOCK_Q = BLOCK_M // group``).
    """
    if num_reqs == 0:
        return
    constexprs, (qk_scale, strides, caches) = _common_args(
        q, key_cache, value_cache, k_scale, v_scale, block_table, scale
    )
    config = config or unified_config(q.dtype, constexprs["HEAD_DIM"], constexprs["GROUP"], max_query_len)
    grid = (num_tokens // config["BLOCK_Q"] + num_reqs, key_cache.shape[2])
    _unified_kernel[grid](
        out, q, *caches, block_table, seq_lens, query_start_loc,
        mask_limits if mask_limits is not None else seq_lens,
        qk_scale, num_reqs, key_cache.shape[1], *q.stride()[:2], *out.stride()[:2], *strides,
        HAS_LIMITS=mask_limits is not None, **config, **constexprs, **pdl_kwargs(q),
    )  # fmt: skip


def decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    num_reqs: int,
    num_splits: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    mask_limits: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> None:
    """Flash-decoding for a batch where every request has exactly one query token.

    ``num_splits`` (a power of two, e.g. from :func:`decode_num_splits`) KV splits per request
    and KV head; with more than one, fp32 partial results are merged by a reduction kernel.
    The grid is ``(num_reqs, kv_heads, num_splits)``: no dependence on the sequence lengths.
    ``config`` overrides :func:`decode_config`'s tile sizes (benchmark sweeps).
    """
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if num_reqs == 0:
        return
    constexprs, (qk_scale, strides, caches) = _common_args(
        q, key_cache, value_cache, k_scale, v_scale, block_table, scale
    )
    num_heads, head_dim = q.shape[1:]
    part_out = part_lse = out
    if num_splits > 1:
        part_out = torch.empty(
            (num_reqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((num_reqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    grid = (num_reqs, key_cache.shape[2], num_splits)
    _decode_kernel[grid](
        out, part_out, part_lse, q, *caches, block_table, seq_lens, query_start_loc,
        mask_limits if mask_limits is not None else seq_lens,
        qk_scale, key_cache.shape[1], *q.stride()[:2], *out.stride()[:2], *strides,
        NUM_SPLITS=num_splits, HAS_LIMITS=mask_limits is not None,
        **(config or decode_config(q.dtype, head_dim, constexprs["GROUP"], num_reqs * key_cache.shape[2] * num_splits)),
        **constexprs, **pdl_kwargs(q),
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            out, part_out, part_lse, query_start_loc, *out.stride()[:2], HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            **pdl_kwargs(q),
        )  # fmt: skip
