// Linear layers at small batch: y = x W^T for bfloat16 x [M, K] with M <= 8 (decode at low
// concurrency, speculative verification of a few drafts), W in bfloat16 or int8 with one scale per
// output row (weight-only quantization).
//
// At these sizes a linear layer is a matrix-vector product: every weight is read from memory once and
// used M times, so the work is bound by memory bandwidth. The general bf16 GEMM path in PyTorch reaches
// about a third of the machine's bandwidth here; this kernel streams each weight row once and multiplies
// bf16 pairs exactly with AVX-512 BF16 (vdpbf16ps), summing in float32, for all M inputs at once.
// int8 codes are widened to bf16 in registers, exactly (|q| <= 127 fits bf16's 8-bit significand), and
// the row's scale multiplies the float32 sum: half the bytes of bf16 for a few more instructions.
// Tiles of R weight rows run on the threads; the M x R float32 accumulators stay in registers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
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

// The weight formats: 32 weights of row `row` from column k as bf16 pairs, and the row's scale.
struct Bf16Weights {
  const uint16_t* w;
  int64_t k_size;
  __m512i load(int64_t row, int64_t k) const { return _mm512_loadu_si512(w + row * k_size + k); }
  float scale(int64_t) const { return 1.0f; }
};

struct Int8Weights {
  const int8_t* w;
  const float* scales;
  int64_t k_size;
  __m512i load(int64_t row, int64_t k) const {
    const int8_t* codes = w + row * k_size + k;
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
    const __m512 high =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);  // element i of the pair vector is code i
  }
  float scale(int64_t row) const { return scales[row]; }
};

// Output rows [row, row + R) for all M inputs: out[m][row + r] = scale(row + r) * sum_k x[m][k] w[row + r][k].
template <int M, int R, typename Weights>
inline void linear_tile(const uint16_t* x, const Weights& weights, uint16_t* out, int64_t k_size, int64_t n_size,
                        int64_t row) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; k += 32) {
    __m512i w[R];
    for (int r = 0; r < R; ++r) w[r] = weights.load(row + r, k);
    for (int m = 0; m < M; ++m) {
      const __m512bh input = (__m512bh)_mm512_loadu_si512(x + m * k_size + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], input, (__m512bh)w[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      const c10::BFloat16 value(_mm512_reduce_add_ps(acc[r][m]) * weights.scale(row + r));  // nearest even
      out[m * n_size + row + r] = value.x;
    }
}

template <int M, typename Weights>
void linear_rows(const uint16_t* x, const Weights& weights, uint16_t* out, int64_t k_size, int64_t n_size,
                 int64_t weight_bytes) {
  constexpr int R = M <= 2 ? 8 : 4;  // R x M accumulators plus R weight registers within 32
  const int64_t tiles = n_size / R;
  // Each task covers at least ~64 KiB of weights, so thread start-up is paid on real work.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (weight_bytes * k_size * R));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) linear_tile<M, R>(x, weights, out, k_size, n_size, tile * R);
  });
  for (int64_t row = tiles * R; row < n_size; ++row) linear_tile<M, 1>(x, weights, out, k_size, n_size, row);
}

template <typename Weights>
void linear(const uint16_t* x, const Weights& weights, uint16_t* out, int64_t m_size, int64_t k_size,
            int64_t n_size, int64_t weight_bytes) {
  switch (m_size) {
    case 1: linear_rows<1>(x, weights, out, k_size, n_size, weight_bytes); break;
    case 2: linear_rows<2>(x, weights, out, k_size, n_size, weight_bytes); break;
    case 3: linear_rows<3>(x, weights, out, k_size, n_size, weight_bytes); break;
    case 4: linear_rows<4>(x, weights, out, k_size, n_size, weight_bytes); break;
    case 5: linear_rows<5>(x, weights, out, k_size, n_size, weight_bytes); break;
    case 6: linear_rows<6>(x, weights, out, k_size, n_size, weight_bytes); break;
    case 7: linear_rows<7>(x, weights, out, k_size, n_size, weight_bytes); break;
    default: linear_rows<8>(x, weights, out, k_size, n_size, weight_bytes); break;
  }
}

#endif  // LLMSERVE_BF16_LINEAR

// Checks shared by both entry points; returns an empty [M, N] bf16 output.
torch::Tensor checked_output(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(small_batch_linear_supported(), "small_batch_linear needs a CPU with AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "small_batch_linear takes bfloat16 inputs");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_batch_linear needs contiguous tensors");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_batch_linear serves 1 to 8 rows");
  TORCH_CHECK(x.size(1) % 32 == 0, "small_batch_linear needs an input width that is a multiple of 32");
  return torch::empty({x.size(0), weight.size(0)}, x.options());
}

}  // namespace

// x [M, K] bf16 with 1 <= M <= 8, weight [N, K] bf16, K a multiple of 32; both contiguous. Returns [M, N].
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor weight) {
  auto out = checked_output(x, weight);
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16, "small_batch_linear takes bfloat16 weights");
#ifdef LLMSERVE_BF16_LINEAR
  const int64_t k_size = x.size(1);
  const Bf16Weights weights{reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()), k_size};
  linear(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), weights,
         reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), x.size(0), k_size, weight.size(0), 2);
#endif
  return out;
}

// x [M, K] bf16 with 1 <= M <= 8, qweight [N, K] int8, scales [N] float32; K a multiple of 32.
// Returns [M, N] bf16: (x qweight^T) * scales.
torch::Tensor small_batch_linear_int8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  auto out = checked_output(x, qweight);
  TORCH_CHECK(qweight.scalar_type() == torch::kChar, "small_batch_linear_int8 takes int8 weights");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.dim() == 1 &&
                  scales.size(0) == qweight.size(0),
              "scales must be float32 [N]");
#ifdef LLMSERVE_BF16_LINEAR
  const int64_t k_size = x.size(1);
  const Int8Weights weights{qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), k_size};
  linear(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), weights,
         reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), x.size(0), k_size, qweight.size(0), 1);
#endif
  return out;
}
