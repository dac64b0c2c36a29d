// bf16 operands laid out for vdpbf16ps, which multiplies (x0, x1) pairs: shared by the attention kernels.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

// (a[0], b[0], a[1], b[1], ... a[15], b[15]): a constant, not a function-local static, whose guard test
// would put a possible call inside the callers' loops and make GCC spill their accumulators around it.
alignas(64) inline constexpr int16_t kInterleaveLow[32] = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

// Rows a and b (D bf16 values each) side by side, column by column: out[c] holds columns 16c..16c+15
// as (a[col], b[col]) pairs, the operand that a broadcast (p_a, p_b) weight pair multiplies to add
// p_a a + p_b b to 16 float32 accumulators.
template <int D>
inline void interleave_rows(const uint16_t* a, const uint16_t* b, __m512i out[D / 16]) {
  const __m512i low = _mm512_load_si512(kInterleaveLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int c = 0; c < D / 32; ++c) {
    const __m512i va = _mm512_loadu_si512(a + 32 * c), vb = _mm512_loadu_si512(b + 32 * c);
    out[2 * c] = _mm512_permutex2var_epi16(va, low, vb);
    out[2 * c + 1] = _mm512_permutex2var_epi16(va, high, vb);
  }
}

// A row of zeros for interleave_rows' partner of a lone last row (D up to 128).
alignas(64) inline constexpr uint16_t kZeroRow[128] = {};
#endif
