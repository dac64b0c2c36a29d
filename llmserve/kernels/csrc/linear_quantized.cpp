// Quantized linear layers (bfloat16 x [M, K], any M; float32 x too on AVX2): int8 codes
// Q [N, K] (|q| <= 127) with one float scale per output row (per-channel weight-only quantization:
// `int8`), y = (x Q^T) * s, or per (row, 32 columns) (GGUF Q8_0, Q5_0) or (row, 16 columns) (Q6_K);
// and int4 codes 0..15 in groups of G columns with a scale and an offset per (row, group) (`int4`,
// AWQ, GPTQ, GGUF Q4_0/Q4_1), y = x W^T with W = q * scale + offset.
//
// Like the bf16 kernel (linear.cpp) this streams the weights once, but widening int8 codes to bf16 costs
// five instructions per 32 weights, which made the old exact kernel compute-bound: at one row it was
// barely faster than bf16 for half the bytes. Here the input is quantized instead, as llama.cpp does
// for its quantized matrix-vector products: each row of x, in blocks of 32 columns, becomes int8 codes
// with one float scale per block (round to nearest, scale = max|x| / 127), and the products run on
// AVX-512 VNNI (vpdpbusd: 64 byte products summed into 16 int32 lanes per instruction). The weights are
// packed once (small_batch_pack_int8) as unsigned bytes q + 128 in blocks of 32 output rows, four
// columns per lane: [N/32][K/4][32][4], so that, as in the bf16 layout, lanes are output rows and the
// input's four codes are broadcast. The + 128 comes back out exactly: sum (q + 128) a = sum q a +
// 128 sum a, and sum a is known per input block. Per block the int32 sums are exact; they are scaled
// into float32 accumulators, and the row scales multiply once at the end.
//
// int4 codes are packed two per byte, [N/32][K/8][32][4]: lane r's four bytes hold columns k..k+3 in
// their low nibbles and k+4..k+7 in their high ones, so one mask (and one shift) gives vpdpbusd its
// unsigned operand. Per 32-column input block the exact int32 sums sum q a are scaled by the block's
// input scale times the row's group scale; the offsets add offset * sum x over the group, where
// sum x is taken from the rounded input too, so the result is exactly the product of the rounded
// input with W (up to float32 sums).
//
// 5-bit codes 0..31 (GGUF Q5_0: w = d * (q - 16), scale d and offset -16 d) run the same kernels: the
// low nibbles packed as int4's, followed in each 32-row block by a plane of the fifth bits, 32 bytes per
// chunk of 8 columns: eight 32-bit words (the low nibbles' rows 0-7, 8-15, 16-23, 24-31, then the high
// nibbles' likewise), bit i of a word for byte i of the 32-byte load of those 8 rows (row i / 4,
// column i % 4). Two words side by side are the byte mask of a 64-byte load's 16 rows. The bits are
// expanded to 0x10 bytes and ORed into the nibbles before the byte products.
//
// The input rounding is the only difference from an exact product: a relative error of at most
// 1/254 of each block's largest input per element, which `llmserve eval ppl` measures on real text
// (docs/quantization.md).
//
// On AVX2 CPUs (no VNNI) the same packed layouts and input rounding run on vpmaddubsw and vpmaddwd,
// giving the same outputs (the AVX2 section says how), and take float32 inputs too.
#include "aten.h"

#include <limits>
#include <type_traits>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define LLMSERVE_INT8_LINEAR 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vector_math.h"
#define LLMSERVE_INT8_LINEAR_AVX2 1  // the same packed layouts on 8 lanes (the section's comment says how)
#endif

namespace {

constexpr int kRows = 32;        // output rows per packed block
constexpr int kInputBlock = 32;  // input columns per activation scale
constexpr int kMaxRowsPerPass = 4;
// Rows of x rounded per thread: a decode step's few rows stay on the calling thread.
constexpr int64_t kQuantizeRowsGrain = 16;
// How far ahead of the loads the weight stream is prefetched: 8 KiB read 5-12% faster than 2 KiB
// at 1-8 rows, and 16 KiB no faster (linear_micro, Zen 5).
constexpr int kPrefetchBytes = 128 * 64;

// The experts of a grouped call (a mixture-of-experts layer's projection): expert e's input rows are
// [ends[e - 1], ends[e]) (ends[-1] = 0), and its packed weights and scales lie `weight_stride` bytes and
// `param_stride` scale elements after expert e - 1's. A dense layer is one expert holding every row.
struct Experts {
  const int64_t* ends;
  int64_t count;
  int64_t weight_stride = 0, param_stride = 0;
};

// int4 parameters of a 32-row block come in one of two layouts (the packers choose):
// - float32 or float16 [groups][2][32]: each group's 32 scales, then its 32 offsets;
// - factored by super-blocks of 8 groups, uint8 [groups / 8][640] (GGUF Q4_K and Q5_K, whose scales are
//   d * sc and offsets -dmin * m: float16 factors, 6-bit codes): per super-block 32 float16 scale factors
//   and 32 offset factors (128 bytes), then each group's 32 scale codes (8 x 32 bytes) and 32 offset codes
//   (8 x 32 bytes). A value is factor * code, exact in float32 (11 by 8 significant bits), so both layouts
//   of the same values give the same outputs.
constexpr int64_t kSuperGroups = 8;
constexpr int64_t kSuperFactorBytes = 2 * kRows * 2;
constexpr int64_t kSuperBytes = kSuperFactorBytes + 2 * kSuperGroups * kRows;
// A group's share of a block's parameters, in elements of the layout's type.
template <typename Param>
constexpr int64_t kGroupParams = 2 * kRows;
template <>
constexpr int64_t kGroupParams<uint8_t> = kSuperBytes / kSuperGroups;

// Row r's scale (part 0) or offset (part 1) in group g of a block's parameters.
template <typename Param>
inline float group_param(const Param* block, int64_t g, int part, int64_t r) {
  return static_cast<float>(block[g * 2 * kRows + part * kRows + r]);
}
inline float group_param(const uint8_t* block, int64_t g, int part, int64_t r) {
  const uint8_t* super = block + g / kSuperGroups * kSuperBytes;
  uint16_t factor;
  std::memcpy(&factor, super + 2 * (part * kRows + r), sizeof(factor));
  const uint8_t code = super[kSuperFactorBytes + (part * kSuperGroups + g % kSuperGroups) * kRows + r];
  return static_cast<float>(c10::Half(factor, c10::Half::from_bits())) * static_cast<float>(code);
}

// int8 scales per 16 columns come as float32 or float16 [K / 16][32] per 32-row block, or (GGUF Q6_K and
// Q3_K, whose scales are d * sc: a float16 d per 256 columns, a signed 8-bit sc) factored: int8
// [K / 256][576] per block, each super-block's 32 float16 factors (64 bytes) then its 16 groups' 32 int8
// codes. factor * code is exact in float32, as for int4's factored parameters.
constexpr int64_t kScaleSuperGroups = 16;
constexpr int64_t kScaleFactorBytes = 2 * kRows;
constexpr int64_t kScaleSuperBytes = kScaleFactorBytes + kScaleSuperGroups * kRows;
// A group's share of a block's scales, in elements of the layout's type.
template <typename Param>
constexpr int64_t kGroupScales = kRows;
template <>
constexpr int64_t kGroupScales<int8_t> = kScaleSuperBytes / kScaleSuperGroups;

// Row r's scale in group g of a block's int8 scales.
template <typename Param>
inline float group_scale(const Param* block, int64_t g, int64_t r) {
  return static_cast<float>(block[g * kRows + r]);
}
inline float group_scale(const int8_t* block, int64_t g, int64_t r) {
  const int8_t* super = block + g / kScaleSuperGroups * kScaleSuperBytes;
  uint16_t factor;
  std::memcpy(&factor, super + 2 * r, sizeof(factor));
  const int8_t code = super[kScaleFactorBytes + g % kScaleSuperGroups * kRows + r];
  return static_cast<float>(c10::Half(factor, c10::Half::from_bits())) * static_cast<float>(code);
}

#if defined(LLMSERVE_INT8_LINEAR) || defined(LLMSERVE_INT8_LINEAR_AVX2)

// Four input codes as one 32-bit lane value (memcpy: no aliasing or alignment assumptions).
inline int32_t four_codes(const int8_t* codes) {
  int32_t value;
  std::memcpy(&value, codes, sizeof(value));
  return value;
}

// x rows -> int8 codes [M, K], a scale per (row, 32-column block) [M, K/32], and the sum of each
// block's codes [M, K/32]; on AVX-512 also each block's two halves' sums [M, K/32, 2] (weights scaled
// per 16 columns take the + 128 back out per half).
struct QuantizedInput {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<int32_t> sums;
  std::vector<int32_t> half_sums = {};
};

// Weight scales per 32 columns (GGUF Q8_0, Q5_0) or per 16 (Q6_K): how many parts of a 32-column
// input block get their own weight scale, and the column quads of each part.
template <int Group>
constexpr int kParts = Group == 16 ? 2 : 1;
template <int Group>
constexpr int kQuadsPerPart = kInputBlock / 4 / kParts<Group>;

#endif

#ifdef LLMSERVE_INT8_LINEAR

// 16 scales or offsets as float32 lanes, stored as float32 or (where exact: the packers decide) float16.
inline __m512 load_params16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_params16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lanes [lane, lane + 16) of the scales (part 0) or offsets (part 1) of group g of a block's parameters.
template <typename Param>
inline __m512 group_params16(const Param* block, int64_t g, int part, int lane) {
  return load_params16(block + g * 2 * kRows + part * kRows + lane);
}
inline __m512 group_params16(const uint8_t* block, int64_t g, int part, int lane) {
  const uint8_t* super = block + g / kSuperGroups * kSuperBytes;
  const __m512 factors = load_params16(reinterpret_cast<const c10::Half*>(super) + part * kRows + lane);
  const uint8_t* codes = super + kSuperFactorBytes + (part * kSuperGroups + g % kSuperGroups) * kRows + lane;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  return _mm512_mul_ps(factors, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)));
}

// Lanes [lane, lane + 16) of group g's int8 scales in a block.
template <typename Param>
inline __m512 group_scales16(const Param* block, int64_t g, int lane) {
  return load_params16(block + g * kRows + lane);
}
inline __m512 group_scales16(const int8_t* block, int64_t g, int lane) {
  const int8_t* super = block + g / kScaleSuperGroups * kScaleSuperBytes;
  const __m512 factors = load_params16(reinterpret_cast<const c10::Half*>(super) + lane);
  const int8_t* codes = super + kScaleFactorBytes + g % kScaleSuperGroups * kRows + lane;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  return _mm512_mul_ps(factors, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
}

QuantizedInput quantize_input(const uint16_t* x, int64_t m_size, int64_t k_size) {
  const int64_t blocks = k_size / kInputBlock;
  QuantizedInput q{std::vector<int8_t>(m_size * k_size), std::vector<float>(m_size * blocks),
                   std::vector<int32_t>(m_size * blocks), std::vector<int32_t>(m_size * blocks * 2)};
  at::parallel_for(0, m_size, kQuantizeRowsGrain, [&](int64_t first_row, int64_t end_row) {
  for (int64_t m = first_row; m < end_row; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* src = x + m * k_size + b * kInputBlock;
      const __m512 low = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
      const __m512 high = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16))), 16));
      const bool has_nan = _mm512_cmp_ps_mask(low, low, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(high, high, _CMP_UNORD_Q);
      const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      // A block that is (nearly) zero, or holds a NaN, gets codes 0: scale 0, or NaN so that the
      // NaN reaches the output as it would through a float product.
      const bool usable = !has_nan && max_abs >= 1e-30f;
      const float scale = has_nan ? std::nanf("") : usable ? max_abs / 127.0f : 0.0f;
      const __m512 inverse = _mm512_set1_ps(usable ? 1.0f / scale : 0.0f);
      const __m512i low_codes =
          usable ? _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse)) : _mm512_setzero_si512();  // nearest even
      const __m512i high_codes = usable ? _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse)) : _mm512_setzero_si512();
      int8_t* dst = q.codes.data() + m * k_size + b * kInputBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(low_codes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(high_codes));
      q.scales[m * blocks + b] = scale;
      q.half_sums[(m * blocks + b) * 2] = _mm512_reduce_add_epi32(low_codes);
      q.half_sums[(m * blocks + b) * 2 + 1] = _mm512_reduce_add_epi32(high_codes);
      q.sums[m * blocks + b] = q.half_sums[(m * blocks + b) * 2] + q.half_sums[(m * blocks + b) * 2 + 1];
    }
  }
  });
  return q;
}

// Rows [row, row + 32) of inputs [m0, m0 + MC) from one packed block; rows >= n_size are not written.
// Scales: one per output row (`row_scales`, per-channel, Group 0), or one per (row, Group columns)
// (`group_scales`: the block's [K/Group][32]; GGUF Q8_0 and Q5_0: 32, Q6_K: 16). `prefetch`: this pass
// streams the block in (later passes over it read it from cache).
template <int MC, int Group, typename Out, typename Param>
inline void int8_block(const QuantizedInput& in, int64_t m0, const uint8_t* block, const float* row_scales,
                       const Param* group_scales, Out* out, int64_t k_size, int64_t n_size, int64_t row,
                       bool prefetch) {
  constexpr bool Grouped = Group != 0;
  const int64_t blocks = k_size / kInputBlock;
  __m512 acc[2][MC];
  for (int m = 0; m < MC; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) for (int part = 0; part < kParts<Group>; ++part) {
    __m512i sums[2][MC];
    for (int m = 0; m < MC; ++m) sums[0][m] = sums[1][m] = _mm512_setzero_si512();
    const uint8_t* weights = block + b * kInputBlock * kRows;  // 8 column quads x 32 rows x 4 bytes
    for (int quad = part * kQuadsPerPart<Group>; quad < (part + 1) * kQuadsPerPart<Group>; ++quad) {
      const uint8_t* lines = weights + quad * 4 * kRows;  // two cache lines: rows 0-15, rows 16-31
      if (prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes + 64, _MM_HINT_T0);
      }
      const __m512i low = _mm512_loadu_si512(lines);
      const __m512i high = _mm512_loadu_si512(lines + 64);
      for (int m = 0; m < MC; ++m) {
        const __m512i input =
            _mm512_set1_epi32(four_codes(in.codes.data() + (m0 + m) * k_size + b * kInputBlock + 4 * quad));
        sums[0][m] = _mm512_dpbusd_epi32(sums[0][m], low, input);
        sums[1][m] = _mm512_dpbusd_epi32(sums[1][m], high, input);
      }
    }
    __m512 weight_scale[2] = {_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f)};
    if constexpr (Grouped) {
      const int64_t group = b * kParts<Group> + part;
      weight_scale[0] = group_scales16(group_scales, group, 0);
      weight_scale[1] = group_scales16(group_scales, group, 16);
    }
    for (int m = 0; m < MC; ++m) {
      const int32_t code_sum = kParts<Group> == 1 ? in.sums[(m0 + m) * blocks + b]
                                                  : in.half_sums[((m0 + m) * blocks + b) * 2 + part];
      const __m512i correction = _mm512_set1_epi32(128 * code_sum);  // the + 128
      const __m512 scale = _mm512_set1_ps(in.scales[(m0 + m) * blocks + b]);
      for (int t = 0; t < 2; ++t) {
        const __m512 block_scale = Grouped ? _mm512_mul_ps(scale, weight_scale[t]) : scale;
        acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[t][m], correction)), block_scale,
                                    acc[t][m]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kRows, n_size - row);
  const __mmask16 masks[2] = {valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1),
                              valid >= 32   ? (__mmask16)0xFFFF
                              : valid <= 16 ? (__mmask16)0
                                            : (__mmask16)((1u << (valid - 16)) - 1)};
  for (int t = 0; t < 2; ++t) {
    const __m512 scales = Grouped ? _mm512_set1_ps(1.0f) : _mm512_maskz_loadu_ps(masks[t], row_scales + row + 16 * t);
    for (int m = 0; m < MC; ++m) {
      const __m512 sums = Grouped ? acc[t][m] : _mm512_mul_ps(acc[t][m], scales);
      Out* dst = out + (m0 + m) * n_size + row + 16 * t;
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_mask_storeu_ps(dst, masks[t], sums);  // logits: the float32 sums unrounded
      } else {
        _mm256_mask_storeu_epi16(dst, masks[t], (__m256i)_mm512_cvtneps_pbh(sums));
      }
    }
  }
}

// int4: rows [row, row + 32) of inputs [m0, m0 + MC) from one packed block. `params` holds the block's
// [groups][2][32] float32 scales and offsets; `group_sums` [M, groups] is sum x over each group;
// `prefetch` as for int8_block. bf16 outputs only (float32 inputs are the AVX2 level's). FiveBit: `plane`
// is the block's fifth bits (the header says how they lie), ORed into the codes.
template <int MC, bool FiveBit, typename Param>
inline void int4_block(const QuantizedInput& in, int64_t m0, const uint8_t* block, const uint8_t* plane,
                       const Param* params, const float* group_sums, uint16_t* out, int64_t k_size, int64_t n_size,
                       int64_t row, int64_t group_size, bool prefetch) {
  const int64_t blocks = k_size / kInputBlock, groups = k_size / group_size;
  const int64_t blocks_per_group = group_size / kInputBlock;
  const __m512i nibble = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  __m512 acc[2][MC];
  for (int m = 0; m < MC; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale[2] = {group_params16(params, g, 0, 0), group_params16(params, g, 0, 16)};
    for (int t = 0; t < 2; ++t) {
      const __m512 offset = group_params16(params, g, 1, 16 * t);
      for (int m = 0; m < MC; ++m)
        acc[t][m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(group_sums[(m0 + m) * groups + g]), acc[t][m]);
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m512i sums[2][MC];
      for (int m = 0; m < MC; ++m) sums[0][m] = sums[1][m] = _mm512_setzero_si512();
      const uint8_t* weights = block + b * kInputBlock * kRows / 2;  // 4 chunks of 8 columns x 32 rows
      for (int chunk = 0; chunk < kInputBlock / 8; ++chunk) {
        const uint8_t* lines = weights + chunk * 4 * kRows;  // two cache lines: rows 0-15, rows 16-31
        if (prefetch) {
          _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes + 64, _MM_HINT_T0);
        }
        __m512i low[2], high[2];
        for (int t = 0; t < 2; ++t) {
          const __m512i packed = _mm512_loadu_si512(lines + 64 * t);
          low[t] = _mm512_and_si512(packed, nibble);
          high[t] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        }
        if constexpr (FiveBit) {
          const uint8_t* bits = plane + (b * (kInputBlock / 8) + chunk) * kRows;  // this chunk's 32 bytes
          if (prefetch && chunk % 2 == 0)  // one line per two chunks, as far ahead in weights as the nibbles'
            _mm_prefetch(reinterpret_cast<const char*>(bits) + kPrefetchBytes / 4, _MM_HINT_T0);
          for (int t = 0; t < 2; ++t) {
            uint64_t low_bits, high_bits;
            std::memcpy(&low_bits, bits + 8 * t, sizeof(low_bits));
            std::memcpy(&high_bits, bits + 16 + 8 * t, sizeof(high_bits));
            low[t] = _mm512_or_si512(low[t], _mm512_maskz_mov_epi8(_cvtu64_mask64(low_bits), fifth));
            high[t] = _mm512_or_si512(high[t], _mm512_maskz_mov_epi8(_cvtu64_mask64(high_bits), fifth));
          }
        }
        for (int m = 0; m < MC; ++m) {
          const int8_t* codes = in.codes.data() + (m0 + m) * k_size + b * kInputBlock + 8 * chunk;
          const __m512i first = _mm512_set1_epi32(four_codes(codes));
          const __m512i second = _mm512_set1_epi32(four_codes(codes + 4));
          for (int t = 0; t < 2; ++t) {
            sums[t][m] = _mm512_dpbusd_epi32(sums[t][m], low[t], first);
            sums[t][m] = _mm512_dpbusd_epi32(sums[t][m], high[t], second);
          }
        }
      }
      for (int m = 0; m < MC; ++m) {
        const __m512 input_scale = _mm512_set1_ps(in.scales[(m0 + m) * blocks + b]);
        for (int t = 0; t < 2; ++t)
          acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t][m]), _mm512_mul_ps(scale[t], input_scale), acc[t][m]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kRows, n_size - row);
  const __mmask16 masks[2] = {valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1),
                              valid >= 32   ? (__mmask16)0xFFFF
                              : valid <= 16 ? (__mmask16)0
                                            : (__mmask16)((1u << (valid - 16)) - 1)};
  for (int t = 0; t < 2; ++t)
    for (int m = 0; m < MC; ++m)
      _mm256_mask_storeu_epi16(out + (m0 + m) * n_size + row + 16 * t, masks[t],
                               (__m256i)_mm512_cvtneps_pbh(acc[t][m]));
}

#endif  // LLMSERVE_INT8_LINEAR

#ifdef LLMSERVE_INT8_LINEAR_AVX2

// -- AVX2: the same packed layouts and input rounding, on 8 lanes -----------------------------------
// Without VNNI the byte products run on vpmaddubsw (unsigned bytes times signed bytes, adjacent pairs
// summed into int16, saturating) and vpmaddwd against ones (int16 pairs summed into int32), as
// llama.cpp's AVX2 paths do. A 32-byte load of either layout holds 8 rows' four bytes, so lanes are
// still output rows: 4 vectors cover a 32-row block.
// int8: the packed q + 128 reaches 255, and a pair of 255 x 127 products saturates int16. So each
// weight is turned back into q (xor 0x80), the input's sign moves onto it (vpsignb) and the input
// gives its magnitude: |a| x (sign(a) q), a pair at most 2 x 128 x 127 < 32,768, the int32 sums exact
// and equal to sum q a, with no + 128 to take back out.
// int4: codes are at most 15, a pair at most 2 x 15 x 128, so the int16 sums of a whole 32-column block
// (eight products per lane) stay below 32,768: one widening per block instead of one per chunk.
// The input codes and scales, the exact int32 block sums and the float32 operations after them are
// the AVX-512 kernel's, in the same order, so both levels compute the same outputs. float32 inputs
// (the dtype AVX2 CPUs serve models in) are rounded the same way from their own values. Inputs run in
// passes of up to 4 rows over a block, as on AVX-512 (fewer rows per pass ran slower at 8 rows,
// although their accumulators spill less); later passes read the block from cache.

inline __m256 load_input8(const uint16_t* x) { return load8(reinterpret_cast<const c10::BFloat16*>(x)); }
inline __m256 load_input8(const float* x) { return _mm256_loadu_ps(x); }

// 8 scales or offsets as float32 lanes, stored as float32 or (where exact: the packers decide) float16.
inline __m256 load_params8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_params8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lanes [lane, lane + 8) of the scales (part 0) or offsets (part 1) of group g of a block's parameters.
template <typename Param>
inline __m256 group_params8(const Param* block, int64_t g, int part, int lane) {
  return load_params8(block + g * 2 * kRows + part * kRows + lane);
}
inline __m256 group_params8(const uint8_t* block, int64_t g, int part, int lane) {
  const uint8_t* super = block + g / kSuperGroups * kSuperBytes;
  const __m256 factors = load_params8(reinterpret_cast<const c10::Half*>(super) + part * kRows + lane);
  const uint8_t* codes = super + kSuperFactorBytes + (part * kSuperGroups + g % kSuperGroups) * kRows + lane;
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  return _mm256_mul_ps(factors, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
}

// Lanes [lane, lane + 8) of group g's int8 scales in a block.
template <typename Param>
inline __m256 group_scales8(const Param* block, int64_t g, int lane) {
  return load_params8(block + g * kRows + lane);
}
inline __m256 group_scales8(const int8_t* block, int64_t g, int lane) {
  const int8_t* super = block + g / kScaleSuperGroups * kScaleSuperBytes;
  const __m256 factors = load_params8(reinterpret_cast<const c10::Half*>(super) + lane);
  const int8_t* codes = super + kScaleFactorBytes + g % kScaleSuperGroups * kRows + lane;
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  return _mm256_mul_ps(factors, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
}

inline int32_t horizontal_sum8_epi32(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
}

// As the AVX-512 quantize_input: max|x| / 127 per block, codes rounded to nearest even, NaN blocks
// NaN-scaled with codes 0, (nearly) zero blocks scale 0. In is uint16_t (bf16 bits) or float.
template <typename In>
QuantizedInput quantize_input(const In* x, int64_t m_size, int64_t k_size) {
  const int64_t blocks = k_size / kInputBlock;
  QuantizedInput q{std::vector<int8_t>(m_size * k_size), std::vector<float>(m_size * blocks),
                   std::vector<int32_t>(m_size * blocks)};
  const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // packs_epi32 then packs_epi16 interleave the four vectors' halves per 128-bit lane: back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  at::parallel_for(0, m_size, kQuantizeRowsGrain, [&](int64_t first_row, int64_t end_row) {
  for (int64_t m = first_row; m < end_row; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const In* src = x + m * k_size + b * kInputBlock;
      __m256 v[4];
      __m256 unordered = _mm256_setzero_ps(), max_abs8 = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = load_input8(src + 8 * i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        max_abs8 = _mm256_max_ps(max_abs8, _mm256_and_ps(v[i], magnitude_bits));
      }
      const bool has_nan = _mm256_movemask_ps(unordered) != 0;
      const float max_abs = horizontal_max8(max_abs8);
      const bool usable = !has_nan && max_abs >= 1e-30f;
      const float scale = has_nan ? std::nanf("") : usable ? max_abs / 127.0f : 0.0f;
      const __m256 inverse = _mm256_set1_ps(usable ? 1.0f / scale : 0.0f);
      __m256i codes[4];
      for (int i = 0; i < 4; ++i)
        codes[i] = usable ? _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse)) : _mm256_setzero_si256();  // nearest even
      const __m256i bytes =
          _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.codes.data() + m * k_size + b * kInputBlock),
                          _mm256_permutevar8x32_epi32(bytes, order));
      q.scales[m * blocks + b] = scale;
      q.sums[m * blocks + b] = horizontal_sum8_epi32(
          _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]), _mm256_add_epi32(codes[2], codes[3])));
    }
  }
  });
  return q;
}

// Rows [row, row + 32) of inputs [m0, m0 + MC) from one packed int8 block (the AVX-512 int8_block's
// contract).
template <int MC, int Group, typename Out, typename Param>
inline void int8_block(const QuantizedInput& in, int64_t m0, const uint8_t* block, const float* row_scales,
                       const Param* group_scales, Out* out, int64_t k_size, int64_t n_size, int64_t row,
                       bool prefetch) {
  constexpr bool Grouped = Group != 0;
  const int64_t blocks = k_size / kInputBlock;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[4][MC];
  LLMSERVE_UNROLL for (int v = 0; v < 4; ++v)
    LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) acc[v][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) for (int part = 0; part < kParts<Group>; ++part) {
    __m256i sums[4][MC];
    LLMSERVE_UNROLL for (int v = 0; v < 4; ++v)
      LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) sums[v][m] = _mm256_setzero_si256();
    const uint8_t* weights = block + b * kInputBlock * kRows;  // 8 column quads x 32 rows x 4 bytes
    const int8_t* codes = in.codes.data() + m0 * k_size + b * kInputBlock;
    for (int quad = part * kQuadsPerPart<Group>; quad < (part + 1) * kQuadsPerPart<Group>; ++quad) {
      const uint8_t* lines = weights + quad * 4 * kRows;  // two cache lines: rows 0-15, rows 16-31
      if (prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes + 64, _MM_HINT_T0);
      }
      __m256i input[MC], magnitude[MC];
      LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) {
        input[m] = _mm256_set1_epi32(four_codes(codes + m * k_size + 4 * quad));
        magnitude[m] = _mm256_abs_epi8(input[m]);
      }
      LLMSERVE_UNROLL for (int v = 0; v < 4; ++v) {
        const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 32 * v)), flip);
        LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude[m], _mm256_sign_epi8(q, input[m]));
          sums[v][m] = _mm256_add_epi32(sums[v][m], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) {
      const __m256 scale = _mm256_set1_ps(in.scales[(m0 + m) * blocks + b]);
      LLMSERVE_UNROLL for (int v = 0; v < 4; ++v) {
        const __m256 block_scale =
            Grouped ? _mm256_mul_ps(scale, group_scales8(group_scales, b * kParts<Group> + part, 8 * v))
                    : scale;
        acc[v][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[v][m]), block_scale, acc[v][m]);
      }
    }
  }
  if constexpr (!Grouped) {  // the row scales, zero past n_size (they are not padded)
    float scales[kRows] = {};
    std::copy(row_scales + row, row_scales + row + std::min<int64_t>(kRows, n_size - row), scales);
    LLMSERVE_UNROLL for (int v = 0; v < 4; ++v) {
      const __m256 s = _mm256_loadu_ps(scales + 8 * v);
      LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) acc[v][m] = _mm256_mul_ps(acc[v][m], s);
    }
  }
  store_block_rows<MC>(acc, out + m0 * n_size, n_size, row);
}

// 32 bits -> 32 bytes, byte i 0x10 where bit i is set: each byte of the word spread over 8 bytes
// (in-lane shuffle of the word broadcast), each of those tested for its own bit.
inline __m256i fifth_bits(const uint8_t* word) {
  int32_t bits;
  std::memcpy(&bits, word, sizeof(bits));
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(bits), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// int4: rows [row, row + 32) of inputs [m0, m0 + MC) from one packed block (the AVX-512 int4_block's
// contract), bf16 or float32 outputs. FiveBit: codes reach 31, so a chunk's int16 pairs (at most
// 4 x 31 x 128) are widened to int32 per chunk, the sums as exact as int4's.
template <int MC, bool FiveBit, typename Out, typename Param>
inline void int4_block(const QuantizedInput& in, int64_t m0, const uint8_t* block, const uint8_t* plane,
                       const Param* params, const float* group_sums, Out* out, int64_t k_size, int64_t n_size,
                       int64_t row, int64_t group_size, bool prefetch) {
  const int64_t blocks = k_size / kInputBlock, groups = k_size / group_size;
  const int64_t blocks_per_group = group_size / kInputBlock;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[4][MC];
  LLMSERVE_UNROLL for (int v = 0; v < 4; ++v)
    LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) acc[v][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    LLMSERVE_UNROLL for (int v = 0; v < 4; ++v) {
      const __m256 offset = group_params8(params, g, 1, 8 * v);
      LLMSERVE_UNROLL for (int m = 0; m < MC; ++m)
        acc[v][m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(group_sums[(m0 + m) * groups + g]), acc[v][m]);
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m256i sums[4][MC];  // int16 pairs (FiveBit: int32)
      LLMSERVE_UNROLL for (int v = 0; v < 4; ++v)
        LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) sums[v][m] = _mm256_setzero_si256();
      const uint8_t* weights = block + b * kInputBlock * kRows / 2;  // 4 chunks of 8 columns x 32 rows
      const int8_t* codes = in.codes.data() + m0 * k_size + b * kInputBlock;
      for (int chunk = 0; chunk < kInputBlock / 8; ++chunk) {
        const uint8_t* lines = weights + chunk * 4 * kRows;  // two cache lines: rows 0-15, rows 16-31
        if (prefetch) {
          _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes + 64, _MM_HINT_T0);
        }
        __m256i first[MC], second[MC];
        LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) {
          first[m] = _mm256_set1_epi32(four_codes(codes + m * k_size + 8 * chunk));
          second[m] = _mm256_set1_epi32(four_codes(codes + m * k_size + 8 * chunk + 4));
        }
        const uint8_t* bits = plane + (b * (kInputBlock / 8) + chunk) * kRows;  // FiveBit: 32 bytes
        if (FiveBit && prefetch && chunk % 2 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(bits) + kPrefetchBytes / 4, _MM_HINT_T0);
        LLMSERVE_UNROLL for (int v = 0; v < 4; ++v) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 32 * v));
          __m256i low = _mm256_and_si256(packed, nibble);
          __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
          if constexpr (FiveBit) {
            low = _mm256_or_si256(low, fifth_bits(bits + 4 * v));
            high = _mm256_or_si256(high, fifth_bits(bits + 16 + 4 * v));
          }
          LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) {
            const __m256i pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(low, first[m]), _mm256_maddubs_epi16(high, second[m]));
            sums[v][m] = FiveBit ? _mm256_add_epi32(sums[v][m], _mm256_madd_epi16(pairs, ones))
                                 : _mm256_add_epi16(sums[v][m], pairs);
          }
        }
      }
      LLMSERVE_UNROLL for (int m = 0; m < MC; ++m) {
        const __m256 input_scale = _mm256_set1_ps(in.scales[(m0 + m) * blocks + b]);
        LLMSERVE_UNROLL for (int v = 0; v < 4; ++v) {
          const __m256 scale = group_params8(params, g, 0, 8 * v);
          const __m256 block_sums = _mm256_cvtepi32_ps(FiveBit ? sums[v][m] : _mm256_madd_epi16(sums[v][m], ones));
          acc[v][m] = _mm256_fmadd_ps(block_sums, _mm256_mul_ps(scale, input_scale), acc[v][m]);
        }
      }
    }
  }
  store_block_rows<MC>(acc, out + m0 * n_size, n_size, row);
}

#endif  // LLMSERVE_INT8_LINEAR_AVX2

// ---- the drivers, one for both levels: blocks of 32 output rows dealt out to the threads ----------
#if defined(LLMSERVE_INT8_LINEAR) || defined(LLMSERVE_INT8_LINEAR_AVX2)

// Each expert that has rows: (expert, its first row, its end row).
struct BusyExpert {
  int64_t expert, begin, end;
};

std::vector<BusyExpert> busy_experts(const Experts& experts) {
  std::vector<BusyExpert> busy;
  for (int64_t e = 0, begin = 0; e < experts.count; begin = experts.ends[e++])
    if (experts.ends[e] > begin) busy.push_back({e, begin, experts.ends[e]});
  return busy;
}

// Every (busy expert, block of 32 output rows) is one work item, dealt out to the threads in runs of
// at least 64 KiB of weights; `run(expert, block, first row, end row)` computes one.
template <typename Run>
void for_each_block(const Experts& experts, int64_t n_size, int64_t block_bytes, const Run& run) {
  const auto busy = busy_experts(experts);
  const int64_t blocks = (n_size + kRows - 1) / kRows;
  const int64_t items = static_cast<int64_t>(busy.size()) * blocks;
  const auto run_items = [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const BusyExpert& e = busy[item / blocks];
      run(e.expert, item % blocks, e.begin, e.end);
    }
  };
  // a thread of the caller's region: its contiguous run of the items (one expert's rows are a layer's;
  // several experts' items record no rows)
  if (run_thread_part(items, busy.size() == 1 ? n_size : 0, run_items)) return;
  at::parallel_for(0, items, std::max<int64_t>(1, (64 * 1024) / block_bytes), run_items);
}

// Inputs in passes of at most 4 rows (accumulators stay in registers) over each block of the level's
// int8_block; the first pass streams the block's weights in, later ones re-read them from the L2 cache.
// A row's sums run in the same order whatever the pass, the row count and the other experts: its
// output does not depend on the other rows of the batch.
// scales: float32 [N] per row (Group 0), or the packed scales per Group columns in float32 or float16.
template <int Group, typename Out, typename Param = float>
void int8_linear(const QuantizedInput& in, const Experts& experts, const uint8_t* packed, const Param* scales,
                 Out* out, int64_t k_size, int64_t n_size) {
  static_assert(Group != 0 || std::is_same_v<Param, float>, "row scales are float32");
  const int64_t block_bytes = kRows * k_size;
  for_each_block(experts, n_size, block_bytes, [&](int64_t expert, int64_t b, int64_t m_begin, int64_t m_end) {
    const uint8_t* block = packed + expert * experts.weight_stride + b * block_bytes;
    const Param* expert_scales = scales + expert * experts.param_stride;
    const float* row_scales = reinterpret_cast<const float*>(expert_scales);  // !Grouped only
    const Param* group_scales = expert_scales + b * kGroupScales<Param> * (k_size / std::max(Group, 1));  // Group > 0
    const int64_t row = b * kRows;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kMaxRowsPerPass) {
      const bool first = m0 == m_begin;
      switch (std::min<int64_t>(kMaxRowsPerPass, m_end - m0)) {
        case 1: int8_block<1, Group>(in, m0, block, row_scales, group_scales, out, k_size, n_size, row, first); break;
        case 2: int8_block<2, Group>(in, m0, block, row_scales, group_scales, out, k_size, n_size, row, first); break;
        case 3: int8_block<3, Group>(in, m0, block, row_scales, group_scales, out, k_size, n_size, row, first); break;
        default: int8_block<4, Group>(in, m0, block, row_scales, group_scales, out, k_size, n_size, row, first); break;
      }
    }
  });
}

// The int4 blocks likewise; `group_sums` (sum x per group, from the rounded input) feed the offsets.
// FiveBit: each block's nibbles are followed by its plane of fifth bits.
template <bool FiveBit, typename Out, typename Param>
void int4_linear(const QuantizedInput& in, const Experts& experts, const uint8_t* packed, const Param* params,
                 Out* out, int64_t k_size, int64_t n_size, int64_t group_size) {
  const int64_t m_size = experts.ends[experts.count - 1], groups = k_size / group_size;
  const int64_t input_blocks = k_size / kInputBlock, blocks_per_group = group_size / kInputBlock;
  std::vector<float> group_sums(m_size * groups, 0.0f);  // sum x over each group, from the rounded input
  for (int64_t m = 0; m < m_size; ++m)
    for (int64_t b = 0; b < input_blocks; ++b)
      group_sums[m * groups + b / blocks_per_group] += in.scales[m * input_blocks + b] * in.sums[m * input_blocks + b];
  const int64_t nibble_bytes = kRows * k_size / 2, block_bytes = nibble_bytes + (FiveBit ? kRows * k_size / 8 : 0);
  const float* sums = group_sums.data();
  for_each_block(experts, n_size, block_bytes, [&](int64_t expert, int64_t b, int64_t m_begin, int64_t m_end) {
    const uint8_t* block = packed + expert * experts.weight_stride + b * block_bytes;
    const uint8_t* plane = block + nibble_bytes;  // FiveBit only
    const Param* block_params = params + expert * experts.param_stride + b * groups * kGroupParams<Param>;
    const int64_t row = b * kRows;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kMaxRowsPerPass) {
      const bool first = m0 == m_begin;
      switch (std::min<int64_t>(kMaxRowsPerPass, m_end - m0)) {
        case 1: int4_block<1, FiveBit>(in, m0, block, plane, block_params, sums, out, k_size, n_size, row, group_size, first); break;
        case 2: int4_block<2, FiveBit>(in, m0, block, plane, block_params, sums, out, k_size, n_size, row, group_size, first); break;
        case 3: int4_block<3, FiveBit>(in, m0, block, plane, block_params, sums, out, k_size, n_size, row, group_size, first); break;
        default: int4_block<4, FiveBit>(in, m0, block, plane, block_params, sums, out, k_size, n_size, row, group_size, first); break;
      }
    }
  });
}

#endif

}  // namespace

// Whether this build has the int8 and int4 kernels for inputs of this dtype: bf16 at either level,
// float32 too at the AVX2 level (the dtype AVX2 CPUs serve models in).
bool small_batch_linear_int8_supported(at::ScalarType input) {
#if defined(LLMSERVE_INT8_LINEAR)
  return input == at::kBFloat16;
#elif defined(LLMSERVE_INT8_LINEAR_AVX2)
  return input == at::kBFloat16 || input == at::kFloat;
#else
  return false;
#endif
}

// qweight [N, K] int8 (|q| <= 127), K a multiple of 32 -> [N', K] uint8 with N' = N rounded up to a
// multiple of 32: q + 128 in blocks of 32 rows, four columns per row at a time (zero rows pad).
at::Tensor small_batch_pack_int8(at::Tensor qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "small_batch_pack_int8 takes 2-D int8 codes");
  TORCH_CHECK(qweight.size(1) % kInputBlock == 0, "small_batch_linear_int8 needs an input width that is a multiple of 32");
  TORCH_CHECK(qweight.numel() == 0 || qweight.min().item<int>() >= -127, "int8 codes must lie in [-127, 127]");
  const int64_t n_size = qweight.size(0), k_size = qweight.size(1);
  const int64_t padded = (n_size + kRows - 1) / kRows * kRows;
  auto rows = at::full({padded, k_size}, 128, qweight.options().dtype(at::kByte));
  rows.narrow(0, 0, n_size).copy_((qweight.to(at::kShort) + 128).to(at::kByte));
  return rows.view({padded / kRows, kRows, k_size / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({padded, k_size});
}

namespace {

// values as float16 where that is exact for every one of them (a GGUF file's scales are float16, so
// the kernels then stream the file's scale bytes, not twice as many), else unchanged in float32.
at::Tensor half_if_exact(const at::Tensor& values) {
  const auto half = values.to(at::kHalf);
  return half.to(at::kFloat).equal(values) ? half : values;
}

}  // namespace

// scales [N, K / G] float32 of int8 codes in groups of G = 32 (GGUF Q8_0, Q5_0) or 16 (Q6_K) columns
// -> the layout small_batch_linear_int8 reads them in: [N' / 32, K / G, 32], zero rows padding N to N';
// float16 where every scale is exact in it, else float32.
at::Tensor small_batch_pack_int8_group_scales(at::Tensor scales) {
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat, "group scales must be float32 [N, K / G]");
  const int64_t n_size = scales.size(0), groups = scales.size(1);
  const int64_t padded = (n_size + kRows - 1) / kRows * kRows;
  auto rows = at::zeros({padded, groups}, scales.options());
  rows.narrow(0, 0, n_size).copy_(scales);
  return half_if_exact(rows.view({padded / kRows, kRows, groups}).permute({0, 2, 1}).contiguous());
}

namespace {

// The groups per row of int8 scales packed for K input columns ([N' / 32, K / G, 32] float32 or float16 for
// G = 32 or 16, or [N' / 32, K / 256, 576] factored int8 for G = 16); 0 for any other layout.
int64_t int8_scale_groups(const at::Tensor& scales, int64_t k_size) {
  if (scales.dim() != 3) return 0;
  const auto type = scales.scalar_type();
  if (type == at::kChar)
    return scales.size(2) == kScaleSuperBytes && scales.size(1) * kScaleSuperGroups * 16 == k_size ? k_size / 16 : 0;
  const bool width = scales.size(1) * kInputBlock == k_size || scales.size(1) * 16 == k_size;
  return (type == at::kFloat || type == at::kHalf) && scales.size(2) == kRows && width ? scales.size(1) : 0;
}

// The int8 entry points' checks.
void check_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n_size) {
  TORCH_CHECK(small_batch_linear_int8_supported(), "small_batch_linear_int8 needs a CPU with AVX2 and FMA");
  TORCH_CHECK(small_batch_linear_int8_supported(x.scalar_type()) && x.dim() == 2 && x.is_contiguous(),
              "small_batch_linear_int8 takes contiguous bfloat16 inputs [M, K] (float32 too at the AVX2 level)");
  TORCH_CHECK(x.size(0) >= 1, "small_batch_linear_int8 takes at least one row");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(1) == x.size(1) &&
                  packed.is_contiguous(),
              "small_batch_linear_int8 takes weights packed by small_batch_pack_int8");
  TORCH_CHECK(x.size(1) % kInputBlock == 0, "small_batch_linear_int8 needs an input width that is a multiple of 32");
  TORCH_CHECK(n_size >= 1 && (n_size + kRows - 1) / kRows * kRows == packed.size(0),
              "small_batch_linear_int8 takes weights packed by small_batch_pack_int8 for out_features rows");
  TORCH_CHECK(scales.is_contiguous() &&
                  (scales.dim() == 3 ? scales.size(0) * kRows == packed.size(0) && int8_scale_groups(scales, x.size(1))
                                     : scales.dim() == 1 && scales.size(0) == n_size && scales.scalar_type() == at::kFloat),
              "scales must be float32 [N], or packed by small_batch_pack_int8_group_scales (float32 or float16, or "
              "factored int8)");
}

#if defined(LLMSERVE_INT8_LINEAR) || defined(LLMSERVE_INT8_LINEAR_AVX2)
// x's rows rounded to 8-bit codes per 32 columns (the entry points checked its dtype).
QuantizedInput quantized_rows(const at::Tensor& x) {
#ifdef LLMSERVE_INT8_LINEAR_AVX2
  if (x.scalar_type() == at::kFloat) return quantize_input(x.data_ptr<float>(), x.size(0), x.size(1));
#endif
  return quantize_input(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), x.size(0), x.size(1));
}
#endif

// x's rows against each expert's weights: `packed` and `scales` are expert 0's (one expert: the layer's),
// the others follow at the experts' strides.
template <typename Out>
void run_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, Out* out,
              int64_t n_size, const Experts& experts) {
#if defined(LLMSERVE_INT8_LINEAR) || defined(LLMSERVE_INT8_LINEAR_AVX2)
  const auto input = quantized_rows(x);
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const int64_t k_size = x.size(1);
  const bool half = scales.scalar_type() == at::kHalf;
  if (scales.dim() != 3)
    int8_linear<0>(input, experts, codes, scales.data_ptr<float>(), out, k_size, n_size);
  else if (scales.scalar_type() == at::kChar)
    int8_linear<16>(input, experts, codes, scales.data_ptr<int8_t>(), out, k_size, n_size);
  else if (scales.size(1) * 16 == k_size && half)
    int8_linear<16>(input, experts, codes, scales.data_ptr<c10::Half>(), out, k_size, n_size);
  else if (scales.size(1) * 16 == k_size)
    int8_linear<16>(input, experts, codes, scales.data_ptr<float>(), out, k_size, n_size);
  else if (half)
    int8_linear<32>(input, experts, codes, scales.data_ptr<c10::Half>(), out, k_size, n_size);
  else
    int8_linear<32>(input, experts, codes, scales.data_ptr<float>(), out, k_size, n_size);
#endif
}

// The groups per row of int4 parameters laid out for K input columns (4-D: [N' / 32, groups, 2, 32] float32
// or float16, or [N' / 32, groups / 8, 5, 128] bytes factored by super-blocks), each a multiple of 32
// columns; 0 for any other layout.
int64_t int4_groups(const at::Tensor& params, int64_t k_size) {
  if (params.dim() != 4 || !params.is_contiguous()) return 0;
  const auto type = params.scalar_type();
  const bool flat = (type == at::kFloat || type == at::kHalf) && params.size(2) == 2 && params.size(3) == kRows;
  const bool factored = type == at::kByte && params.size(2) * params.size(3) == kSuperBytes && params.size(3) == 128;
  const int64_t groups = params.size(1) * (factored ? kSuperGroups : 1);
  if (!(flat || factored) || groups < 1 || k_size % groups || (k_size / groups) % kInputBlock) return 0;
  return groups;
}

// The int4 entry points' checks; whether the codes are 5-bit (a plane of fifth bits follows each block).
bool check_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params, int64_t out_features) {
  TORCH_CHECK(small_batch_linear_int8_supported(), "small_batch_linear_int4 needs a CPU with AVX2 and FMA");
  TORCH_CHECK(small_batch_linear_int8_supported(x.scalar_type()) && x.dim() == 2 && x.is_contiguous(),
              "small_batch_linear_int4 takes contiguous bfloat16 inputs [M, K] (float32 too at the AVX2 level)");
  TORCH_CHECK(x.size(0) >= 1, "small_batch_linear_int4 takes at least one row");
  TORCH_CHECK(x.size(1) % kInputBlock == 0, "small_batch_linear_int4 needs an input width that is a multiple of 32");
  const int64_t padded = (out_features + kRows - 1) / kRows * kRows;
  const bool five_bit = packed.dim() == 2 && packed.size(1) * 8 == x.size(1) * 5;  // its fifth bits' plane too
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == padded && (packed.size(1) * 2 == x.size(1) || five_bit) &&
                  int4_groups(params, x.size(1)) > 0 && params.size(0) * kRows == padded,
              "small_batch_linear_int4 takes weights packed by small_batch_pack_int4 for out_features rows");
  return five_bit;
}

void run_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params, at::Tensor& out,
              int64_t out_features, bool five_bit, const Experts& experts) {
#if defined(LLMSERVE_INT8_LINEAR) || defined(LLMSERVE_INT8_LINEAR_AVX2)
  const auto input = quantized_rows(x);
  const int64_t group_size = x.size(1) / int4_groups(params, x.size(1));
  const auto run = [&](auto five, auto* params_data) {
    constexpr bool FiveBit = decltype(five)::value;
#ifdef LLMSERVE_INT8_LINEAR_AVX2
    if (x.scalar_type() == at::kFloat) {
      int4_linear<FiveBit>(input, experts, packed.data_ptr<uint8_t>(), params_data, out.data_ptr<float>(),
                           x.size(1), out_features, group_size);
      return;
    }
#endif
    int4_linear<FiveBit>(input, experts, packed.data_ptr<uint8_t>(), params_data,
                         reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), x.size(1), out_features,
                         group_size);
  };
  const auto run_params = [&](auto five) {
    if (params.scalar_type() == at::kHalf)
      run(five, params.data_ptr<c10::Half>());
    else if (params.scalar_type() == at::kByte)
      run(five, params.data_ptr<uint8_t>());
    else
      run(five, params.data_ptr<float>());
  };
  if (five_bit)
    run_params(std::true_type{});
  else
    run_params(std::false_type{});
#endif
}

// The grouped entry points' experts: ends [E] int64, non-decreasing, the last x's row count; E the
// experts stacked in packed [E, ...] and scales [E, ...].
Experts grouped_experts(const at::Tensor& x, const at::Tensor& ends, const at::Tensor& packed,
                        const at::Tensor& scales) {
  TORCH_CHECK(ends.scalar_type() == at::kLong && ends.dim() == 1 && ends.is_contiguous() && ends.size(0) >= 1 &&
                  packed.dim() >= 3 && scales.dim() >= 2 && ends.size(0) == packed.size(0) &&
                  ends.size(0) == scales.size(0) && packed.is_contiguous() && scales.is_contiguous(),
              "grouped_linear takes ends [E] int64 and each expert's packed weights and scales stacked [E, ...]");
  const int64_t* bounds = ends.data_ptr<int64_t>();
  for (int64_t e = 0, begin = 0; e < ends.size(0); begin = bounds[e++])
    TORCH_CHECK(bounds[e] >= begin, "grouped_linear's ends must not decrease");
  TORCH_CHECK(bounds[ends.size(0) - 1] == x.size(0), "grouped_linear's last end must be x's row count");
  return {bounds, ends.size(0), packed[0].numel(), scales[0].numel()};
}

}  // namespace

void small_batch_linear_quantized_into(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                                       int64_t out_features, at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == out_features,
              "small_batch_linear_quantized_into: out must be contiguous [M, out_features] in x's dtype");
  const int64_t rows = x.size(0);
  if (scales.dim() == 4) {
    const bool five_bit = check_int4(x, weight, scales, out_features);
    run_int4(x, weight, scales, out, out_features, five_bit, {&rows, 1});
    return;
  }
  check_int8(x, weight, scales, out_features);
  if (x.scalar_type() == at::kFloat)
    run_int8(x, weight, scales, out.data_ptr<float>(), out_features, {&rows, 1});
  else
    run_int8(x, weight, scales, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), out_features, {&rows, 1});
}

// x [M, K] bf16 (or float32 at the AVX2 level), any M >= 1, packed from small_batch_pack_int8, and
// scales: [N] float32 per row, or from small_batch_pack_int8_group_scales for groups of 32 or 16 columns.
// Returns [M, N] in x's dtype: x' W^T with W the scaled codes, x' being x rounded to 8 bits per 32-column
// block.
at::Tensor small_batch_linear_int8(at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t out_features) {
  check_int8(x, packed, scales, out_features);
  auto out = at::empty({x.size(0), out_features}, x.options());
  const int64_t rows = x.size(0);
  if (x.scalar_type() == at::kFloat)
    run_int8(x, packed, scales, out.data_ptr<float>(), out_features, {&rows, 1});
  else
    run_int8(x, packed, scales, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), out_features, {&rows, 1});
  return out;
}

// x [T, K] whose rows [ends[e - 1], ends[e]) go to expert e, against each expert's packed int8 weights
// and scales stacked [E, ...] (each as small_batch_linear_int8 takes them). Returns [T, N] in x's dtype,
// each row what small_batch_linear_int8 gives it against its expert's weights.
at::Tensor grouped_linear_int8(at::Tensor x, at::Tensor ends, at::Tensor packed, at::Tensor scales,
                               int64_t out_features) {
  const auto experts = grouped_experts(x, ends, packed, scales);
  auto out = at::empty({x.size(0), out_features}, x.options());
  // no rows routed here (a rank's experts under expert parallelism): the layout still checked
  check_int8(x.size(0) ? x : at::empty({1, x.size(1)}, x.options()), packed[0], scales[0], out_features);
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat)
    run_int8(x, packed[0], scales[0], out.data_ptr<float>(), out_features, experts);
  else
    run_int8(x, packed[0], scales[0], reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), out_features,
             experts);
  return out;
}

// The same, returning [M, N] float32: the logits of a quantized output projection, unrounded.
at::Tensor small_batch_linear_int8_float_out(at::Tensor x, at::Tensor packed, at::Tensor scales,
                                             int64_t out_features) {
  check_int8(x, packed, scales, out_features);
  auto out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  const int64_t rows = x.size(0);
  run_int8(x, packed, scales, out.data_ptr<float>(), out_features, {&rows, 1});
  return out;
}

// codes [N, K] uint8 (0..15; bits 5: 0..31), scales and offsets [N, K / group_size] float32, group_size a
// multiple of 32 dividing K -> (packed [N', K / 2] uint8, params [N' / 32, groups, 2, 32]) with N' = N
// rounded up to a multiple of 32 (zero rows pad); params in float16 where every scale and offset is exact
// in it (GGUF Q4_0/Q4_1/Q5_0's, or float16 checkpoints'), else float32. bits 5: packed [N', 5 K / 8],
// each 32-row block's nibbles followed by its plane of fifth bits (the header says how they lie).
std::vector<at::Tensor> small_batch_pack_int4(at::Tensor codes, at::Tensor scales, at::Tensor offsets,
                                              int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "small_batch_pack_int4 takes 2-D uint8 codes");
  TORCH_CHECK(bits == 4 || bits == 5, "small_batch_pack_int4 packs 4- or 5-bit codes");
  TORCH_CHECK(codes.numel() == 0 || codes.max().item<int>() < (1 << bits),
              bits == 4 ? "int4 codes must lie in [0, 15]" : "5-bit codes must lie in [0, 31]");
  const int64_t n_size = codes.size(0), k_size = codes.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n_size && scales.sizes() == offsets.sizes(),
              "scales and offsets must be [N, groups]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups >= 1 && k_size % groups == 0 && (k_size / groups) % kInputBlock == 0,
              "int4 groups must be a multiple of 32 columns");
  const int64_t padded = (n_size + kRows - 1) / kRows * kRows;
  auto rows = at::zeros({padded, k_size}, codes.options());
  rows.narrow(0, 0, n_size).copy_(codes);
  // [blocks, 32 rows, K/8, 2 halves, 4] -> [blocks, K/8, 32 rows, 4] bytes of (low | high << 4)
  auto split = rows.bitwise_and(0x0F).view({padded / kRows, kRows, k_size / 8, 2, 4});
  auto bytes = split.select(3, 0).bitwise_or(split.select(3, 1).bitwise_left_shift(4));
  auto packed = bytes.permute({0, 2, 1, 3}).contiguous().view({padded, k_size / 2});
  if (bits == 5) {
    // [blocks, 32 rows, K/8, 2 halves, 4] fifth bits -> [blocks, K/8, 2 halves, 16 row pairs, 2, 4]: bit
    // 4 (row % 2) + column of byte 16 half + row / 2 of the chunk's 32
    auto fifth = rows.bitwise_right_shift(4).view({padded / kRows, kRows / 2, 2, k_size / 8, 2, 4});
    auto weights = at::tensor({1, 2, 4, 8, 16, 32, 64, 128}, codes.options()).view({2, 4});
    auto plane = fifth.permute({0, 3, 4, 1, 2, 5}).mul(weights).sum({-2, -1}, false, at::kByte);
    packed = at::cat({packed.view({padded / kRows, -1}), plane.reshape({padded / kRows, -1})}, 1)
                 .view({padded, k_size / 8 * 5});
  }
  auto params = at::zeros({padded, groups, 2}, scales.options().dtype(at::kFloat));
  params.narrow(0, 0, n_size).select(2, 0).copy_(scales);
  params.narrow(0, 0, n_size).select(2, 1).copy_(offsets);
  params = params.view({padded / kRows, kRows, groups, 2}).permute({0, 2, 3, 1}).contiguous();
  return {packed, half_if_exact(params)};
}

// x [M, K] bf16 (or float32 at the AVX2 level), any M >= 1, (packed, params) from
// small_batch_pack_int4, N output rows. Returns [M, N] in x's dtype: x' W^T with W = q * scale + offset
// per group, x' being x rounded to 8 bits per 32 columns.
at::Tensor small_batch_linear_int4(at::Tensor x, at::Tensor packed, at::Tensor params, int64_t out_features) {
  const bool five_bit = check_int4(x, packed, params, out_features);
  auto out = at::empty({x.size(0), out_features}, x.options());
  const int64_t rows = x.size(0);
  run_int4(x, packed, params, out, out_features, five_bit, {&rows, 1});
  return out;
}

// x [T, K] whose rows [ends[e - 1], ends[e]) go to expert e, against each expert's int4 weights packed
// by small_batch_pack_int4 and stacked: packed [E, N', ...], params [E, N' / 32, groups, 2, 32]. Returns
// [T, N] in x's dtype, each row what small_batch_linear_int4 gives it against its expert's weights.
at::Tensor grouped_linear_int4(at::Tensor x, at::Tensor ends, at::Tensor packed, at::Tensor params,
                               int64_t out_features) {
  const auto experts = grouped_experts(x, ends, packed, params);
  auto out = at::empty({x.size(0), out_features}, x.options());
  // no rows routed here (a rank's experts under expert parallelism): the layout still checked
  const bool five_bit =
      check_int4(x.size(0) ? x : at::empty({1, x.size(1)}, x.options()), packed[0], params[0], out_features);
  if (x.size(0) == 0) return out;
  run_int4(x, packed[0], params[0], out, out_features, five_bit, experts);
  return out;
}

// ---- the packed layouts read back as float32 weights --------------------------------------------
// A quantized layer keeps only its packed copy: batches above the small-batch kernels' rows multiply
// by the float weight rebuilt from it, one pass over the codes. Products and sums stay two roundings
// (no fused multiply-add), as Int8Weight/Int4Weight.dequantize compute them, so the weights are equal.

namespace {

// Row r of one 32-row block (its own function: the attribute does not reach into a lambda).
// `plane`: the block's fifth bits (5-bit codes), or null.
template <typename Param>
__attribute__((optimize("fp-contract=off"))) void dequantize_int4_row(const uint8_t* block, const uint8_t* plane,
                                                                     const Param* block_params, float* dst,
                                                                     int64_t r, int64_t k_size, int64_t group_size) {
  for (int64_t chunk = 0; chunk < k_size / 8; ++chunk) {
    const uint8_t* bytes = block + (chunk * kRows + r) * 4;  // columns 8 chunk.. (low), +4.. (high)
    const int64_t g = chunk * 8 / group_size;
    const float scale = group_param(block_params, g, 0, r), offset = group_param(block_params, g, 1, r);
    // the chunk's low-nibble bits of row r, then its high-nibble ones: 4 bits each
    const int low_bits = plane ? (plane[chunk * kRows + r / 2] >> (4 * (r % 2))) & 0x0F : 0;
    const int high_bits = plane ? (plane[chunk * kRows + 16 + r / 2] >> (4 * (r % 2))) & 0x0F : 0;
    for (int j = 0; j < 4; ++j) {
      const float low = static_cast<float>((bytes[j] & 0x0F) | (((low_bits >> j) & 1) << 4)) * scale;
      const float high = static_cast<float>((bytes[j] >> 4) | (((high_bits >> j) & 1) << 4)) * scale;
      dst[chunk * 8 + j] = low + offset;
      dst[chunk * 8 + 4 + j] = high + offset;
    }
  }
}

// Rows `ids` (every row in order where `all_rows`) of an int4 weight into out [count, K].
template <typename Param>
void dequantize_int4_rows(const uint8_t* packed, const Param* params, float* out, int64_t k_size, int64_t groups,
                          bool five_bit, bool all_rows, const int64_t* ids, int64_t count) {
  const int64_t nibble_bytes = kRows * k_size / 2, block_bytes = nibble_bytes + (five_bit ? kRows * k_size / 8 : 0);
  at::parallel_for(0, count, all_rows ? kRows : 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = all_rows ? i : ids[i], b = row / kRows;
      const uint8_t* block = packed + b * block_bytes;
      dequantize_int4_row(block, five_bit ? block + nibble_bytes : nullptr, params + b * groups * kGroupParams<Param>,
                          out + i * k_size, row % kRows, k_size, k_size / groups);
    }
  });
}

// Rows `ids` (every row in order where `all_rows`) of an int8 weight into out [count, K].
template <typename Param>
void dequantize_int8_rows(const uint8_t* packed, const Param* scales, float* out, int64_t k_size, int64_t groups,
                          bool all_rows, const int64_t* ids, int64_t count) {
  const int64_t group_size = groups ? k_size / groups : k_size;  // groups 0: one float32 scale per row
  at::parallel_for(0, count, all_rows ? kRows : 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = all_rows ? i : ids[i], b = row / kRows, r = row % kRows;
      const uint8_t* block = packed + b * kRows * k_size;
      float* dst = out + i * k_size;
      for (int64_t quad = 0; quad < k_size / 4; ++quad) {
        const uint8_t* bytes = block + (quad * kRows + r) * 4;
        const float scale = groups ? group_scale(scales + b * groups * kGroupScales<Param>, quad * 4 / group_size, r)
                                   : static_cast<float>(scales[row]);
        for (int j = 0; j < 4; ++j) dst[quad * 4 + j] = static_cast<float>(int{bytes[j]} - 128) * scale;
      }
    }
  });
}

// The rows a dequantize call rebuilds: every row in order (`all`), or the ids asked for (int64, any
// shape, each in [0, n_size), checked), flattened; `ids` is null when there are none (an empty tensor's
// data pointer may be null).
struct RowIds {
  at::Tensor flat;
  bool all;
  int64_t count;
  const int64_t* ids;
};

RowIds row_ids(const std::optional<at::Tensor>& rows, int64_t n_size) {
  if (!rows) return {at::Tensor(), true, n_size, nullptr};
  TORCH_CHECK(rows->scalar_type() == at::kLong && rows->device().is_cpu(), "rows must be int64 row ids on the CPU");
  auto flat = rows->reshape({-1}).contiguous();
  const int64_t count = flat.numel();
  const int64_t* ids = count ? flat.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n_size, "row id out of range: ", ids[i], " of ", n_size, " rows");
  return {flat, false, count, ids};
}

}  // namespace

// (packed, params) from small_batch_pack_int4 for out_features rows (bits 4 or 5) -> the float32 W [N, K]
// that small_batch_linear_int4 multiplies by: q * scale + offset per group; with `rows`, only those rows
// ([rows.numel(), K], in their order: an embedding's lookups on a tied head's one copy).
at::Tensor small_batch_dequantize_int4(at::Tensor packed, at::Tensor params, int64_t out_features,
                                       int64_t bits, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == (out_features + kRows - 1) / kRows * kRows &&
                  (bits == 4 || (bits == 5 && packed.size(1) % 5 == 0)),
              "small_batch_dequantize_int4 takes weights packed by small_batch_pack_int4 for out_features rows");
  const int64_t k_size = bits == 4 ? packed.size(1) * 2 : packed.size(1) / 5 * 8;
  const int64_t groups = int4_groups(params, k_size);
  TORCH_CHECK(groups > 0 && params.size(0) * kRows == packed.size(0),
              "small_batch_dequantize_int4 takes weights packed by small_batch_pack_int4 for out_features rows");
  const RowIds ids = row_ids(rows, out_features);
  auto out = at::empty({ids.count, k_size}, packed.options().dtype(at::kFloat));
  if (params.scalar_type() == at::kHalf)
    dequantize_int4_rows(packed.data_ptr<uint8_t>(), params.data_ptr<c10::Half>(), out.data_ptr<float>(), k_size,
                         groups, bits == 5, ids.all, ids.ids, ids.count);
  else if (params.scalar_type() == at::kByte)
    dequantize_int4_rows(packed.data_ptr<uint8_t>(), params.data_ptr<uint8_t>(), out.data_ptr<float>(), k_size,
                         groups, bits == 5, ids.all, ids.ids, ids.count);
  else
    dequantize_int4_rows(packed.data_ptr<uint8_t>(), params.data_ptr<float>(), out.data_ptr<float>(), k_size, groups,
                         bits == 5, ids.all, ids.ids, ids.count);
  return out;
}

// packed from small_batch_pack_int8 with its scales ([N] float32 per row, or packed per 32 or 16
// columns) -> the float32 W [N, K] that small_batch_linear_int8 multiplies by: q * scale; with `rows`, only
// those rows.
at::Tensor small_batch_dequantize_int8(at::Tensor packed, at::Tensor scales, int64_t out_features,
                                       const std::optional<at::Tensor>& rows) {
  const bool grouped = scales.dim() == 3;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == (out_features + kRows - 1) / kRows * kRows && scales.is_contiguous() &&
                  (grouped ? scales.size(0) * kRows == packed.size(0) && int8_scale_groups(scales, packed.size(1))
                           : scales.dim() == 1 && scales.size(0) == out_features &&
                                 scales.scalar_type() == at::kFloat),
              "small_batch_dequantize_int8 takes weights packed by small_batch_pack_int8 and their scales");
  const int64_t k_size = packed.size(1), groups = grouped ? int8_scale_groups(scales, k_size) : 0;
  const RowIds ids = row_ids(rows, out_features);
  auto out = at::empty({ids.count, k_size}, packed.options().dtype(at::kFloat));
  if (grouped && scales.scalar_type() == at::kChar)
    dequantize_int8_rows(packed.data_ptr<uint8_t>(), scales.data_ptr<int8_t>(), out.data_ptr<float>(), k_size,
                         groups, ids.all, ids.ids, ids.count);
  else if (grouped && scales.scalar_type() == at::kHalf)
    dequantize_int8_rows(packed.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), out.data_ptr<float>(), k_size,
                         groups, ids.all, ids.ids, ids.count);
  else
    dequantize_int8_rows(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.data_ptr<float>(), k_size, groups,
                         ids.all, ids.ids, ids.count);
  return out;
}
