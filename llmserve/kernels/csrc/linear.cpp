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
// load. A row-major layout (one vector per row, a horizontal sum per output) is compute-bound at 4-8
// rows because of those sums. A row's result does not depend
// on M (same products, same order), so verifying drafts gives the bits that decoding gives.
// On AVX2 CPUs (no AVX-512 BF16) the same packed blocks run on float32 FMAs (the AVX2 section).
#include "aten.h"

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LLMSERVE_BF16_LINEAR 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vector_math.h"
#define LLMSERVE_BF16_LINEAR_AVX2 1  // the same packed blocks in float32 FMAs (the section's comment says how)
#endif

bool small_batch_linear_supported() {
#if defined(LLMSERVE_BF16_LINEAR) || defined(LLMSERVE_BF16_LINEAR_AVX2)
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
// With one row tile nothing else overlaps the weights' read, so more of it must be in flight: 16 KiB
// ahead reads 4-5% faster than 2 KiB at 1-8 rows (linear_micro); at 32-96 rows it is slower.
constexpr int kSingleTilePrefetchBytes = 256 * 64;

// Output rows [row, row + 32) of all M inputs from one packed block; rows >= n_size are not written.
// Out is uint16_t (bf16, rounded from the float32 sums) or float (the sums as they are: logits).
// `stream`: whole 64-byte lines of float output go around the cache (see linear_packed). Each column
// pair prefetches from `ahead`: its own two lines a fixed distance on (the block streaming from
// memory; see linear_block_rows for the distance) or, with Paced, one line of the next block.
template <int M, typename Out, bool Paced = false>
inline void linear_block(const uint16_t* x, const uint16_t* block, Out* out, int64_t k_size, int64_t n_size,
                         int64_t row, bool stream, const char* ahead) {
  __m512 acc[2][M];
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  const int64_t pairs = k_size / 2;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const uint16_t* weights = block + pair * 2 * kBlockRows;
    if constexpr (Paced) {
      _mm_prefetch(ahead + pair * 64, _MM_HINT_T0);
    } else {
      _mm_prefetch(ahead + pair * 4 * kBlockRows, _MM_HINT_T0);
      _mm_prefetch(ahead + pair * 4 * kBlockRows + 64, _MM_HINT_T0);
    }
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
    Out* dst = out + m * n_size + row;
    if constexpr (std::is_same_v<Out, float>) {
      if (stream && valid == kBlockRows) {
        _mm512_stream_ps(dst, acc[0][m]);
        _mm512_stream_ps(dst + 16, acc[1][m]);
      } else {
        _mm512_mask_storeu_ps(dst, first, acc[0][m]);
        _mm512_mask_storeu_ps(dst + 16, second, acc[1][m]);
      }
    } else {
      _mm256_mask_storeu_epi16(dst, first, (__m256i)_mm512_cvtneps_pbh(acc[0][m]));
      _mm256_mask_storeu_epi16(dst + 16, second, (__m256i)_mm512_cvtneps_pbh(acc[1][m]));
    }
  }
}

template <typename Out, bool Paced>
void linear_tile(int64_t rows, const uint16_t* tile, const uint16_t* block, Out* out, int64_t k_size, int64_t n_size,
                 int64_t row, bool stream, const char* ahead) {
  switch (rows) {
    case 1: linear_block<1, Out, Paced>(tile, block, out, k_size, n_size, row, stream, ahead); break;
    case 2: linear_block<2, Out, Paced>(tile, block, out, k_size, n_size, row, stream, ahead); break;
    case 3: linear_block<3, Out, Paced>(tile, block, out, k_size, n_size, row, stream, ahead); break;
    case 4: linear_block<4, Out, Paced>(tile, block, out, k_size, n_size, row, stream, ahead); break;
    case 5: linear_block<5, Out, Paced>(tile, block, out, k_size, n_size, row, stream, ahead); break;
    case 6: linear_block<6, Out, Paced>(tile, block, out, k_size, n_size, row, stream, ahead); break;
    case 7: linear_block<7, Out, Paced>(tile, block, out, k_size, n_size, row, stream, ahead); break;
    default: linear_block<8, Out, Paced>(tile, block, out, k_size, n_size, row, stream, ahead); break;
  }
}

// One packed block for `m_size` rows, in tiles of up to 8: the block (32 x K weights) stays in cache
// while every tile passes over it, so the weights are read from memory once whatever the row count.
// The first tile streams the block in; the second and third prefetch the next block (`has_next`: the
// same thread's next), one line per column pair, half of it each, so that memory is read while the
// later tiles compute instead of only while the first waits.
template <typename Out>
void linear_block_rows(const uint16_t* x, const uint16_t* block, Out* out, int64_t m_size, int64_t k_size,
                       int64_t n_size, int64_t row, bool stream, bool has_next) {
  const char* own = reinterpret_cast<const char*>(block) + (m_size <= 8 ? kSingleTilePrefetchBytes : kPrefetchBytes);
  const char* next = reinterpret_cast<const char*>(block + kBlockRows * k_size);
  const int64_t pairs = k_size / 2;  // a block is 2 * pairs lines
  for (int64_t first = 0, t = 0; first < m_size; first += 8, ++t) {
    const int64_t rows = std::min<int64_t>(8, m_size - first);
    const uint16_t* tile = x + first * k_size;
    Out* tile_out = out + first * n_size;
    if (has_next && (t == 1 || t == 2)) {
      linear_tile<Out, true>(rows, tile, block, tile_out, k_size, n_size, row, stream, next + (t - 1) * pairs * 64);
    } else {
      linear_tile<Out, false>(rows, tile, block, tile_out, k_size, n_size, row, stream, own);
    }
  }
}

// A row's result does not depend on m_size: each tile runs the same products in the same order.
template <typename Out>
void linear_packed(const uint16_t* x, const uint16_t* packed, Out* out, int64_t m_size, int64_t k_size,
                   int64_t n_size) {
  const int64_t blocks = (n_size + kBlockRows - 1) / kBlockRows;
  const int64_t block_elements = kBlockRows * k_size;
  // Each task covers at least ~64 KiB of weights, so thread start-up is paid on real work.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (2 * block_elements));
  // Float outputs (logits) larger than L2 are streamed to memory: a normal store to a line not in cache
  // first reads it (a 32-column block of 96 rows misses on 192 lines), and at the output projection's
  // 49,152 columns those reads held the kernel to 0.67 TFLOP/s at 96 rows (0.91 streamed; 1.0 where
  // the output stays in cache, on Zen 5). Aligned rows only (64-byte lines of 16 floats).
  const bool stream = std::is_same_v<Out, float> && m_size * n_size * sizeof(Out) > (1 << 20) && n_size % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(out) % 64 == 0;
  const auto run = [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      linear_block_rows(x, packed + b * block_elements, out, m_size, k_size, n_size, b * kBlockRows, stream,
                        b + 1 < end);
    if (stream) _mm_sfence();  // the streamed lines reach memory before the region's end
  };
  if (!run_thread_part(blocks, n_size, run)) at::parallel_for(0, blocks, grain, run);
}

#endif  // LLMSERVE_BF16_LINEAR

#ifdef LLMSERVE_BF16_LINEAR_AVX2

// -- AVX2 and FMA: the same packed blocks, float32 arithmetic ----------------------------------------
// Without vdpbf16ps the pairs are widened: a 32-byte load holds 8 rows' (k, k + 1) weights, a shift
// left by 16 gives column k as float32 and a mask of the high halves column k + 1 (a bf16 is the high
// half of a float32: both exact), and two FMAs with x[k] and x[k + 1] broadcast (the input converted to
// float32 once per call) accumulate 8 output rows; 4 such vectors cover a 32-row block. Half of
// float32's bytes per weight for the same FMAs: faster than the float32 kernel where the weights'
// read bounds it (few rows). Each output is one FMA chain over the columns in order, whatever M is,
// so a row's result does not depend on the others. Inputs run in passes of 2 rows over each block
// (8 accumulators, 4 broadcast inputs and the weight pair fill the 16 registers); the first streams
// the block in (prefetched ahead, into the next block at its end), later passes read it from cache.

constexpr int kBlockRows = 32;  // output rows per packed block (four vectors of 8 lanes)
constexpr int kRowsPerPass = 2;
constexpr int kPrefetchBytes = 128 * 64;  // how far ahead of the loads the first pass prefetches

// Output rows [row, row + 32) of inputs x [M][K] (float32) from one packed block (store_block_rows).
template <int M, typename Out>
inline void linear_block_avx2(const float* x, const uint16_t* block, Out* out, int64_t k_size, int64_t n_size,
                              int64_t row, bool prefetch) {
  const __m256i high_halves = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[4][M];
  LLMSERVE_UNROLL for (int v = 0; v < 4; ++v)
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) acc[v][m] = _mm256_setzero_ps();
  const int64_t pairs = k_size / 2;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const uint16_t* weights = block + pair * 2 * kBlockRows;  // two cache lines: rows 0-15, rows 16-31
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(weights) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(weights) + kPrefetchBytes + 64, _MM_HINT_T0);
    }
    __m256 even[M], odd[M];
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) {
      even[m] = _mm256_broadcast_ss(x + m * k_size + 2 * pair);
      odd[m] = _mm256_broadcast_ss(x + m * k_size + 2 * pair + 1);
    }
    LLMSERVE_UNROLL for (int v = 0; v < 4; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + 16 * v));
      const __m256 column = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      const __m256 next_column = _mm256_castsi256_ps(_mm256_and_si256(w, high_halves));
      LLMSERVE_UNROLL for (int m = 0; m < M; ++m) {
        acc[v][m] = _mm256_fmadd_ps(column, even[m], acc[v][m]);
        acc[v][m] = _mm256_fmadd_ps(next_column, odd[m], acc[v][m]);
      }
    }
  }
  store_block_rows<M>(acc, out, n_size, row);
}

// x [M][K] bf16 -> float32 (exact: a bf16 is a float32's high half).
std::vector<float> widen_rows(const uint16_t* x, int64_t elements) {
  std::vector<float> wide(elements);
  int64_t i = 0;
  for (; i + 8 <= elements; i += 8)
    _mm256_storeu_ps(wide.data() + i, load8(reinterpret_cast<const c10::BFloat16*>(x + i)));
  for (; i < elements; ++i) wide[i] = static_cast<float>(c10::BFloat16(x[i], c10::BFloat16::from_bits()));
  return wide;
}

// A row's result does not depend on m_size: each pass runs the same FMA chains.
template <typename Out>
void linear_packed(const uint16_t* x_bf16, const uint16_t* packed, Out* out, int64_t m_size, int64_t k_size,
                   int64_t n_size) {
  const std::vector<float> wide = widen_rows(x_bf16, m_size * k_size);
  const float* x = wide.data();
  const int64_t blocks = (n_size + kBlockRows - 1) / kBlockRows;
  const int64_t block_elements = kBlockRows * k_size;
  // Each task covers at least ~64 KiB of weights, so thread start-up is paid on real work.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (2 * block_elements));
  const auto run = [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* block = packed + b * block_elements;
      for (int64_t m0 = 0; m0 < m_size; m0 += kRowsPerPass) {
        if (m_size - m0 >= 2)
          linear_block_avx2<2>(x + m0 * k_size, block, out + m0 * n_size, k_size, n_size, b * kBlockRows, m0 == 0);
        else
          linear_block_avx2<1>(x + m0 * k_size, block, out + m0 * n_size, k_size, n_size, b * kBlockRows, m0 == 0);
      }
    }
  };
  if (!run_thread_part(blocks, n_size, run)) at::parallel_for(0, blocks, grain, run);
}

#endif  // LLMSERVE_BF16_LINEAR_AVX2

// Checks shared by the entry points (any row count: above 8 the rows run in tiles of 8).
void check_inputs(const at::Tensor& x, const at::Tensor& packed, int64_t n_size) {
  TORCH_CHECK(small_batch_linear_supported(), "small_batch_linear needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "small_batch_linear takes bfloat16 inputs and weights");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && x.size(1) == packed.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous(), "small_batch_linear needs contiguous tensors");
  TORCH_CHECK(x.size(0) >= 1, "small_batch_linear needs at least 1 row");
  TORCH_CHECK(x.size(1) % 32 == 0, "small_batch_linear needs an input width that is a multiple of 32");
  TORCH_CHECK(n_size >= 1 && packed.size(0) == (n_size + 31) / 32 * 32,
              "small_batch_linear takes a weight packed by small_batch_pack for out_features rows");
}

}  // namespace

// weight [N, K] bf16 -> the packed layout small_batch_linear reads: [N', K] with N' = N rounded up to a
// multiple of 32 (zero rows), holding blocks of 32 rows column pair by column pair.
at::Tensor small_batch_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "small_batch_pack takes a 2-D bf16 weight");
  TORCH_CHECK(weight.size(1) % 32 == 0, "small_batch_linear needs an input width that is a multiple of 32");
  const int64_t n_size = weight.size(0), k_size = weight.size(1);
  const int64_t padded = (n_size + 31) / 32 * 32;
  auto rows = at::zeros({padded, k_size}, weight.options());
  rows.narrow(0, 0, n_size).copy_(weight);
  return rows.view({padded / 32, 32, k_size / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({padded, k_size});
}

// x [M, K] bf16, packed from small_batch_pack of an [N, K] weight. Returns [M, N] bf16. Above 8 rows
// the tiles of 8 pass over each block while it is in cache (SmallBatchLinear says where that is used).
at::Tensor small_batch_linear(at::Tensor x, at::Tensor packed, int64_t out_features) {
  check_inputs(x, packed, out_features);
  auto out = at::empty({x.size(0), out_features}, x.options());
#if defined(LLMSERVE_BF16_LINEAR) || defined(LLMSERVE_BF16_LINEAR_AVX2)
  linear_packed(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), x.size(0), x.size(1), out_features);
#endif
  return out;
}

void small_batch_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, at::Tensor& out) {
  check_inputs(x, packed, out_features);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == out_features,
              "small_batch_linear_into: out must be contiguous bf16 [M, out_features]");
#if defined(LLMSERVE_BF16_LINEAR) || defined(LLMSERVE_BF16_LINEAR_AVX2)
  linear_packed(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), x.size(0), x.size(1), out_features);
#endif
}

// x [M, K] bf16 with any M >= 1, the same packed weight. Returns [M, N] float32: the sums unrounded,
// so logits keep the float32 gaps between near-tied tokens that a bf16 output would erase.
at::Tensor small_batch_linear_float_out(at::Tensor x, at::Tensor packed, int64_t out_features) {
  check_inputs(x, packed, out_features);
  auto out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
#if defined(LLMSERVE_BF16_LINEAR) || defined(LLMSERVE_BF16_LINEAR_AVX2)
  linear_packed(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), out.data_ptr<float>(),
                x.size(0), x.size(1), out_features);
#endif
  return out;
}
