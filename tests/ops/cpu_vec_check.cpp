// Checks the vector ops of custom_ops/cpu/cpu_vec.h, on whichever path -march=native picks,
// against scalar references: exp16, bf16 rounding (ties, NaN, inf), tails, masks, reductions.
// Built and run by tests/ops/test_cpu_vec.py; prints the failures and exits 1 on any.
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

using namespace fd_cpu;

static int bad = 0;
static void check(bool ok, const char* what, double got, double want) {
  if (!ok && bad++ < 20) std::printf("%s: got %.9g, want %.9g\n", what, got, want);
}
static uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
static float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
static uint16_t ref_bf16(float f) {  // torch's float -> bfloat16: round to nearest even, quiet NaN
  const uint32_t b = bits(f);
  if ((b & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
  return uint16_t((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

int main() {
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> uni(-100, 100);

  // exp16: relative error against double exp of the clamped input, always finite and non-zero
  double worst = 0;
  for (int it = 0; it < 100000; ++it) {
    float x[16], y[16];
    for (int i = 0; i < 16; ++i) x[i] = it < 10 ? (i % 2 ? -87.3f - it : 88.7f + it) : uni(gen);
    store16(y, exp16(load16(x)));
    for (int i = 0; i < 16; ++i) {
      const double want = std::exp(double(std::min(std::max(x[i], -87.3f), 88.7f)));
      const uint32_t e = bits(y[i]) & 0x7F800000;
      check(e != 0 && e != 0x7F800000, "exp16 finite and normal", y[i], want);
      worst = std::max(worst, std::fabs(y[i] - want) / want);
    }
  }
  check(worst < 5e-7, "exp16 max relative error", worst, 5e-7);

  // float <-> bf16 bits, and round_as
  const uint32_t specials[] = {0x7FC00000, 0x7F800001, 0xFF800001, 0x7F800000, 0xFF800000, 0x3F808000,
                               0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000000, 0x80000000, 0x00000001};
  for (int it = 0; it < 20000; ++it) {
    float x[16], back[16], rounded[16];
    bf16 y[16];
    for (int i = 0; i < 16; ++i) x[i] = from_bits(it == 0 && i < 12 ? specials[i] : uint32_t(gen()));
    store16(y, load16(x));
    store16(back, load16(y));
    store16(rounded, round_as(y, load16(x)));
    for (int i = 0; i < 16; ++i) {
      check(y[i] == ref_bf16(x[i]), "bf16 bits", y[i], ref_bf16(x[i]));
      check(bits(back[i]) == uint32_t(y[i]) << 16, "bf16 load", bits(back[i]), uint32_t(y[i]) << 16);
      check(bits(rounded[i]) == uint32_t(y[i]) << 16, "round_as bf16", bits(rounded[i]), uint32_t(y[i]) << 16);
    }
  }

  // tails: loads read 0 past the tail, stores leave it alone; select / zero_beyond / max_where
  for (int n = 1; n <= 16; ++n) {
    float src[16], dst[16], lf[16], lb[16], sel[16], zb[16], mw[16];
    bf16 bsrc[16], bdst[16];
    for (int i = 0; i < 16; ++i) {
      src[i] = float(i + 1);
      dst[i] = -1;
      bsrc[i] = ref_bf16(src[i]);
      bdst[i] = 0xFFFF;
    }
    const tail16 t = tail_mask(n);
    store16(lf, load16(src, t));
    store16(lb, load16(bsrc, t));
    store16(dst, load16(src), t);
    store16(bdst, load16(src), t);
    store16(sel, select(t, set1(1), set1(2)));
    store16(zb, zero_beyond(t, set1(3)));
    store16(mw, max_where(t, set1(4.5f), load16(src)));
    for (int i = 0; i < 16; ++i) {
      const bool in = i < n;
      check(lf[i] == (in ? src[i] : 0) && lb[i] == lf[i], "tail load", lf[i], in ? src[i] : 0);
      check(dst[i] == (in ? src[i] : -1), "tail store float", dst[i], in ? src[i] : -1);
      check(bdst[i] == (in ? bsrc[i] : 0xFFFF), "tail store bf16", bdst[i], in ? bsrc[i] : 0xFFFF);
      check(sel[i] == (in ? 1 : 2), "select", sel[i], in ? 1 : 2);
      check(zb[i] == (in ? 3 : 0), "zero_beyond", zb[i], in ? 3 : 0);
      check(mw[i] == (in ? std::max(4.5f, src[i]) : 4.5f), "max_where", mw[i], in ? std::max(4.5f, src[i]) : 4.5f);
    }
  }

  // reductions (integral values: every summation order is exact)
  vf16 v[16];
  float a[16][16], sums[16];
  for (int k = 0; k < 16; ++k) {
    float want = 0, most = -1e9f;
    for (int i = 0; i < 16; ++i) {
      a[k][i] = std::round(uni(gen));
      want += a[k][i];
      most = std::max(most, a[k][i]);
    }
    v[k] = load16(a[k]);
    check(reduce_add(v[k]) == want, "reduce_add", reduce_add(v[k]), want);
    check(reduce_max(v[k]) == most, "reduce_max", reduce_max(v[k]), most);
  }
  store16(sums, transpose_sum16(v));
  for (int k = 0; k < 16; ++k) check(sums[k] == reduce_add(v[k]), "transpose_sum16", sums[k], reduce_add(v[k]));

  // arithmetic, one rounding each
  float x[16], y[16], z[16], r[16];
  for (int i = 0; i < 16; ++i) x[i] = uni(gen), y[i] = uni(gen), z[i] = uni(gen);
  const vf16 X = load16(x), Y = load16(y), Z = load16(z);
  store16(r, fmadd(X, Y, Z));
  for (int i = 0; i < 16; ++i) check(r[i] == std::fma(x[i], y[i], z[i]), "fmadd", r[i], std::fma(x[i], y[i], z[i]));
  store16(r, fnmadd(X, Y, Z));
  for (int i = 0; i < 16; ++i) check(r[i] == std::fma(-x[i], y[i], z[i]), "fnmadd", r[i], std::fma(-x[i], y[i], z[i]));
  store16(r, sub(div(X, Y), min(X, max(Y, add(Z, zero16())))));
  for (int i = 0; i < 16; ++i) {
    const float want = x[i] / y[i] - std::min(x[i], std::max(y[i], z[i]));
    // -ffast-math may evaluate either side's division differently (one ulp)
    check(std::fabs(r[i] - want) <= 1e-6f * std::fabs(want), "add/sub/div/min/max", r[i], want);
  }
  store16(r, round_nearest(mul(X, set1(0.1f))));
  for (int i = 0; i < 16; ++i) check(r[i] == std::nearbyint(x[i] * 0.1f), "round_nearest", r[i], std::nearbyint(x[i] * 0.1f));

  std::printf("%s path: %d failures\n", FD_CPU_AVX512 ? "AVX-512" : "AVX2", bad);
  return bad ? 1 : 0;
}
