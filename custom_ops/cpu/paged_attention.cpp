// Paged decode attention for x86-64 CPUs with AVX-512: one query token per request, read in
// place from the NHD paged KV cache (no gathered copy), float accumulation, parallel over
// (request, kv head). Built on first use by fastdeploy/ops/cpu_ops.py; without AVX-512 the
// build fails and the torch path is used.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <math.h>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { uint32_t b = uint32_t(*p) << 16; float f; std::memcpy(&f, &b, 4); return f; }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) {
  uint32_t b; std::memcpy(&b, &v, 4); b += 0x7FFF + ((b >> 16) & 1); *p = uint16_t(b >> 16);
}

template <typename T>
void decode_kernel(T* out, const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens,
                   int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale) {
  const int64_t G = H / KVH, C = D / 16;
  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores;
    std::vector<__m512> acc(G * C);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / KVH, h = item % KVH, len = lens[r];
      const int32_t* blocks = bt + r * MB;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load1(q + (r * H + h * G + g) * D + d) * scale;
      scores.resize(G * len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = int64_t(blocks[t / BS]) * BS + t % BS;
        const T* k = kc + (slot * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          __m512 s = _mm512_setzero_ps();
          for (int64_t c = 0; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(&qf[g * D + c * 16]), load16(k + c * 16), s);
          scores[g * len + t] = _mm512_reduce_add_ps(s);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * len;
        const float m = *std::max_element(s, s + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) { s[t] = expf(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = int64_t(blocks[t / BS]) * BS + t % BS;
        const T* v = vc + (slot * KVH + h) * D;
        for (int64_t c = 0; c < C; ++c) {
          const __m512 vv = load16(v + c * 16);
          for (int64_t g = 0; g < G; ++g)
            acc[g * C + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + t]), vv, acc[g * C + c]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        alignas(64) float tmp[16];
        for (int64_t c = 0; c < C; ++c) {
          _mm512_store_ps(tmp, acc[g * C + c]);
          T* o = out + (r * H + h * G + g) * D + c * 16;
          for (int i = 0; i < 16; ++i) store1(o + i, tmp[i]);
        }
      }
    }
  });
}
}  // namespace

// out, q: [reqs, heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim];
// block_table: [reqs, max_blocks] int32; seq_lens: [reqs] int32 (context incl. the query token).
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                            torch::Tensor bt, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [reqs, heads, head_dim]");
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes(), "key and value caches must be equal NHD tensors");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && q.scalar_type() == out.scalar_type() &&
                  q.scalar_type() == vc.scalar_type(),
              "q, out and the caches must share one dtype");
  TORCH_CHECK(bt.scalar_type() == torch::kInt32 && lens.scalar_type() == torch::kInt32,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() &&
                  bt.is_contiguous() && lens.is_contiguous(),
              "all tensors must be contiguous");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), BS = kc.size(1), KVH = kc.size(2), MB = bt.size(1);
  TORCH_CHECK(kc.size(3) == D && D % 16 == 0, "head_dim must match the cache and be a multiple of 16");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(bt.size(0) == R && lens.size(0) == R, "one block table row and one length per request");
  if (q.scalar_type() == torch::kFloat32) {
    decode_kernel<float>(out.data_ptr<float>(), q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                         bt.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), R, H, KVH, D, BS, MB, scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    auto p = [](torch::Tensor t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    decode_kernel<uint16_t>(p(out), p(q), p(kc), p(vc), bt.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), R, H, KVH, D,
                            BS, MB, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, AVX-512)");
}
