// Quantized linear layers at small batch (bfloat16 x [M, K], M <= 8): int8 codes Q [N, K] (|q| <= 127)
// with one float scale per output row (per-channel weight-only quantization: `int8`), y = (x Q^T) * s,
// or per (row, 32 columns) (GGUF Q8_0);
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
// The input rounding is the only difference from an exact product: a relative error of at most
// 1/254 of each block's largest input per element, which `llmserve eval ppl` measures on real text
// (docs/quantization.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

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
#endif

namespace {

constexpr int kRows = 32;        // output rows per packed block
constexpr int kInputBlock = 32;  // input columns per activation scale
constexpr int kMaxRowsPerPass = 4;
// How far ahead of the loads the weight stream is prefetched: 8 KiB read 5-12% faster than 2 KiB
// at 1-8 rows, and 16 KiB no faster (linear_micro, Zen 5).
constexpr int kPrefetchBytes = 128 * 64;

#ifdef LLMSERVE_INT8_LINEAR

// Four input codes as one 32-bit lane value (memcpy: no aliasing or alignment assumptions).
inline int32_t four_codes(const int8_t* codes) {
  int32_t value;
  std::memcpy(&value, codes, sizeof(value));
  return value;
}

// x rows -> int8 codes [M, K], a scale per (row, 32-column block) [M, K/32], and the sum of each
// block's codes [M, K/32].
struct QuantizedInput {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<int32_t> sums;
};

QuantizedInput quantize_input(const uint16_t* x, int64_t m_size, int64_t k_size) {
  const int64_t blocks = k_size / kInputBlock;
  QuantizedInput q{std::vector<int8_t>(m_size * k_size), std::vector<float>(m_size * blocks),
                   std::vector<int32_t>(m_size * blocks)};
  for (int64_t m = 0; m < m_size; ++m) {
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
      q.sums[m * blocks + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(low_codes, high_codes));
    }
  }
  return q;
}

// Rows [row, row + 32) of inputs [m0, m0 + MC) from one packed block; rows >= n_size are not written.
// Scales: one per output row (`row_scales`, per-channel), or with Grouped one per (row, 32 columns)
// (`group_scales`: the block's [K/32][32], GGUF Q8_0).
template <int MC, bool Grouped, typename Out>
inline void int8_block(const QuantizedInput& in, int64_t m0, const uint8_t* block, const float* row_scales,
                       const float* group_scales, Out* out, int64_t k_size, int64_t n_size, int64_t row) {
  const int64_t blocks = k_size / kInputBlock;
  __m512 acc[2][MC];
  for (int m = 0; m < MC; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i sums[2][MC];
    for (int m = 0; m < MC; ++m) sums[0][m] = sums[1][m] = _mm512_setzero_si512();
    const uint8_t* weights = block + b * kInputBlock * kRows;  // 8 column quads x 32 rows x 4 bytes
    for (int quad = 0; quad < kInputBlock / 4; ++quad) {
      const uint8_t* lines = weights + quad * 4 * kRows;  // two cache lines: rows 0-15, rows 16-31
      _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes + 64, _MM_HINT_T0);
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
      weight_scale[0] = _mm512_loadu_ps(group_scales + b * kRows);
      weight_scale[1] = _mm512_loadu_ps(group_scales + b * kRows + 16);
    }
    for (int m = 0; m < MC; ++m) {
      const __m512i correction = _mm512_set1_epi32(128 * in.sums[(m0 + m) * blocks + b]);  // the + 128
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

template <bool Grouped, typename Out>
void int8_linear(const QuantizedInput& in, int64_t m_size, const uint8_t* packed, const float* scales,
                 Out* out, int64_t k_size, int64_t n_size) {
  const int64_t blocks = (n_size + kRows - 1) / kRows;
  const int64_t block_bytes = kRows * k_size;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / block_bytes);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      // Inputs in passes of at most 4 rows (accumulators stay in registers); a block's weights are
      // then re-read from the L2 cache, not from memory.
      for (int64_t m0 = 0; m0 < m_size; m0 += kMaxRowsPerPass) {
        const uint8_t* block = packed + b * block_bytes;
        const float* group_scales = scales + b * kRows * (k_size / kInputBlock);  // Grouped only
        const int64_t row = b * kRows;
        switch (std::min<int64_t>(kMaxRowsPerPass, m_size - m0)) {
          case 1: int8_block<1, Grouped, Out>(in, m0, block, scales, group_scales, out, k_size, n_size, row); break;
          case 2: int8_block<2, Grouped, Out>(in, m0, block, scales, group_scales, out, k_size, n_size, row); break;
          case 3: int8_block<3, Grouped, Out>(in, m0, block, scales, group_scales, out, k_size, n_size, row); break;
          default: int8_block<4, Grouped, Out>(in, m0, block, scales, group_scales, out, k_size, n_size, row); break;
        }
      }
    }
  });
}

// int4: rows [row, row + 32) of inputs [m0, m0 + MC) from one packed block. `params` holds the block's
// [groups][2][32] float32 scales and offsets; `group_sums` [M, groups] is sum x over each group.
template <int MC>
inline void int4_block(const QuantizedInput& in, int64_t m0, const uint8_t* block, const float* params,
                       const float* group_sums, uint16_t* out, int64_t k_size, int64_t n_size, int64_t row,
                       int64_t group_size) {
  const int64_t blocks = k_size / kInputBlock, groups = k_size / group_size;
  const int64_t blocks_per_group = group_size / kInputBlock;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[2][MC];
  for (int m = 0; m < MC; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const float* group_params = params + g * 2 * kRows;
    const __m512 scale[2] = {_mm512_loadu_ps(group_params), _mm512_loadu_ps(group_params + 16)};
    for (int t = 0; t < 2; ++t) {
      const __m512 offset = _mm512_loadu_ps(group_params + kRows + 16 * t);
      for (int m = 0; m < MC; ++m)
        acc[t][m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(group_sums[(m0 + m) * groups + g]), acc[t][m]);
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m512i sums[2][MC];
      for (int m = 0; m < MC; ++m) sums[0][m] = sums[1][m] = _mm512_setzero_si512();
      const uint8_t* weights = block + b * kInputBlock * kRows / 2;  // 4 chunks of 8 columns x 32 rows
      for (int chunk = 0; chunk < kInputBlock / 8; ++chunk) {
        const uint8_t* lines = weights + chunk * 4 * kRows;  // two cache lines: rows 0-15, rows 16-31
        _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(lines) + kPrefetchBytes + 64, _MM_HINT_T0);
        __m512i low[2], high[2];
        for (int t = 0; t < 2; ++t) {
          const __m512i packed = _mm512_loadu_si512(lines + 64 * t);
          low[t] = _mm512_and_si512(packed, nibble);
          high[t] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
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

void int4_linear(const QuantizedInput& in, int64_t m_size, const uint8_t* packed, const float* params,
                 uint16_t* out, int64_t k_size, int64_t n_size, int64_t group_size) {
  const int64_t blocks = (n_size + kRows - 1) / kRows, groups = k_size / group_size;
  const int64_t input_blocks = k_size / kInputBlock, blocks_per_group = group_size / kInputBlock;
  std::vector<float> group_sums(m_size * groups, 0.0f);  // sum x over each group, from the rounded input
  for (int64_t m = 0; m < m_size; ++m)
    for (int64_t b = 0; b < input_blocks; ++b)
      group_sums[m * groups + b / blocks_per_group] += in.scales[m * input_blocks + b] * in.sums[m * input_blocks + b];
  const int64_t block_bytes = kRows * k_size / 2;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / block_bytes);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = packed + b * block_bytes;
      const float* block_params = params + b * groups * 2 * kRows;
      for (int64_t m0 = 0; m0 < m_size; m0 += kMaxRowsPerPass) {
        const int64_t row = b * kRows;
        switch (std::min<int64_t>(kMaxRowsPerPass, m_size - m0)) {
          case 1: int4_block<1>(in, m0, block, block_params, group_sums.data(), out, k_size, n_size, row, group_size); break;
          case 2: int4_block<2>(in, m0, block, block_params, group_sums.data(), out, k_size, n_size, row, group_size); break;
          case 3: int4_block<3>(in, m0, block, block_params, group_sums.data(), out, k_size, n_size, row, group_size); break;
          default: int4_block<4>(in, m0, block, block_params, group_sums.data(), out, k_size, n_size, row, group_size); break;
        }
      }
    }
  });
}

#endif  // LLMSERVE_INT8_LINEAR

}  // namespace

bool small_batch_linear_int8_supported() {
#ifdef LLMSERVE_INT8_LINEAR
  return true;
#else
  return false;
#endif
}

// qweight [N, K] int8 (|q| <= 127), K a multiple of 32 -> [N', K] uint8 with N' = N rounded up to a
// multiple of 32: q + 128 in blocks of 32 rows, four columns per row at a time (zero rows pad).
torch::Tensor small_batch_pack_int8(torch::Tensor qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kChar, "small_batch_pack_int8 takes 2-D int8 codes");
  TORCH_CHECK(qweight.size(1) % kInputBlock == 0, "small_batch_linear_int8 needs an input width that is a multiple of 32");
  TORCH_CHECK(qweight.numel() == 0 || qweight.min().item<int>() >= -127, "int8 codes must lie in [-127, 127]");
  const int64_t n_size = qweight.size(0), k_size = qweight.size(1);
  const int64_t padded = (n_size + kRows - 1) / kRows * kRows;
  auto rows = torch::full({padded, k_size}, 128, qweight.options().dtype(torch::kByte));
  rows.narrow(0, 0, n_size).copy_((qweight.to(torch::kShort) + 128).to(torch::kByte));
  return rows.view({padded / kRows, kRows, k_size / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({padded, k_size});
}

// scales [N, K / 32] float32 of int8 codes in groups of 32 columns (GGUF Q8_0) -> the layout
// small_batch_linear_int8 reads them in: [N' / 32, K / 32, 32], zero rows padding N to N'.
torch::Tensor small_batch_pack_int8_group_scales(torch::Tensor scales) {
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == torch::kFloat, "group scales must be float32 [N, K / 32]");
  const int64_t n_size = scales.size(0), groups = scales.size(1);
  const int64_t padded = (n_size + kRows - 1) / kRows * kRows;
  auto rows = torch::zeros({padded, groups}, scales.options());
  rows.narrow(0, 0, n_size).copy_(scales);
  return rows.view({padded / kRows, kRows, groups}).permute({0, 2, 1}).contiguous();
}

namespace {

// The int8 entry points' checks (max_rows: the most rows the entry point serves).
void check_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t n_size,
                int64_t max_rows) {
  TORCH_CHECK(small_batch_linear_int8_supported(), "small_batch_linear_int8 needs a CPU with AVX-512 VNNI and BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "small_batch_linear_int8 takes contiguous bfloat16 inputs [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_rows, "small_batch_linear_int8 serves 1 to ", max_rows, " rows");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 2 && packed.size(1) == x.size(1) &&
                  packed.is_contiguous(),
              "small_batch_linear_int8 takes weights packed by small_batch_pack_int8");
  TORCH_CHECK(x.size(1) % kInputBlock == 0, "small_batch_linear_int8 needs an input width that is a multiple of 32");
  TORCH_CHECK(n_size >= 1 && (n_size + kRows - 1) / kRows * kRows == packed.size(0),
              "small_batch_linear_int8 takes weights packed by small_batch_pack_int8 for out_features rows");
  const bool grouped = scales.dim() == 3;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  (grouped ? scales.size(0) * kRows == packed.size(0) && scales.size(1) * kInputBlock == x.size(1) &&
                                 scales.size(2) == kRows
                           : scales.dim() == 1 && scales.size(0) == n_size),
              "scales must be float32 [N], or packed by small_batch_pack_int8_group_scales");
}

template <typename Out>
void run_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, Out* out,
              int64_t n_size) {
#ifdef LLMSERVE_INT8_LINEAR
  const auto input = quantize_input(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), x.size(0), x.size(1));
  if (scales.dim() == 3)
    int8_linear<true>(input, x.size(0), packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), out, x.size(1), n_size);
  else
    int8_linear<false>(input, x.size(0), packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), out, x.size(1), n_size);
#endif
}

}  // namespace

// x [M, K] bf16 with 1 <= M <= 8, packed from small_batch_pack_int8, and scales: [N] float32 per row, or
// from small_batch_pack_int8_group_scales for groups of 32 columns. Returns [M, N] bf16: x' W^T with W the
// scaled codes, x' being x rounded to 8 bits per 32-column block.
torch::Tensor small_batch_linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t out_features) {
  check_int8(x, packed, scales, out_features, 8);
  auto out = torch::empty({x.size(0), out_features}, x.options());
  run_int8(x, packed, scales, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), out_features);
  return out;
}

// The same for any M >= 1 (each block's weights are re-read from cache by every pass of 4 rows),
// returning [M, N] float32: the logits of a quantized output projection, unrounded.
torch::Tensor small_batch_linear_int8_float_out(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                                int64_t out_features) {
  check_int8(x, packed, scales, out_features, std::numeric_limits<int64_t>::max());
  auto out = torch::empty({x.size(0), out_features}, x.options().dtype(torch::kFloat));
  run_int8(x, packed, scales, out.data_ptr<float>(), out_features);
  return out;
}

// codes [N, K] uint8 (0..15), scales and offsets [N, K / group_size] float32, group_size a multiple of 32
// dividing K -> (packed [N', K / 2] uint8, params [N' / 32, groups, 2, 32] float32) with N' = N rounded up
// to a multiple of 32 (zero rows pad).
std::vector<torch::Tensor> small_batch_pack_int4(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kByte, "small_batch_pack_int4 takes 2-D uint8 codes");
  TORCH_CHECK(codes.numel() == 0 || codes.max().item<int>() <= 15, "int4 codes must lie in [0, 15]");
  const int64_t n_size = codes.size(0), k_size = codes.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n_size && scales.sizes() == offsets.sizes(),
              "scales and offsets must be [N, groups]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups >= 1 && k_size % groups == 0 && (k_size / groups) % kInputBlock == 0,
              "int4 groups must be a multiple of 32 columns");
  const int64_t padded = (n_size + kRows - 1) / kRows * kRows;
  auto rows = torch::zeros({padded, k_size}, codes.options());
  rows.narrow(0, 0, n_size).copy_(codes);
  // [blocks, 32 rows, K/8, 2 halves, 4] -> [blocks, K/8, 32 rows, 4] bytes of (low | high << 4)
  auto split = rows.view({padded / kRows, kRows, k_size / 8, 2, 4});
  auto bytes = split.select(3, 0).bitwise_or(split.select(3, 1).bitwise_left_shift(4));
  auto packed = bytes.permute({0, 2, 1, 3}).contiguous().view({padded, k_size / 2});
  auto params = torch::zeros({padded, groups, 2}, scales.options().dtype(torch::kFloat));
  params.narrow(0, 0, n_size).select(2, 0).copy_(scales);
  params.narrow(0, 0, n_size).select(2, 1).copy_(offsets);
  params = params.view({padded / kRows, kRows, groups, 2}).permute({0, 2, 3, 1}).contiguous();
  return {packed, params};
}

// x [M, K] bf16 with 1 <= M <= 8, (packed, params) from small_batch_pack_int4, N output rows. Returns
// [M, N] bf16: x' W^T with W = q * scale + offset per group, x' being x rounded to 8 bits per 32 columns.
torch::Tensor small_batch_linear_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor params, int64_t out_features) {
  TORCH_CHECK(small_batch_linear_int8_supported(), "small_batch_linear_int4 needs a CPU with AVX-512 VNNI and BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "small_batch_linear_int4 takes contiguous bfloat16 inputs [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_batch_linear_int4 serves 1 to 8 rows");
  TORCH_CHECK(x.size(1) % kInputBlock == 0, "small_batch_linear_int4 needs an input width that is a multiple of 32");
  const int64_t padded = (out_features + kRows - 1) / kRows * kRows;
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == padded && packed.size(1) * 2 == x.size(1) && params.dim() == 4 &&
                  params.scalar_type() == torch::kFloat && params.is_contiguous() && params.size(0) * kRows == padded &&
                  params.size(2) == 2 && params.size(3) == kRows && x.size(1) % params.size(1) == 0 &&
                  (x.size(1) / params.size(1)) % kInputBlock == 0,
              "small_batch_linear_int4 takes weights packed by small_batch_pack_int4 for out_features rows");
  auto out = torch::empty({x.size(0), out_features}, x.options());
#ifdef LLMSERVE_INT8_LINEAR
  const auto input = quantize_input(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), x.size(0), x.size(1));
  int4_linear(input, x.size(0), packed.data_ptr<uint8_t>(), params.data_ptr<float>(),
              reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), x.size(1), out_features,
              x.size(1) / params.size(1));
#endif
  return out;
}
