// Paged prefill attention for x86-64 CPUs with AVX-512 or AVX2 (cpu_vec.h): query chunks of any
// length that sit at the end of their sequence (fresh prompts and chunked prefill with cached
// context), GQA, keys and values read in place from the NHD paged cache (this step's keys are
// already written).
// Flash-style: per (request, kv head, tile of 16 query tokens), each key tile of 16 is transposed
// once, and the query heads of the group take 16 scores each with plain FMAs (several rows at a
// time for independent FMA chains); softmax is online in float32. An optional per-token key
// limit replaces the causal bound (attention mask offsets).
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <math.h>

#include <algorithm>
#include <vector>

#include "cpu_vec.h"

namespace {
using namespace fd_cpu;

constexpr int64_t TILE = 16;
constexpr int64_t RB = 4;          // query heads of a group scored together
constexpr float MASKED = -1e30f;  // not -inf: the build uses -ffast-math

struct WorkItem {
  int64_t req, kv_head, first;  // first query index of the tile within the request's chunk
};

struct RowState {
  float max = MASKED, sum = 0.f;
};

// Online-softmax update of one query row with the scores of one key tile (masked lanes excluded).
template <int C>
inline void update_row(RowState& st, float* o, vf16 scores, tail16 vis, const float* vt, int64_t visible) {
  constexpr int64_t D = 16 * C;
  const vf16 sc = select(vis, scores, set1(MASKED));
  const float m_new = std::max(st.max, reduce_max(sc));
  const float correction = expf(st.max - m_new);
  const vf16 pv = zero_beyond(vis, exp16(sub(sc, set1(m_new))));
  alignas(64) float p[TILE];
  store16(p, pv);
  st.sum = st.sum * correction + reduce_add(pv);
  st.max = m_new;
  const vf16 corr = set1(correction);
  vf16 a[C];  // one accumulator per 16 lanes of head_dim: independent FMA chains in registers
  for (int64_t c = 0; c < C; ++c) a[c] = mul(load16(o + c * 16), corr);
  for (int64_t j = 0; j < visible; ++j) {
    const vf16 pj = set1(p[j]);
    for (int64_t c = 0; c < C; ++c) a[c] = fmadd(pj, load16(vt + j * D + c * 16), a[c]);
  }
  for (int64_t c = 0; c < C; ++c) store16(o + c * 16, a[c]);
}

template <typename T, int C>
void prefill_kernel(T* out, const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* seq_lens,
                    const int64_t* q_start, const int32_t* q_lens, const int32_t* limits, int64_t q_stride,
                    int64_t out_stride, int64_t R, int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale) {
  constexpr int64_t D = 16 * C;
  const int64_t G = H / KVH;
  std::vector<WorkItem> items;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t first = 0; first < q_lens[r]; first += TILE) items.push_back({r, h, first});
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * TILE * D), acc(G * TILE * D), kt(D * TILE), vt(TILE * D);
    std::vector<RowState> state(G * TILE);
    for (int64_t w = begin; w < end; ++w) {
      const WorkItem it = items[w];
      const int64_t seq = seq_lens[it.req], context = seq - q_lens[it.req];
      const int64_t rows = std::min<int64_t>(TILE, q_lens[it.req] - it.first);
      const int32_t* blocks = bt + it.req * MB;
      int64_t limit[TILE], key_end = 0;
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t token = q_start[it.req] + it.first + i;
        const int64_t causal = context + it.first + i + 1;
        limit[i] = std::min<int64_t>(seq, limits ? std::max<int64_t>(limits[token], 1) : causal);
        key_end = std::max(key_end, limit[i]);
        for (int64_t g = 0; g < G; ++g) {
          const T* src = q + token * q_stride + (it.kv_head * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qf[(g * TILE + i) * D + d] = to_float(src[d]) * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(state.begin(), state.end(), RowState{});
      for (int64_t k0 = 0; k0 < key_end; k0 += TILE) {
        const int64_t keys = std::min<int64_t>(TILE, key_end - k0);
        for (int64_t j = 0; j < TILE; ++j) {
          if (j >= keys) {
            for (int64_t d = 0; d < D; ++d) kt[d * TILE + j] = 0.f;
            continue;
          }
          const int64_t t = k0 + j, slot = int64_t(blocks[t / BS]) * BS + t % BS;
          const T* k = kc + (slot * KVH + it.kv_head) * D;
          const T* v = vc + (slot * KVH + it.kv_head) * D;
          for (int64_t d = 0; d < D; ++d) kt[d * TILE + j] = to_float(k[d]);
          for (int64_t c = 0; c < D; c += 16) store16(&vt[j * D + c], load16(v + c));
        }
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t visible = std::min<int64_t>(keys, limit[i] - k0);
          if (visible <= 0) continue;
          for (int64_t g0 = 0; g0 < G; g0 += RB) {
            const int64_t nb = std::min<int64_t>(RB, G - g0);
            // always four rows (a short group repeats its last head) so the chains stay in registers
            const float* q0 = &qf[((g0 + 0) * TILE + i) * D];
            const float* q1 = &qf[(std::min(g0 + 1, G - 1) * TILE + i) * D];
            const float* q2 = &qf[(std::min(g0 + 2, G - 1) * TILE + i) * D];
            const float* q3 = &qf[(std::min(g0 + 3, G - 1) * TILE + i) * D];
            vf16 s0 = zero16(), s1 = s0, s2 = s0, s3 = s0;
            for (int64_t d = 0; d < D; ++d) {
              const vf16 kd = load16(&kt[d * TILE]);
              s0 = fmadd(set1(q0[d]), kd, s0);
              s1 = fmadd(set1(q1[d]), kd, s1);
              s2 = fmadd(set1(q2[d]), kd, s2);
              s3 = fmadd(set1(q3[d]), kd, s3);
            }
            const vf16 s[RB] = {s0, s1, s2, s3};
            for (int64_t b = 0; b < nb; ++b) {
              const int64_t row = (g0 + b) * TILE + i;
              update_row<C>(state[row], &acc[row * D], s[b], tail_mask(visible), vt.data(), visible);
            }
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t token = q_start[it.req] + it.first + i;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = g * TILE + i;
          const vf16 inv = set1(state[row].sum > 0.f ? 1.f / state[row].sum : 0.f);
          T* o = out + token * out_stride + (it.kv_head * G + g) * D;
          for (int64_t c = 0; c < D; c += 16) store16(o + c, mul(load16(&acc[row * D + c]), inv));
        }
      }
    }
  });
}

template <typename T>
void prefill_dispatch(T* out, const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* seq_lens,
                      const int64_t* q_start, const int32_t* q_lens, const int32_t* limits, int64_t q_stride,
                      int64_t out_stride, int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB,
                      float scale) {
  if (D == 64)
    prefill_kernel<T, 4>(out, q, kc, vc, bt, seq_lens, q_start, q_lens, limits, q_stride, out_stride, R, H, KVH, BS, MB, scale);
  else if (D == 128)
    prefill_kernel<T, 8>(out, q, kc, vc, bt, seq_lens, q_start, q_lens, limits, q_stride, out_stride, R, H, KVH, BS, MB, scale);
  else
    prefill_kernel<T, 16>(out, q, kc, vc, bt, seq_lens, q_start, q_lens, limits, q_stride, out_stride, R, H, KVH, BS, MB, scale);
}

bool heads_packed(const torch::Tensor& t) { return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2); }
}  // namespace

// out, q: [tokens, heads, head_dim] (rows may be strided); caches: [blocks, block_size, kv_heads,
// head_dim]; block_table: [reqs, max_blocks] int32; seq_lens: [reqs] int32 (context incl. this
// chunk); q_start: [reqs] int64 first row of each request's chunk; q_lens: [reqs] int32 its
// length; limits: [tokens] int32 exclusive key limit per token, or an empty tensor for causal.
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor bt,
                             torch::Tensor seq_lens, torch::Tensor q_start, torch::Tensor q_lens, torch::Tensor limits,
                             double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_prefill_attention: CPU tensors only");
  TORCH_CHECK(heads_packed(q) && heads_packed(out) && out.sizes() == q.sizes(),
              "q and out must be [tokens, heads, head_dim] with packed heads");
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.is_contiguous() && vc.is_contiguous(),
              "key and value caches must be equal contiguous NHD tensors");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && q.scalar_type() == out.scalar_type() &&
                  q.scalar_type() == vc.scalar_type(),
              "q, out and the caches must share one dtype");
  TORCH_CHECK(bt.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  q_lens.scalar_type() == torch::kInt32 && q_start.scalar_type() == torch::kInt64,
              "block_table, seq_lens and q_lens must be int32, q_start int64");
  TORCH_CHECK(bt.is_contiguous() && seq_lens.is_contiguous() && q_start.is_contiguous() && q_lens.is_contiguous(),
              "block_table, seq_lens, q_start and q_lens must be contiguous");
  const int64_t R = bt.size(0), T = q.size(0), H = q.size(1), D = q.size(2), BS = kc.size(1), KVH = kc.size(2),
                MB = bt.size(1);
  TORCH_CHECK(kc.size(3) == D && (D == 64 || D == 128 || D == 256), "head_dim must match the cache and be 64, 128 or 256");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(seq_lens.size(0) == R && q_start.size(0) == R && q_lens.size(0) == R,
              "one block table row, seq_len, q_start and q_len per request");
  const bool has_limits = limits.numel() > 0;
  if (has_limits)
    TORCH_CHECK(limits.scalar_type() == torch::kInt32 && limits.dim() == 1 && limits.size(0) >= T &&
                    limits.is_contiguous(),
                "limits must be int32 [tokens] or empty");
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* ql = q_lens.data_ptr<int32_t>();
  const int64_t* qs = q_start.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ql[r] > 0 && ql[r] <= sl[r] && sl[r] <= MB * BS, "request ", r, ": q_len ", ql[r], ", seq_len ",
                sl[r], " do not fit the block table");
    TORCH_CHECK(qs[r] >= 0 && qs[r] + ql[r] <= T, "request ", r, ": rows ", qs[r], "+", ql[r], " outside q");
  }
  const int32_t* lim = has_limits ? limits.data_ptr<int32_t>() : nullptr;
  if (q.scalar_type() == torch::kFloat32) {
    prefill_dispatch<float>(out.data_ptr<float>(), q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                            bt.data_ptr<int32_t>(), sl, qs, ql, lim, q.stride(0), out.stride(0), R, H, KVH, D, BS, MB,
                            scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    auto p = [](const torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>()); };
    prefill_dispatch<bf16>(p(out), p(q), p(kc), p(vc), bt.data_ptr<int32_t>(), sl, qs, ql, lim, q.stride(0),
                           out.stride(0), R, H, KVH, D, BS, MB, scale);
  } else {
    TORCH_CHECK(false, "paged_prefill_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
}
