// Paged decode attention for x86-64 CPUs with AVX-512 or AVX2 (cpu_vec.h): one query token per
// request, read in place from the NHD paged KV cache (no gathered copy), float accumulation,
// parallel over (request, kv head); head_dim is a template parameter so accumulators live in
// registers. Built on first use by fastdeploy/ops/cpu_ops.py; on a CPU with neither ISA the
// build is not tried and the torch path is used.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <math.h>

#include <algorithm>
#include <vector>

#include "cpu_vec.h"

namespace {
using namespace fd_cpu;

constexpr int64_t GB = 4;  // query heads of a GQA group accumulated together (registers)

// One (request, kv head): scores for every cached key, softmax, weighted sum of values.
// C = head_dim / 16 is a template parameter so that the accumulators stay in registers.
template <typename T, int C>
void decode_item(T* out, const T* q, const T* kc, const T* vc, const int32_t* blocks, int64_t len, int64_t h,
                 int64_t G, int64_t KVH, int64_t BS, float scale, std::vector<float>& scores) {
  constexpr int64_t D = 16 * C;
  const int64_t row_stride = KVH * D;
  scores.resize(G * len);
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t nb = std::min<int64_t>(GB, G - g0);
    vf16 qv[GB][C];
    for (int64_t b = 0; b < GB; ++b)
      for (int c = 0; c < C; ++c) qv[b][c] = b < nb ? mul(load16(q + (g0 + b) * D + c * 16), set1(scale)) : zero16();
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += BS, ++blk) {
      const T* k = kc + (int64_t(blocks[blk]) * BS * KVH + h) * D;
      const int64_t n = std::min(BS, len - t0);
      for (int64_t o = 0; o < n; ++o, k += row_stride) {
        vf16 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load16(k + c * 16);
        for (int64_t b = 0; b < nb; ++b) {
          vf16 s = mul(qv[b][0], kv[0]);
          for (int c = 1; c < C; ++c) s = fmadd(qv[b][c], kv[c], s);
          scores[(g0 + b) * len + t0 + o] = reduce_add(s);
        }
      }
    }
    for (int64_t b = 0; b < nb; ++b) {
      float* s = scores.data() + (g0 + b) * len;
      vf16 mx = set1(-3.0e38f);
      for (int64_t t = 0; t < len; t += 16) mx = max_where(tail_mask(len - t), mx, load16(s + t, tail_mask(len - t)));
      const vf16 m = set1(reduce_max(mx));
      vf16 sum = zero16();
      for (int64_t t = 0; t < len; t += 16) {
        const tail16 tm = tail_mask(len - t);
        const vf16 e = zero_beyond(tm, exp16(sub(load16(s + t, tm), m)));
        store16(s + t, e, tm);
        sum = add(sum, e);
      }
      const float inv = 1.f / reduce_add(sum);
      for (int64_t t = 0; t < len; t += 16) store16(s + t, mul(load16(s + t, tail_mask(len - t)), set1(inv)), tail_mask(len - t));
    }
    vf16 acc[GB][C];
    for (int64_t b = 0; b < GB; ++b)
      for (int c = 0; c < C; ++c) acc[b][c] = zero16();
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += BS, ++blk) {
      const T* v = vc + (int64_t(blocks[blk]) * BS * KVH + h) * D;
      const int64_t n = std::min(BS, len - t0);
      for (int64_t o = 0; o < n; ++o, v += row_stride) {
        vf16 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = load16(v + c * 16);
        for (int64_t b = 0; b < nb; ++b) {
          const vf16 p = set1(scores[(g0 + b) * len + t0 + o]);
          for (int c = 0; c < C; ++c) acc[b][c] = fmadd(p, vv[c], acc[b][c]);
        }
      }
    }
    for (int64_t b = 0; b < nb; ++b)
      for (int c = 0; c < C; ++c) store16(out + (g0 + b) * D + c * 16, acc[b][c]);
  }
}

template <typename T, int C>
void decode_kernel(T* out, const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens,
                   const int64_t* token_idx, int64_t q_stride, int64_t out_stride, int64_t R, int64_t H,
                   int64_t KVH, int64_t BS, int64_t MB, float scale) {
  constexpr int64_t D = 16 * C;
  const int64_t G = H / KVH;
  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / KVH, h = item % KVH;
      decode_item<T, C>(out + token_idx[r] * out_stride + h * G * D, q + token_idx[r] * q_stride + h * G * D, kc, vc,
                        bt + r * MB, lens[r], h, G, KVH, BS, scale, scores);
    }
  });
}

template <typename T>
void decode_dispatch(T* out, const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens,
                     const int64_t* token_idx, int64_t q_stride, int64_t out_stride, int64_t R, int64_t H, int64_t KVH,
                     int64_t D, int64_t BS, int64_t MB, float scale) {
  switch (D) {
    case 64:
      return decode_kernel<T, 4>(out, q, kc, vc, bt, lens, token_idx, q_stride, out_stride, R, H, KVH, BS, MB, scale);
    case 128:
      return decode_kernel<T, 8>(out, q, kc, vc, bt, lens, token_idx, q_stride, out_stride, R, H, KVH, BS, MB, scale);
    case 256:
      return decode_kernel<T, 16>(out, q, kc, vc, bt, lens, token_idx, q_stride, out_stride, R, H, KVH, BS, MB, scale);
    default:
      TORCH_CHECK(false, "paged_decode_attention: head_dim must be 64, 128 or 256, got ", D);
  }
}

bool heads_packed(const torch::Tensor& t) { return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2); }
}  // namespace

// out, q: [tokens, heads, head_dim] (rows may be strided); caches: [blocks, block_size, kv_heads,
// head_dim]; block_table: [reqs, max_blocks] int32; seq_lens: [reqs] int32 (context incl. the query
// token); token_idx: [reqs] int64, the row of q and out that belongs to each request.
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor bt,
                            torch::Tensor lens, torch::Tensor token_idx, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(heads_packed(q) && heads_packed(out) && out.sizes() == q.sizes(),
              "q and out must be [tokens, heads, head_dim] with packed heads");
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes(), "key and value caches must be equal NHD tensors");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && q.scalar_type() == out.scalar_type() &&
                  q.scalar_type() == vc.scalar_type(),
              "q, out and the caches must share one dtype");
  TORCH_CHECK(bt.scalar_type() == torch::kInt32 && lens.scalar_type() == torch::kInt32 &&
                  token_idx.scalar_type() == torch::kInt64,
              "block_table and seq_lens must be int32, token_idx int64");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && bt.is_contiguous() && lens.is_contiguous() &&
                  token_idx.is_contiguous(),
              "caches, block_table, seq_lens and token_idx must be contiguous");
  const int64_t R = bt.size(0), H = q.size(1), D = q.size(2), BS = kc.size(1), KVH = kc.size(2), MB = bt.size(1);
  TORCH_CHECK(kc.size(3) == D && (D == 64 || D == 128 || D == 256), "head_dim must match the cache and be 64, 128 or 256");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(lens.size(0) == R && token_idx.size(0) == R, "one block table row, length and token index per request");
  const int64_t* ti = token_idx.data_ptr<int64_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ti[r] >= 0 && ti[r] < q.size(0), "token_idx ", ti[r], " is outside q's ", q.size(0), " rows");
    TORCH_CHECK(lp[r] > 0 && lp[r] <= MB * BS, "seq_len ", lp[r], " does not fit the block table");
  }
  if (q.scalar_type() == torch::kFloat32) {
    decode_dispatch<float>(out.data_ptr<float>(), q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                           bt.data_ptr<int32_t>(), lp, ti, q.stride(0), out.stride(0), R, H, KVH, D, BS, MB, scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    auto p = [](const torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>()); };
    decode_dispatch<bf16>(p(out), p(q), p(kc), p(vc), bt.data_ptr<int32_t>(), lp, ti, q.stride(0), out.stride(0), R,
                          H, KVH, D, BS, MB, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
}
