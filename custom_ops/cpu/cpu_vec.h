// The 16-float vector the CPU kernels are written in, for two instruction sets:
//  - AVX-512 (F, BW, VL): vf16 is one __m512 and every op below is the single intrinsic (or
//    the short sequence) the kernels were first written with;
//  - AVX2 + FMA: vf16 is two __m256 halves; tails go through a 16-element stack buffer.
// The build uses -march=native, so the compiler's predefined macros pick one. Values are loaded
// from and stored to float32 or bfloat16 (raw uint16_t bits, round-to-nearest-even like torch).
// A tail16 says which of the 16 lanes are valid: the first n, n = elements left (tail_mask).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FD_CPU_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define FD_CPU_AVX512 0
#else
#error "the CPU kernels need AVX-512 (F, BW, VL) or AVX2 + FMA (compile with -march=native on such a CPU)"
#endif

namespace fd_cpu {

using bf16 = uint16_t;

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  uint32_t b = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

#if FD_CPU_AVX512

using vf16 = __m512;
using tail16 = __mmask16;

inline tail16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

inline vf16 zero16() { return _mm512_setzero_ps(); }
inline vf16 set1(float x) { return _mm512_set1_ps(x); }
inline vf16 add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
inline vf16 sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
inline vf16 mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
inline vf16 div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
inline vf16 min(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
inline vf16 max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
inline vf16 fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf16 fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float reduce_add(vf16 a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vf16 a) { return _mm512_reduce_max_ps(a); }
// valid lanes of t: a, others: b
inline vf16 select(tail16 t, vf16 a, vf16 b) { return _mm512_mask_blend_ps(t, b, a); }
// valid lanes of t: a, others: 0
inline vf16 zero_beyond(tail16 t, vf16 a) { return _mm512_maskz_mov_ps(t, a); }
// valid lanes of t: max(a, b), others: a
inline vf16 max_where(tail16 t, vf16 a, vf16 b) { return _mm512_mask_max_ps(a, t, a, b); }

// Unmasked loads are noticeably faster than all-ones masked ones on Zen 4: keep both.
inline vf16 load16(const float* p) { return _mm512_loadu_ps(p); }
inline vf16 load16(const float* p, tail16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline vf16 bf16_bits_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline vf16 load16(const bf16* p) { return bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf16 load16(const bf16* p, tail16 m) { return bf16_bits_to_float(_mm256_maskz_loadu_epi16(m, p)); }

// float → bfloat16 bits, round to nearest even; NaN stays NaN (bit tests survive -ffast-math).
inline __m256i to_bf16_bits(vf16 v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)),
                                          _mm512_set1_epi32(0x7F800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline void store16(float* p, vf16 v) { _mm512_storeu_ps(p, v); }
inline void store16(float* p, vf16 v, tail16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(bf16* p, vf16 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v)); }
inline void store16(bf16* p, vf16 v, tail16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }

inline vf16 round_nearest(vf16 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n
inline vf16 scale_by_pow2(vf16 p, vf16 n) { return _mm512_scalef_ps(p, n); }

// r[i] = sum of the 16 lanes of v[i]: a transposing reduction (15 adds instead of 16 full reductions).
inline vf16 transpose_sum16(const vf16* v) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
  __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // z[4 * lane + e] holds the sum of v[4 * e + lane]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

#else  // AVX2 + FMA: two 8-float halves

struct vf16 {
  __m256 lo, hi;
};
struct tail16 {
  int n;  // lanes [0, n) are valid, 0 < n <= 16
};

inline tail16 tail_mask(int64_t n) { return tail16{n >= 16 ? 16 : int(n)}; }

#define FD_CPU_HALVES(op) \
  inline vf16 op(vf16 a, vf16 b) { return vf16{_mm256_##op##_ps(a.lo, b.lo), _mm256_##op##_ps(a.hi, b.hi)}; }
FD_CPU_HALVES(add)
FD_CPU_HALVES(sub)
FD_CPU_HALVES(mul)
FD_CPU_HALVES(div)
FD_CPU_HALVES(min)
FD_CPU_HALVES(max)
#undef FD_CPU_HALVES

inline vf16 zero16() { return vf16{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf16 set1(float x) { return vf16{_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf16 fmadd(vf16 a, vf16 b, vf16 c) {  // a * b + c
  return vf16{_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf16 fnmadd(vf16 a, vf16 b, vf16 c) {  // c - a * b
  return vf16{_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}

inline float reduce8_add(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add(vf16 a) { return reduce8_add(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce_max(vf16 a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// all-ones 32-bit lanes where the lane index (0-7 in lo, 8-15 in hi) is below t.n
inline __m256 lanes_lo(tail16 t) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(t.n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline __m256 lanes_hi(tail16 t) {
  return _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(t.n), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)));
}
// valid lanes of t: a, others: b
inline vf16 select(tail16 t, vf16 a, vf16 b) {
  return vf16{_mm256_blendv_ps(b.lo, a.lo, lanes_lo(t)), _mm256_blendv_ps(b.hi, a.hi, lanes_hi(t))};
}
// valid lanes of t: a, others: 0
inline vf16 zero_beyond(tail16 t, vf16 a) {
  return vf16{_mm256_and_ps(a.lo, lanes_lo(t)), _mm256_and_ps(a.hi, lanes_hi(t))};
}
// valid lanes of t: max(a, b), others: a
inline vf16 max_where(tail16 t, vf16 a, vf16 b) { return select(t, max(a, b), a); }

inline vf16 load16(const float* p) { return vf16{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf16 load16(const float* p, tail16 t) {
  if (t.n >= 16) return load16(p);
  alignas(32) float buf[16] = {};  // lanes past the tail read as 0, as a zero-masked load gives
  std::memcpy(buf, p, t.n * sizeof(float));
  return load16(buf);
}
inline __m256 bf16_bits_to_float8(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline vf16 bf16_bits_to_float(__m256i bits) {
  return vf16{bf16_bits_to_float8(_mm256_castsi256_si128(bits)),
              bf16_bits_to_float8(_mm256_extracti128_si256(bits, 1))};
}
inline vf16 load16(const bf16* p) { return bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf16 load16(const bf16* p, tail16 t) {
  if (t.n >= 16) return load16(p);
  alignas(32) bf16 buf[16] = {};
  std::memcpy(buf, p, t.n * sizeof(bf16));
  return load16(buf);
}

// float → bfloat16 bits (in 32-bit lanes), round to nearest even; NaN stays NaN (bit tests
// survive -ffast-math). |b| as a signed int is >= 0, so a signed compare finds NaNs.
inline __m256i to_bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
  return _mm256_srli_epi32(rounded, 16);
}
inline __m256i to_bf16_bits(vf16 v) {
  // packus interleaves the 128-bit lanes (lo0-3, hi0-3, lo4-7, hi4-7): put them back in order
  const __m256i packed = _mm256_packus_epi32(to_bf16_bits8(v.lo), to_bf16_bits8(v.hi));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

inline void store16(float* p, vf16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store16(float* p, vf16 v, tail16 t) {
  if (t.n >= 16) return store16(p, v);
  alignas(32) float buf[16];
  store16(buf, v);
  std::memcpy(p, buf, t.n * sizeof(float));
}
inline void store16(bf16* p, vf16 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v)); }
inline void store16(bf16* p, vf16 v, tail16 t) {
  if (t.n >= 16) return store16(p, v);
  alignas(32) bf16 buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), to_bf16_bits(v));
  std::memcpy(p, buf, t.n * sizeof(bf16));
}

inline vf16 round_nearest(vf16 x) {
  return vf16{_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
              _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// p * 2^n for integral n, as long as the result is a normal float (true in exp16, whose clamped
// inputs give n in [-126, 128] with p > 1 at -126 and p < 1 at 128): n is added to p's exponent
// bits, which is exact like scalef. Integer ops, so -ffast-math cannot reassociate it into an
// overflowing 2^128.
inline __m256 scale_by_pow2_8(__m256 p, __m256 n) {
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
inline vf16 scale_by_pow2(vf16 p, vf16 n) { return vf16{scale_by_pow2_8(p.lo, n.lo), scale_by_pow2_8(p.hi, n.hi)}; }

// sums of the 8 lanes of a[0..7], in order
inline __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  // u0 = (a0..a3 sums of lanes 0-3 | the same of lanes 4-7), u1 the same for a4..a7
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
// r[i] = sum of the 16 lanes of v[i]
inline vf16 transpose_sum16(const vf16* v) {
  __m256 h[16];
  for (int k = 0; k < 16; ++k) h[k] = _mm256_add_ps(v[k].lo, v[k].hi);
  return vf16{transpose_sum8(h), transpose_sum8(h + 8)};
}

#endif

// The value a float rounds to when stored as T (identity for float).
inline vf16 round_as(const float*, vf16 v) { return v; }
inline vf16 round_as(const bf16*, vf16 v) { return bf16_bits_to_float(to_bf16_bits(v)); }

// exp of 16 floats (Cephes polynomial, ~1 ulp); inputs are clamped to [-87.3, 88.7] so the
// result is always finite (tiny, not zero, for very negative inputs).
inline vf16 exp16(vf16 x) {
  x = min(max(x, set1(-87.3f)), set1(88.7f));
  const vf16 n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vf16 r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf16 p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.f)));
  return scale_by_pow2(p, n);
}

}  // namespace fd_cpu
