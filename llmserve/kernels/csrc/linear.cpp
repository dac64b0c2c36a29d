// Linear layers at small batch in bfloat16: y = x W^T for x [M, K] with M <= 8 (decode at low
// concurrency, speculative verification of a few drafts).
//
// At these sizes a linear layer is a matrix-vector product: every weight is read from memory once and
// used M times, so the work is bound by memory bandwidth. The general bf16 GEMM path in PyTorch reaches
// about a third of the machine's bandwidth here; this kernel streams each weight row once and multiplies
// bf16 pairs exactly with AVX-512 BF16 (vdpbf16ps), summing in float32, for all M inputs at once.
// Tiles of R weight rows run on the threads; the M x R float32 accumulators stay in registers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LLMSERVE_BF16_LINEAR 1
#endif

namespace {

#ifdef LLMSERVE_BF16_LINEAR

// Output rows [row, row + R) for all M inputs: out[m][row + r] = sum_k x[m][k] * w[row + r][k].
template <int M, int R>
inline void linear_tile(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t k_size, int64_t n_size,
                        int64_t row) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; k += 32) {
    __m512i weights[R];
    for (int r = 0; r < R; ++r) weights[r] = _mm512_loadu_si512(w + (row + r) * k_size + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh input = (__m512bh)_mm512_loadu_si512(x + m * k_size + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], input, (__m512bh)weights[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      const c10::BFloat16 value(_mm512_reduce_add_ps(acc[r][m]));  // round to nearest even
      out[m * n_size + row + r] = value.x;
    }
}

template <int M>
void linear_rows(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t k_size, int64_t n_size) {
  constexpr int R = M <= 2 ? 8 : 4;  // R x M accumulators plus R weight registers within 32
  const int64_t tiles = n_size / R;
  // Each task covers at least ~64 KiB of weights, so thread start-up is paid on real work.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (2 * k_size * R));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) linear_tile<M, R>(x, w, out, k_size, n_size, tile * R);
  });
  for (int64_t row = tiles * R; row < n_size; ++row) linear_tile<M, 1>(x, w, out, k_size, n_size, row);
}

#endif  // LLMSERVE_BF16_LINEAR

}  // namespace

bool small_batch_linear_supported() {
#ifdef LLMSERVE_BF16_LINEAR
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 with 1 <= M <= 8, weight [N, K] bf16, K a multiple of 32; both contiguous. Returns [M, N].
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor weight) {
  TORCH_CHECK(small_batch_linear_supported(), "small_batch_linear needs a CPU with AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16,
              "small_batch_linear takes bfloat16 tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_batch_linear needs contiguous tensors");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  TORCH_CHECK(m_size >= 1 && m_size <= 8, "small_batch_linear serves 1 to 8 rows");
  TORCH_CHECK(k_size % 32 == 0, "small_batch_linear needs an input width that is a multiple of 32");
  auto out = torch::empty({m_size, n_size}, x.options());
#ifdef LLMSERVE_BF16_LINEAR
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  switch (m_size) {
    case 1: linear_rows<1>(xs, ws, os, k_size, n_size); break;
    case 2: linear_rows<2>(xs, ws, os, k_size, n_size); break;
    case 3: linear_rows<3>(xs, ws, os, k_size, n_size); break;
    case 4: linear_rows<4>(xs, ws, os, k_size, n_size); break;
    case 5: linear_rows<5>(xs, ws, os, k_size, n_size); break;
    case 6: linear_rows<6>(xs, ws, os, k_size, n_size); break;
    case 7: linear_rows<7>(xs, ws, os, k_size, n_size); break;
    default: linear_rows<8>(xs, ws, os, k_size, n_size); break;
  }
#endif
  return out;
}
