// Linear layers at small batch in float32: y = x W^T for x [M, K] with M <= 8, on CPUs with AVX2 and
// FMA. float32 is what the engine serves in where the CPU has no native bf16 (AVX2-only machines), and
// there decode and speculative verification spend most of a step here.
//
// Like the bf16 kernel (linear.cpp) this streams the weights once and uses each M times, so a verify
// pass of k + 1 rows costs little more than a decode step, where oneDNN's float32 matmul (the fallback)
// grows with the row count.
//
// Weights are packed once (small_batch_pack_f32) into blocks of 8 output rows stored column by column:
// [N/8][K][8]. One 32-byte load holds 8 rows' weights for column k, which an FMA with x[m][k] broadcast
// to every lane accumulates into 8 outputs, so no horizontal sums are needed. Each output is one FMA
// chain over k in order, whatever M is: a row's result does not depend on the batch, so verifying
// drafts gives the bits that decoding gives. R neighbouring blocks are computed together (R x M
// independent chains hide the FMA latency), which changes which outputs are interleaved, not any
// output's arithmetic.
#include "aten.h"

#include "kernels.h"
#include "vector_math.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLMSERVE_F32_LINEAR 1
#endif

bool small_batch_linear_f32_supported() {
#ifdef LLMSERVE_F32_LINEAR
  return true;
#else
  return false;
#endif
}

namespace {

constexpr int64_t kBlockRows = 8;  // output rows per packed block: one vector of 8 float32 lanes

#ifdef LLMSERVE_F32_LINEAR

// Outputs of blocks [first, first + R) for inputs x [M][K]; rows >= n_size are not written. (Without
// LLMSERVE_UNROLL, GCC kept `acc` in memory and stored all R x M accumulators every k: a third of the
// FMA rate.)
template <int M, int R, typename W>
inline void linear_blocks(const float* x, const W* packed, float* out, int64_t k_size, int64_t n_size,
                          int64_t first) {
  __m256 acc[R][M];
  const W* weights[R];
  LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
    weights[r] = packed + (first + r) * kBlockRows * k_size;
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; ++k) {
    __m256 column[R];
    LLMSERVE_UNROLL for (int r = 0; r < R; ++r) column[r] = load8(weights[r] + k * kBlockRows);
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) {
      const __m256 input = _mm256_broadcast_ss(x + m * k_size + k);
      LLMSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(column[r], input, acc[r][m]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
    const int64_t row = (first + r) * kBlockRows;
    const int valid = static_cast<int>(std::min<int64_t>(kBlockRows, n_size - row));
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane);
    LLMSERVE_UNROLL for (int m = 0; m < M; ++m) {
      if (valid == kBlockRows) _mm256_storeu_ps(out + m * n_size + row, acc[r][m]);
      else _mm256_maskstore_ps(out + m * n_size + row, mask, acc[r][m]);  // microcoded on AMD: the last block only
    }
  }
}

// Blocks computed together for M rows: R x M accumulators, R weight vectors and the broadcast input in
// (about) 16 registers, each k's FMAs outnumbering its loads. Rows past 6 leave too few registers for
// two blocks; those batches take two passes (4 rows, then the rest) over each group of blocks, the second
// reading the group's weights from L2 rather than from memory.
template <int M>
constexpr int blocks_together() {
  return M == 1 ? 4 : M == 2 ? 5 : M == 3 ? 4 : M == 4 ? 3 : M <= 6 ? 2 : 3;
}

// Outputs of blocks [first, first + R) for inputs [0, M) (or fewer blocks at the end of the matrix).
template <int M, int R, typename W>
inline void linear_group(const float* x, const W* packed, float* out, int64_t k_size, int64_t n_size,
                         int64_t first, int64_t blocks) {
  if (first + R <= blocks) {
    linear_blocks<M, R>(x, packed, out, k_size, n_size, first);
  } else {  // the last blocks, one at a time
    for (int64_t block = first; block < blocks; ++block) linear_blocks<M, 1>(x, packed, out, k_size, n_size, block);
  }
}

template <int M, typename W>
void linear_all(const float* x, const W* packed, float* out, int64_t k_size, int64_t n_size) {
  constexpr int kFirst = M <= 6 ? M : 4, kSecond = M - kFirst;
  constexpr int R = blocks_together<M>();
  const int64_t blocks = (n_size + kBlockRows - 1) / kBlockRows;
  const int64_t groups = (blocks + R - 1) / R;
  // Each task covers at least ~64 KiB of weights, so thread start-up is paid on real work.
  const int64_t group_bytes = R * kBlockRows * k_size * static_cast<int64_t>(sizeof(W));
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / group_bytes);
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      linear_group<kFirst, R>(x, packed, out, k_size, n_size, group * R, blocks);
      if constexpr (kSecond > 0)
        linear_group<kSecond, R>(x + kFirst * k_size, packed, out + kFirst * n_size, k_size, n_size, group * R, blocks);
    }
  });
}

// More than 8 rows, in panels of rows whose inputs fit in L2 (linear_tiled): each task takes groups of 3
// blocks (24 outputs) and runs every row of the panel through them, 4 rows at a time (the last 1-3
// together), so a group's weights are read from memory once per panel and then from L2 for each further
// tile. A row's arithmetic is that of linear_blocks as above whatever M is (the same FMA chain over k),
// so its outputs are those of a decode of that row alone.
template <typename W>
void linear_panel(const float* x, const W* packed, float* out, int64_t m_size, int64_t k_size, int64_t n_size) {
  constexpr int R = 3, kTile = 4;
  const int64_t blocks = (n_size + kBlockRows - 1) / kBlockRows;
  const int64_t groups = (blocks + R - 1) / R;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      int64_t m = 0;
      for (; m + kTile <= m_size; m += kTile)
        linear_group<kTile, R>(x + m * k_size, packed, out + m * n_size, k_size, n_size, group * R, blocks);
      const float* x_rest = x + m * k_size;
      float* out_rest = out + m * n_size;
      switch (m_size - m) {
        case 3: linear_group<3, R>(x_rest, packed, out_rest, k_size, n_size, group * R, blocks); break;
        case 2: linear_group<2, R>(x_rest, packed, out_rest, k_size, n_size, group * R, blocks); break;
        case 1: linear_group<1, R>(x_rest, packed, out_rest, k_size, n_size, group * R, blocks); break;
        default: break;
      }
    }
  });
}

template <typename W>
void linear_tiled(const float* x, const W* packed, float* out, int64_t m_size, int64_t k_size, int64_t n_size) {
  // Up to ~256 KiB of inputs at a time, so that the rows a group runs through stay in L2.
  const int64_t panel = std::max<int64_t>(16, (256 * 1024 / 4) / k_size) / 4 * 4;
  for (int64_t m0 = 0; m0 < m_size; m0 += panel) {
    const int64_t rows = std::min(panel, m_size - m0);
    linear_panel(x + m0 * k_size, packed, out + m0 * n_size, rows, k_size, n_size);
  }
}

template <typename W>
void linear_packed(const float* x, const W* packed, float* out, int64_t m_size, int64_t k_size, int64_t n_size) {
  if (m_size > 8) {
    linear_tiled(x, packed, out, m_size, k_size, n_size);
    return;
  }
  switch (m_size) {
    case 1: linear_all<1, W>(x, packed, out, k_size, n_size); break;
    case 2: linear_all<2, W>(x, packed, out, k_size, n_size); break;
    case 3: linear_all<3, W>(x, packed, out, k_size, n_size); break;
    case 4: linear_all<4, W>(x, packed, out, k_size, n_size); break;
    case 5: linear_all<5, W>(x, packed, out, k_size, n_size); break;
    case 6: linear_all<6, W>(x, packed, out, k_size, n_size); break;
    case 7: linear_all<7, W>(x, packed, out, k_size, n_size); break;
    default: linear_all<8, W>(x, packed, out, k_size, n_size); break;
  }
}

#endif  // LLMSERVE_F32_LINEAR

}  // namespace

// weight [N, K] float32 or bf16 -> the layout small_batch_linear_f32 reads, in the weight's dtype: [N', K]
// with N' = N rounded up to a multiple of 8 (zero rows), holding blocks of 8 rows column by column.
at::Tensor small_batch_pack_f32(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "small_batch_pack_f32 takes a 2-D float32 or bf16 weight");
  const int64_t n_size = weight.size(0), k_size = weight.size(1);
  const int64_t padded = (n_size + kBlockRows - 1) / kBlockRows * kBlockRows;
  auto rows = weight.contiguous();
  if (padded != n_size) {  // the zero rows need a copy; without them the transpose is the only pass
    rows = at::zeros({padded, k_size}, weight.options());
    rows.narrow(0, 0, n_size).copy_(weight);
  }
  return rows.view({padded / kBlockRows, kBlockRows, k_size})
      .permute({0, 2, 1})
      .clone(at::MemoryFormat::Contiguous)  // a copy even where the permuted view is contiguous (K == 1)
      .view({padded, k_size});
}

// x [M, K] float32 (M >= 1; more than 8 rows take linear_tiled), packed from small_batch_pack_f32 of an
// [N, K] weight (float32, or bf16 where half the bytes matter more than the weights' low bits: a draft
// head). Returns [M, N] float32.
at::Tensor small_batch_linear_f32(at::Tensor x, at::Tensor packed, int64_t out_features) {
  TORCH_CHECK(small_batch_linear_f32_supported(), "small_batch_linear_f32 needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "small_batch_linear_f32 takes float32 inputs and float32 or bf16 weights");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && x.size(1) == packed.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous(), "small_batch_linear_f32 needs contiguous tensors");
  TORCH_CHECK(x.size(0) >= 1, "small_batch_linear_f32 needs at least one row");
  TORCH_CHECK(out_features >= 1 && packed.size(0) == (out_features + kBlockRows - 1) / kBlockRows * kBlockRows,
              "small_batch_linear_f32 takes a weight packed by small_batch_pack_f32 for out_features rows");
  auto out = at::empty({x.size(0), out_features}, x.options());
#ifdef LLMSERVE_F32_LINEAR
  if (packed.scalar_type() == at::kFloat)
    linear_packed(x.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                  out_features);
  else
    linear_packed(x.data_ptr<float>(), packed.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), x.size(0),
                  x.size(1), out_features);
#endif
  return out;
}
