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

bool small_batch_linear_supported_impl() {
#ifdef LLMSERVE_BF16_LINEAR
  return true;
#else
  return false;
#endif
}

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

// The int8 variant: weights stored as int8 with one scale per output row (weight-only quantization).
// Each chunk of 32 codes is widened to bf16, exactly (|q| <= 127 fits bf16's 8-bit significand), and
// multiplied like the bf16 weights; the row's scale multiplies the float32 sum. Half the bytes of
// bf16 to stream for about five more instructions per 32 weights.
inline __m512i widen_int8_to_bf16(const int8_t* codes) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 high =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(high, low);  // element i of the pair vector is code i
}

template <int M, int R>
inline void linear_int8_tile(const uint16_t* x, const int8_t* w, const float* scales, uint16_t* out, int64_t k_size,
                             int64_t n_size, int64_t row) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; k += 32) {
    __m512i weights[R];
    for (int r = 0; r < R; ++r) weights[r] = widen_int8_to_bf16(w + (row + r) * k_size + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh input = (__m512bh)_mm512_loadu_si512(x + m * k_size + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], input, (__m512bh)weights[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      const c10::BFloat16 value(_mm512_reduce_add_ps(acc[r][m]) * scales[row + r]);
      out[m * n_size + row + r] = value.x;
    }
}

template <int M>
void linear_int8_rows(const uint16_t* x, const int8_t* w, const float* scales, uint16_t* out, int64_t k_size,
                      int64_t n_size) {
  constexpr int R = M <= 2 ? 8 : 4;
  const int64_t tiles = n_size / R;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (k_size * R));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      linear_int8_tile<M, R>(x, w, scales, out, k_size, n_size, tile * R);
  });
  for (int64_t row = tiles * R; row < n_size; ++row) linear_int8_tile<M, 1>(x, w, scales, out, k_size, n_size, row);
}

#endif  // LLMSERVE_BF16_LINEAR

void check_small_batch_input(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(small_batch_linear_supported_impl(), "small_batch_linear needs a CPU with AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "small_batch_linear takes bfloat16 inputs");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_batch_linear needs contiguous tensors");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_batch_linear serves 1 to 8 rows");
  TORCH_CHECK(x.size(1) % 32 == 0, "small_batch_linear needs an input width that is a multiple of 32");
}

}  // namespace

bool small_batch_linear_supported() { return small_batch_linear_supported_impl(); }

// x [M, K] bf16 with 1 <= M <= 8, weight [N, K] bf16, K a multiple of 32; both contiguous. Returns [M, N].
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor weight) {
  check_small_batch_input(x, weight);
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16, "small_batch_linear takes bfloat16 weights");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
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

// x [M, K] bf16 with 1 <= M <= 8, qweight [N, K] int8, scales [N] float32; K a multiple of 32.
// Returns [M, N] bf16: (x qweight^T) * scales.
torch::Tensor small_batch_linear_int8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  check_small_batch_input(x, qweight);
  TORCH_CHECK(qweight.scalar_type() == torch::kChar, "small_batch_linear_int8 takes int8 weights");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.dim() == 1 &&
                  scales.size(0) == qweight.size(0),
              "scales must be float32 [N]");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = qweight.size(0);
  auto out = torch::empty({m_size, n_size}, x.options());
#ifdef LLMSERVE_BF16_LINEAR
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const int8_t* ws = qweight.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  switch (m_size) {
    case 1: linear_int8_rows<1>(xs, ws, ss, os, k_size, n_size); break;
    case 2: linear_int8_rows<2>(xs, ws, ss, os, k_size, n_size); break;
    case 3: linear_int8_rows<3>(xs, ws, ss, os, k_size, n_size); break;
    case 4: linear_int8_rows<4>(xs, ws, ss, os, k_size, n_size); break;
    case 5: linear_int8_rows<5>(xs, ws, ss, os, k_size, n_size); break;
    case 6: linear_int8_rows<6>(xs, ws, ss, os, k_size, n_size); break;
    case 7: linear_int8_rows<7>(xs, ws, ss, os, k_size, n_size); break;
    default: linear_int8_rows<8>(xs, ws, ss, os, k_size, n_size); break;
  }
#endif
  return out;
}
