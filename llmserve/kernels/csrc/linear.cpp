// Linear layers at small batch: y = x W^T for bfloat16 x [M, K] and W with M <= 8 (decode at low
// concurrency, speculative verification of a few drafts). int8 and int4 weights: linear_quantized.cpp.
//
// At these sizes a linear layer is a matrix-vector product: every weight is read from memory once and
// used M times, so the work is bound by memory bandwidth, and the kernel's job is to stream the weights
// at the machine's read rate while doing as little else as possible per weight.
//
// bf16 weights are packed once (small_batch_pack) into blocks of 32 output rows stored column pair by
// column pair: [N/32][K/2][32 rows][2]. One 64-byte load then holds 16 rows' weights for columns k and
// k+1, exactly the operand vdpbf16ps pairs with the input's (x[k], x[k+1]) broadcast to every lane, so
// each lane accumulates one output row and no horizontal sums are needed; the packed matrix is read as
// one sequential stream per thread (prefetched ahead), and each input pair is used 32 x M times per
// load. Against the row-major kernel this replaced (one vector per row, a horizontal sum per output),
// a decode step's linears got 1.3x faster at one row and 1.6-1.9x at 4-8 rows, where the horizontal sums
// had made the old kernel compute-bound (docs/benchmarks.md, session 6). A row's result does not depend
// on M (same products, same order), so verifying drafts gives the bits that decoding gives.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels.h"

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LLMSERVE_BF16_LINEAR 1
#endif

bool small_batch_linear_supported() {
#ifdef LLMSERVE_BF16_LINEAR
  return true;
#else
  return false;
#endif
}

namespace {

#ifdef LLMSERVE_BF16_LINEAR

// -- bf16, packed blocks of 32 rows ---------------------------------------------------------------

constexpr int kBlockRows = 32;           // output rows per packed block (two vectors of 16 lanes)
constexpr int kPrefetchBytes = 32 * 64;  // how far ahead of the loads the stream is prefetched

// Output rows [row, row + 32) of all M inputs from one packed block; rows >= n_size are not written.
template <int M>
inline void linear_block(const uint16_t* x, const uint16_t* block, uint16_t* out, int64_t k_size, int64_t n_size,
                         int64_t row) {
  __m512 acc[2][M];
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  const int64_t pairs = k_size / 2;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const uint16_t* weights = block + pair * 2 * kBlockRows;
    _mm_prefetch(reinterpret_cast<const char*>(weights) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(weights) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512bh low = (__m512bh)_mm512_loadu_si512(weights);
    const __m512bh high = (__m512bh)_mm512_loadu_si512(weights + 32);
    for (int m = 0; m < M; ++m) {
      int32_t input_pair;  // x[k], x[k + 1] as one lane (memcpy: no aliasing or alignment assumptions)
      std::memcpy(&input_pair, x + m * k_size + 2 * pair, sizeof(input_pair));
      const __m512bh input = (__m512bh)_mm512_set1_epi32(input_pair);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], input, low);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], input, high);
    }
  }
  const int64_t valid = std::min<int64_t>(kBlockRows, n_size - row);
  const __mmask16 first = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1);
  const __mmask16 second = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);
  for (int m = 0; m < M; ++m) {
    uint16_t* dst = out + m * n_size + row;
    _mm256_mask_storeu_epi16(dst, first, (__m256i)_mm512_cvtneps_pbh(acc[0][m]));
    _mm256_mask_storeu_epi16(dst + 16, second, (__m256i)_mm512_cvtneps_pbh(acc[1][m]));
  }
}

template <int M>
void linear_blocks(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t k_size, int64_t n_size) {
  const int64_t blocks = (n_size + kBlockRows - 1) / kBlockRows;
  const int64_t block_elements = kBlockRows * k_size;
  // Each task covers at least ~64 KiB of weights, so thread start-up is paid on real work.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (2 * block_elements));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      linear_block<M>(x, packed + b * block_elements, out, k_size, n_size, b * kBlockRows);
  });
}

void linear_packed(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t m_size, int64_t k_size,
                   int64_t n_size) {
  switch (m_size) {
    case 1: linear_blocks<1>(x, packed, out, k_size, n_size); break;
    case 2: linear_blocks<2>(x, packed, out, k_size, n_size); break;
    case 3: linear_blocks<3>(x, packed, out, k_size, n_size); break;
    case 4: linear_blocks<4>(x, packed, out, k_size, n_size); break;
    case 5: linear_blocks<5>(x, packed, out, k_size, n_size); break;
    case 6: linear_blocks<6>(x, packed, out, k_size, n_size); break;
    case 7: linear_blocks<7>(x, packed, out, k_size, n_size); break;
    default: linear_blocks<8>(x, packed, out, k_size, n_size); break;
  }
}

#endif  // LLMSERVE_BF16_LINEAR

// Checks shared by the entry points; returns an empty [M, N] bf16 output.
torch::Tensor checked_output(const torch::Tensor& x, const torch::Tensor& weight, int64_t n_size) {
  TORCH_CHECK(small_batch_linear_supported(), "small_batch_linear needs a CPU with AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "small_batch_linear takes bfloat16 inputs");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_batch_linear needs contiguous tensors");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_batch_linear serves 1 to 8 rows");
  TORCH_CHECK(x.size(1) % 32 == 0, "small_batch_linear needs an input width that is a multiple of 32");
  return torch::empty({x.size(0), n_size}, x.options());
}

}  // namespace

// weight [N, K] bf16 -> the packed layout small_batch_linear reads: [N', K] with N' = N rounded up to a
// multiple of 32 (zero rows), holding blocks of 32 rows column pair by column pair.
torch::Tensor small_batch_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "small_batch_pack takes a 2-D bf16 weight");
  TORCH_CHECK(weight.size(1) % 32 == 0, "small_batch_linear needs an input width that is a multiple of 32");
  const int64_t n_size = weight.size(0), k_size = weight.size(1);
  const int64_t padded = (n_size + 31) / 32 * 32;
  auto rows = torch::zeros({padded, k_size}, weight.options());
  rows.narrow(0, 0, n_size).copy_(weight);
  return rows.view({padded / 32, 32, k_size / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({padded, k_size});
}

// x [M, K] bf16 with 1 <= M <= 8, packed from small_batch_pack of an [N, K] weight. Returns [M, N].
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16, "small_batch_linear takes bfloat16 weights");
  TORCH_CHECK(out_features >= 1 && packed.size(0) == (out_features + 31) / 32 * 32,
              "small_batch_linear takes a weight packed by small_batch_pack for out_features rows");
  auto out = checked_output(x, packed, out_features);
#ifdef LLMSERVE_BF16_LINEAR
  linear_packed(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), x.size(0), x.size(1), out_features);
#endif
  return out;
}
