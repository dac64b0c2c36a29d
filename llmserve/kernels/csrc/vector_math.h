// Elementwise math in a form the compiler vectorizes inside `#pragma omp simd` loops (the C library's
// expf is a call per element).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <c10/util/BFloat16.h>

// Fully unrolls the loop that follows before register allocation. Loops over a kernel's arrays of vector
// accumulators need it: GCC 12 otherwise keeps such an array in memory and stores every element on
// each iteration of the enclosing loop.
#define LLMSERVE_UNROLL _Pragma("GCC unroll 16")

// exp(x) = 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-6 Taylor polynomial
// (relative error ~1e-7); x is clamped to [-87, 88], where the result stays a normal float.
inline float vexp(float x) {
  const float t = std::min(std::max(x, -87.0f), 88.0f) * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.6931471805599453f;  // back to natural-log units: 2^(t-n) = e^f
  const float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// vexp for 16 floats at once: the same range reduction and polynomial.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// vexp for 8 floats at once: the same range reduction and polynomial (as FMAs).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// x rounded to the nearest bfloat16 (ties to even; NaN to the quiet NaN 0x7FC0), still as float32: what
// a store to a bf16 tensor and a load back give, 8 lanes at a time.
inline __m256 round_to_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 kept = _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(kept, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

// 8 float32 lanes stored as they are, or rounded to bf16 (nearest even, as torch rounds).
inline void store8(float* dst, __m256 x) { _mm256_storeu_ps(dst, x); }
inline void store8(uint16_t* dst, __m256 x) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_to_bf16_8(x)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
inline void store8(c10::BFloat16* dst, __m256 x) { store8(reinterpret_cast<uint16_t*>(dst), x); }

// Output rows [row, row + 32) of M inputs from acc[4 vectors of 8 rows][M] (a small-batch kernel's
// packed block); rows >= n_size are not written: a partial last block goes through a buffer, since
// AVX2's masked stores are microcoded on AMD.
template <int M, typename Out>
inline void store_block_rows(const __m256 (&acc)[4][M], Out* out, int64_t n_size, int64_t row) {
  const int64_t valid = std::min<int64_t>(32, n_size - row);
  for (int m = 0; m < M; ++m) {
    Out* dst = out + m * n_size + row;
    if (valid == 32) {
      for (int v = 0; v < 4; ++v) store8(dst + 8 * v, acc[v][m]);
    } else {
      Out buffer[32];
      for (int v = 0; v < 4; ++v) store8(buffer + 8 * v, acc[v][m]);
      std::copy(buffer, buffer + valid, dst);
    }
  }
}

inline float horizontal_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float horizontal_sum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Softmax of s[0, visible) in place, 8 lanes at a time, and zeros in [visible, length): the buffer has
// room for whole vectors up to `length` rounded up to 8. Whole vectors need no mask, the one vector
// holding the boundary is masked, so a row's values depend only on the `visible` scores (as in a decode
// of it). Plain loads and stores: AVX2's masked stores are microcoded on AMD Zen.
inline void softmax_prefix_f32(float* s, int64_t visible, int64_t length) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = visible / 8 * 8;
  const __m256 tail_mask = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(visible - full)), lane));
  __m256 max_vector = minus_inf;
  for (int64_t i = 0; i < full; i += 8) max_vector = _mm256_max_ps(max_vector, _mm256_loadu_ps(s + i));
  if (full < visible) max_vector = _mm256_max_ps(max_vector, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(s + full), tail_mask));
  const __m256 row_max = _mm256_set1_ps(horizontal_max8(max_vector));
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), row_max));
    total = _mm256_add_ps(total, e);
    _mm256_storeu_ps(s + i, e);
  }
  int64_t end = full;
  if (full < visible) {
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + full), row_max)), tail_mask);
    total = _mm256_add_ps(total, e);
    _mm256_storeu_ps(s + full, e);
    end += 8;
  }
  for (int64_t i = end; i < length; i += 8) _mm256_storeu_ps(s + i, _mm256_setzero_ps());
  const __m256 inverse = _mm256_set1_ps(1.0f / horizontal_sum8(total));
  for (int64_t i = 0; i < end; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inverse));
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>

// 8 values as float32 lanes: stored so, or as bf16 (the high half of a float32: widen and shift, exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// 8 int8 codes as float32 lanes (exact).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// 8 float8_e4m3fn codes as float32 lanes times 2^-8, exactly: each code becomes the float16 of the same
// sign, exponent field and mantissa (bias 15 instead of 7: 2^-8 times the value, subnormals included, and
// the NaN code made a float16 NaN), which F16C widens. Callers fold the 2^8 into a scale they apply anyway.
inline __m256 load8_e4m3_over_256(const uint8_t* p) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i high = _mm_unpacklo_epi8(_mm_setzero_si128(), codes);  // code << 8 in 16-bit lanes
  // the sign stays at bit 15 and its copy at bit 14 is cleared: exponent and mantissa move down by one
  const __m128i half = _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(high, _mm_set1_epi16(0x7F00)), _mm_set1_epi16(0x7F00));
  return _mm256_cvtph_ps(_mm_or_si128(half, _mm_and_si128(nan, _mm_set1_epi16(0x7C00))));
}
#endif
