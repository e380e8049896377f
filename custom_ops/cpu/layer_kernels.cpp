// Fused element-wise kernels of the decoder layer for CPUs (float32 / bfloat16), so that each
// step issues one call where the torch fallback issues five to fifteen: RMSNorm (with the
// residual add), rotary embedding in place, SiLU-and-multiply, and the paged KV-cache write.
// Arithmetic is float32 with the same rounding points as the torch fallback in
// fastdeploy/ops/layer_ops.py.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <math.h>

#include "cpu_vec.h"

namespace {
using namespace fd_cpu;

// grain (rows per task) so that a task holds at least ~16k elements
inline int64_t grain_for(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  vf16 acc = zero16();
  for (int64_t i = 0; i < n; i += 16) {
    vf16 v = load16(x + i, tail_mask(n - i));
    acc = fmadd(v, v, acc);
  }
  const vf16 inv = set1(1.f / std::sqrt(reduce_add(acc) / float(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const tail16 m = tail_mask(n - i);
    vf16 normed = round_as(x, mul(load16(x + i, m), inv));
    store16(out + i, mul(load16(w + i, m), normed), m);
  }
}

template <typename T>
void rms_norm_impl(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), os = out.stride(0);
  T* o = reinterpret_cast<T*>(out.data_ptr());
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  at::parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(o + r * os, xp + r * xs, wp, n, float(eps));
  });
}

template <typename T>
void fused_add_rms_norm_impl(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  T* xp = reinterpret_cast<T*>(x.data_ptr());
  T* rp = reinterpret_cast<T*>(residual.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  at::parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      for (int64_t i = 0; i < n; i += 16) {
        const tail16 m = tail_mask(n - i);
        store16(rr + i, add(load16(xr + i, m), load16(rr + i, m)), m);
      }
      rms_norm_row(xr, rr, wp, n, float(eps));
    }
  });
}

template <typename T>
void rotary_impl(const torch::Tensor& positions, torch::Tensor& qkv, const torch::Tensor& cos,
                 const torch::Tensor& sin, int64_t rotated_heads, int64_t head_dim) {
  const int64_t rows = positions.size(0), rs = qkv.stride(0), half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* base = reinterpret_cast<T*>(qkv.data_ptr());
  at::parallel_for(0, rows, grain_for(rotated_heads * head_dim), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* c = cp + pos[r] * half;
      const float* s = sp + pos[r] * half;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        T* x = base + r * rs + h * head_dim;
        for (int64_t i = 0; i < half; i += 16) {
          const tail16 m = tail_mask(half - i);
          // cos/sin are rounded to the activation dtype first, as in the torch fallback
          const vf16 cv = round_as(x, load16(c + i, m)), sv = round_as(x, load16(s + i, m));
          const vf16 x1 = load16(x + i, m), x2 = load16(x + half + i, m);
          store16(x + i, sub(mul(x1, cv), mul(x2, sv)), m);
          store16(x + half + i, add(mul(x2, cv), mul(x1, sv)), m);
        }
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(torch::Tensor& out, const torch::Tensor& gate_up) {
  const int64_t rows = out.size(0), n = out.size(1), gs = gate_up.stride(0), os = out.stride(0);
  T* o = reinterpret_cast<T*>(out.data_ptr());
  const T* g = reinterpret_cast<const T*>(gate_up.data_ptr());
  at::parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* gr = g + r * gs;
      T* orow = o + r * os;
      for (int64_t i = 0; i < n; i += 16) {
        const tail16 m = tail_mask(n - i);
        const vf16 x = load16(gr + i, m);
        const vf16 silu = div(x, add(set1(1.f), exp16(sub(zero16(), x))));
        store16(orow + i, mul(round_as(orow, silu), load16(gr + n + i, m)), m);
      }
    }
  });
}

template <typename T>
void cache_write_impl(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots) {
  const int64_t tokens = slots.size(0), heads = src.size(1), dim = src.size(2);
  const int64_t ts = src.stride(0), hs = src.stride(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const T* s = reinterpret_cast<const T*>(src.data_ptr());
  T* c = reinterpret_cast<T*>(cache.data_ptr());
  at::parallel_for(0, tokens, grain_for(heads * dim), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (sp[t] < 0) continue;
      T* dst = c + sp[t] * heads * dim;
      for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + h * dim, s + t * ts + h * hs, dim * sizeof(T));
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with unit stride in the last dimension");
}

template <typename Fn>
void by_dtype(const torch::Tensor& t, const char* op, Fn&& fn) {
  if (t.scalar_type() == torch::kFloat32) {
    fn(float{});
  } else if (t.scalar_type() == torch::kBFloat16) {
    fn(bf16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 only, got ", t.scalar_type());
  }
}
}  // namespace

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: out must match x [rows, n] and weight must be [n]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: out, x and weight must share one dtype");
  by_dtype(x, "rms_norm", [&](auto tag) { rms_norm_impl<decltype(tag)>(out, x, weight, eps); });
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              "fused_add_rms_norm: residual must match x [rows, n] and weight must be [n]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm: x, residual and weight must share one dtype");
  by_dtype(x, "fused_add_rms_norm", [&](auto tag) { fused_add_rms_norm_impl<decltype(tag)>(x, residual, weight, eps); });
}

void rotary_embedding(torch::Tensor positions, torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                      int64_t rotated_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.size(0) == qkv.size(0),
              "rotary_embedding: positions must be int64 [rows] matching qkv");
  TORCH_CHECK(head_dim % 2 == 0 && rotated_heads * head_dim <= qkv.size(1), "rotary_embedding: bad head layout");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == head_dim / 2 && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos/sin must be float32 [max_position, head_dim / 2]");
  by_dtype(qkv, "rotary_embedding", [&](auto tag) { rotary_impl<decltype(tag)>(positions, qkv, cos, sin, rotated_heads, head_dim); });
}

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1) &&
                  gate_up.scalar_type() == out.scalar_type(),
              "silu_and_mul: gate_up must be [rows, 2n] of out's dtype for out [rows, n]");
  by_dtype(out, "silu_and_mul", [&](auto tag) { silu_and_mul_impl<decltype(tag)>(out, gate_up); });
}

void write_cache(torch::Tensor src, torch::Tensor cache, torch::Tensor slots) {
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1 && cache.dim() == 4 && cache.is_contiguous(),
              "write_cache: src [tokens, heads, dim] (unit last stride) and a contiguous NHD cache");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) <= src.size(0),
              "write_cache: slots must be int64 [tokens]");
  TORCH_CHECK(src.scalar_type() == cache.scalar_type(), "write_cache: src and cache must share one dtype");
  TORCH_CHECK(cache.size(2) == src.size(1) && cache.size(3) == src.size(2), "write_cache: heads/head_dim differ from the cache's");
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(sp[t] < num_slots, "write_cache: slot ", sp[t], " is outside the cache's ", num_slots, " slots");
  by_dtype(src, "write_cache", [&](auto tag) { cache_write_impl<decltype(tag)>(src, cache, slots); });
}
