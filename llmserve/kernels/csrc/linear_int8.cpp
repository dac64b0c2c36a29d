// int8 linear layers at small batch: y = (x Q^T) * s for bfloat16 x [M, K], M <= 8, int8 codes Q [N, K]
// (|q| <= 127) and one float scale per output row (per-channel weight-only quantization: `int8`).
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
// The input rounding is the only difference from an exact product: a relative error of at most
// 1/254 of each block's largest input per element, which `llmserve eval ppl` measures on real text
// (docs/quantization.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LLMSERVE_INT8_LINEAR 1
#endif

namespace {

constexpr int kRows = 32;        // output rows per packed block
constexpr int kInputBlock = 32;  // input columns per activation scale
constexpr int kMaxRowsPerPass = 4;
constexpr int kPrefetchBytes = 32 * 64;  // how far ahead of the loads the weight stream is prefetched

#ifdef LLMSERVE_INT8_LINEAR

// x rows -> int8 codes [M, K], a scale per (row, 32-column block) [M, K/32], and 128 * (sum of the
// block's codes) [M, K/32], the correction for the weights' + 128.
struct QuantizedInput {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<int32_t> corrections;
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
      const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      const float scale = max_abs / 127.0f;
      const __m512 inverse = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
      const __m512i low_codes = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));  // nearest even
      const __m512i high_codes = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
      int8_t* dst = q.codes.data() + m * k_size + b * kInputBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(low_codes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(high_codes));
      q.scales[m * blocks + b] = scale;
      q.corrections[m * blocks + b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(low_codes, high_codes));
    }
  }
  return q;
}

// Rows [row, row + 32) of inputs [m0, m0 + MC) from one packed block; rows >= n_size are not written.
template <int MC>
inline void int8_block(const QuantizedInput& in, int64_t m0, const uint8_t* block, const float* row_scales,
                       uint16_t* out, int64_t k_size, int64_t n_size, int64_t row) {
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
        const int32_t four = *reinterpret_cast<const int32_t*>(in.codes.data() + (m0 + m) * k_size +
                                                                b * kInputBlock + 4 * quad);
        const __m512i input = _mm512_set1_epi32(four);
        sums[0][m] = _mm512_dpbusd_epi32(sums[0][m], low, input);
        sums[1][m] = _mm512_dpbusd_epi32(sums[1][m], high, input);
      }
    }
    for (int m = 0; m < MC; ++m) {
      const __m512i correction = _mm512_set1_epi32(in.corrections[(m0 + m) * blocks + b]);
      const __m512 scale = _mm512_set1_ps(in.scales[(m0 + m) * blocks + b]);
      for (int t = 0; t < 2; ++t)
        acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[t][m], correction)), scale, acc[t][m]);
    }
  }
  const int64_t valid = std::min<int64_t>(kRows, n_size - row);
  const __mmask16 masks[2] = {valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1),
                              valid >= 32   ? (__mmask16)0xFFFF
                              : valid <= 16 ? (__mmask16)0
                                            : (__mmask16)((1u << (valid - 16)) - 1)};
  for (int t = 0; t < 2; ++t) {
    const __m512 scales = _mm512_maskz_loadu_ps(masks[t], row_scales + row + 16 * t);
    for (int m = 0; m < MC; ++m) {
      const __m256i bf16 = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[t][m], scales));
      _mm256_mask_storeu_epi16(out + (m0 + m) * n_size + row + 16 * t, masks[t], bf16);
    }
  }
}

void int8_linear(const QuantizedInput& in, int64_t m_size, const uint8_t* packed, const float* row_scales,
                 uint16_t* out, int64_t k_size, int64_t n_size) {
  const int64_t blocks = (n_size + kRows - 1) / kRows;
  const int64_t block_bytes = kRows * k_size;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / block_bytes);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      // Inputs in passes of at most 4 rows (accumulators stay in registers); a block's weights are
      // then re-read from the L2 cache, not from memory.
      for (int64_t m0 = 0; m0 < m_size; m0 += kMaxRowsPerPass) {
        const uint8_t* block = packed + b * block_bytes;
        switch (std::min<int64_t>(kMaxRowsPerPass, m_size - m0)) {
          case 1: int8_block<1>(in, m0, block, row_scales, out, k_size, n_size, b * kRows); break;
          case 2: int8_block<2>(in, m0, block, row_scales, out, k_size, n_size, b * kRows); break;
          case 3: int8_block<3>(in, m0, block, row_scales, out, k_size, n_size, b * kRows); break;
          default: int8_block<4>(in, m0, block, row_scales, out, k_size, n_size, b * kRows); break;
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

// x [M, K] bf16 with 1 <= M <= 8, packed from small_batch_pack_int8, scales [N] float32. Returns [M, N] bf16:
// (x' Q^T) * scales, x' being x rounded to 8 bits per 32-column block.
torch::Tensor small_batch_linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(small_batch_linear_int8_supported(), "small_batch_linear_int8 needs a CPU with AVX-512 VNNI and BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "small_batch_linear_int8 takes contiguous bfloat16 inputs [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_batch_linear_int8 serves 1 to 8 rows");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 2 && packed.size(1) == x.size(1) &&
                  packed.is_contiguous(),
              "small_batch_linear_int8 takes weights packed by small_batch_pack_int8");
  TORCH_CHECK(x.size(1) % kInputBlock == 0, "small_batch_linear_int8 needs an input width that is a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.dim() == 1 && scales.is_contiguous() &&
                  (scales.size(0) + kRows - 1) / kRows * kRows == packed.size(0),
              "scales must be float32 [N] for the packed weight's N rows");
  const int64_t n_size = scales.size(0);
  auto out = torch::empty({x.size(0), n_size}, x.options());
#ifdef LLMSERVE_INT8_LINEAR
  const auto input = quantize_input(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), x.size(0), x.size(1));
  int8_linear(input, x.size(0), packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
              reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), x.size(1), n_size);
#endif
  return out;
}
