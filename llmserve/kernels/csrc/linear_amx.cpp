// Linear layers above the small-batch kernel's 8 rows on AMX: y = x W^T (+ bias) for bfloat16 x [M, K].
//
// There a linear layer is compute-bound, and AMX's tile product (tdpbf16ps: 16 rows of 32 bf16 times
// 32 x 16 bf16 into 16 x 16 float32 sums) does sixteen times the work of one AVX-512 BF16 instruction.
// The small-batch kernel's packed weight (linear.cpp: blocks of 32 output rows, [K/2][32][2], each input
// column pair's weights for the 32 rows side by side) is already the B operand that product wants:
// 16 consecutive pairs of a block's first or last 16 rows are one B tile, read with a stride of 128
// bytes. So one packed copy serves both kernels, and x is read in place as the A operand (16 rows of
// 32 columns a tile). A task computes a 32 x 32 block of y in four float32 tiles over the whole K
// (2 A tiles x 2 B tiles: four products per four loads), converts it and adds the bias on the way
// out. Threads split the weight's blocks evenly. Up to 256 rows, each block is read once and every
// row passes over it while it sits in L1; above, the blocks go in panels of about 1 MiB that stay in
// L2 while every 32 rows in turn pass over the panel, so weights and rows are each read from memory
// about once (a layer's weights are not in cache: the other layers' ran in between).
// A row's result does not depend on M or on the other rows: the same products in the same order.
#include "aten.h"

#include "amx.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

#ifdef LLMSERVE_AMX

constexpr int kBlock = 32;                   // output columns per task: one packed block of W's rows
constexpr int64_t kFewRows = 256;            // up to this many rows, one block at a time (see above)
constexpr int64_t kPanelBytes = 1 << 20;     // above, blocks in panels of this many bytes (in L2)

// c [32][32] = rows of x (`Rows`: 32 or 16, K columns at a, rows k_size apart) times one packed block.
template <int Rows>
inline void block_product(const uint16_t* a, int64_t k_size, const uint16_t* block, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Rows == 32) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t row_bytes = k_size * 2;
  for (int64_t k = 0; k < k_size; k += 32) {
    const uint16_t* b = block + k * kBlock;  // column pair k / 2 of the block: 32 rows x 2
    _tile_loadd(6, b, kBlock * 4);           // the block's rows 0-15, pairs k/2 .. k/2 + 15
    _tile_loadd(7, b + 32, kBlock * 4);      // rows 16-31
    _tile_loadd(4, a + k, row_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Rows == 32) {
      _tile_loadd(5, a + 16 * k_size + k, row_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, kBlock * 4);
  _tile_stored(1, c + 16, kBlock * 4);
  if constexpr (Rows == 32) {
    _tile_stored(2, c + 16 * kBlock, kBlock * 4);
    _tile_stored(3, c + 16 * kBlock + 16, kBlock * 4);
  }
}

// y[row, col .. col + 31] = c + bias for `rows` rows, columns past n_size left alone. `stream`: whole
// float32 blocks bypass the caches (y 64-byte aligned, n_size a multiple of 16).
template <typename Out>
inline void store_block(const float* c, int64_t rows, const float* bias, Out* y, int64_t n_size, int64_t col,
                        bool stream) {
  const int64_t valid = std::min<int64_t>(kBlock, n_size - col);
  const __mmask16 first = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1);
  const __mmask16 second = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(first, bias + col) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(second, bias + col + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 low = _mm512_add_ps(_mm512_load_ps(c + r * kBlock), bias0);
    const __m512 high = _mm512_add_ps(_mm512_load_ps(c + r * kBlock + 16), bias1);
    Out* dst = y + r * n_size + col;
    if constexpr (std::is_same_v<Out, float>) {
      if (stream && valid == kBlock) {
        _mm512_stream_ps(dst, low);
        _mm512_stream_ps(dst + 16, high);
        continue;
      }
      _mm512_mask_storeu_ps(dst, first, low);
      _mm512_mask_storeu_ps(dst + 16, second, high);
    } else {
      _mm256_mask_storeu_epi16(dst, first, (__m256i)_mm512_cvtneps_pbh(low));
      _mm256_mask_storeu_epi16(dst + 16, second, (__m256i)_mm512_cvtneps_pbh(high));
    }
  }
}

template <typename Out>
void linear_amx(const uint16_t* x, const uint16_t* packed, const float* bias, Out* y, int64_t m_size,
                int64_t k_size, int64_t n_size) {
  // The last rows short of 32, zero-padded: a tile reads 16 whole rows.
  const int64_t full_rows = m_size / kBlock * kBlock;
  static thread_local std::vector<uint16_t> tail;
  if (full_rows < m_size) {
    tail.assign(static_cast<size_t>(kBlock * k_size), 0);
    std::memcpy(tail.data(), x + full_rows * k_size, (m_size - full_rows) * k_size * 2);
  }
  const uint16_t* tail_rows = tail.data();
  const int64_t blocks = (n_size + kBlock - 1) / kBlock;
  // Logits of a wide batch (100 rows of a 49,152-token vocabulary: 20 MB) are written once and read once
  // by the sampler: written around the caches, they skip reading each line before writing it, and
  // every row's stores, a page apart, stop evicting one another (1.4x on this output).
  const bool stream = std::is_same_v<Out, float> && n_size % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(y) % 64 == 0 && m_size * n_size * 4 >= (4 << 20);
  const int64_t panel = m_size <= kFewRows ? 1 : std::max<int64_t>(1, kPanelBytes / (kBlock * k_size * 2));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float c[kBlock * kBlock];
    for (int64_t first = begin; first < end; first += panel) {
      const int64_t last = std::min(end, first + panel);
      for (int64_t row = 0; row < m_size; row += kBlock) {
        const int64_t rows = std::min<int64_t>(kBlock, m_size - row);
        const uint16_t* a = row < full_rows ? x + row * k_size : tail_rows;
        for (int64_t b = first; b < last; ++b) {
          const uint16_t* block = packed + b * kBlock * k_size;
          if (rows > 16) block_product<32>(a, k_size, block, c);
          else block_product<16>(a, k_size, block, c);
          store_block(c, rows, bias, y + row * n_size, n_size, b * kBlock, stream);
        }
      }
    }
    _tile_release();
    if (stream) _mm_sfence();  // the streamed stores are visible before the call returns
  });
}

#endif  // LLMSERVE_AMX

}  // namespace

bool amx_linear_supported() {
#ifdef LLMSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x [M, K] bf16 with any M >= 1, packed from small_batch_pack of an [N, K] weight, bias [N] (any float
// dtype) or none. Returns [M, N]: bf16, or float32 with float_out (logits: the sums unrounded).
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, const std::optional<at::Tensor>& bias,
                      int64_t out_features, bool float_out) {
  TORCH_CHECK(amx_linear_supported(), "amx_linear needs a CPU with AMX BF16 and the kernel's permission to use it");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_linear takes bfloat16 inputs and weights");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && x.size(1) == packed.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous(), "amx_linear needs contiguous tensors");
  TORCH_CHECK(x.size(0) >= 1 && x.size(1) % 32 == 0, "amx_linear needs rows and an input width that is a multiple of 32");
  TORCH_CHECK(out_features >= 1 && packed.size(0) == (out_features + 31) / 32 * 32,
              "amx_linear takes a weight packed by small_batch_pack for out_features rows");
  at::Tensor bias_float;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "the bias must have out_features values");
    bias_float = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({x.size(0), out_features}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
#ifdef LLMSERVE_AMX
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const float* bs = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  if (float_out)
    linear_amx(xs, ws, bs, y.data_ptr<float>(), x.size(0), x.size(1), out_features);
  else
    linear_amx(xs, ws, bs, reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()), x.size(0), x.size(1),
               out_features);
#endif
  return y;
}
