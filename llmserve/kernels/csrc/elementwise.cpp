// The small per-layer operations of a Llama block, one call each: RMSNorm (optionally adding the
// residual first), rotary embedding in place, and SiLU(gate) * up.
//
// In PyTorch each of them is 3-12 separate ops (dtype casts, pow, mean, rsqrt, multiplies, chunk, cat),
// every one a dispatch and a fresh tensor. At decode batch sizes the tensors are a few kilobytes and
// the step is bound by that per-op overhead (about 60 ops per layer, 30 layers), not by arithmetic;
// here each is one pass over the rows. Rounding follows the PyTorch modules they replace: float32
// arithmetic, results rounded to the tensor's dtype at the same points (RMSNorm rounds the normalized
// row before the weight multiplies it; SiLU rounds before the product), so bf16 outputs match the
// reference path except where float32 sums are associated differently.
//
// Loops are plain C++ over float32 lanes that the compiler vectorizes (-O3 -march=native; SiLU's
// exponential is vector_math.h's); rows are shared among torch's threads when there are enough of
// them to pay for the hand-off.
#include "aten.h"

#include "kernels.h"

// No fused multiply-adds where PyTorch rounds twice: a*cos - b*sin must round a*cos and b*sin to
// float32 first, as the reference's separate multiply and subtract do. A contracted form is more
// accurate, but on SmolLM2 (outlier activations reach ~2,600, where a bf16 step is 16) its odd bf16
// result that rounds the other way moved layer outputs by up to 12 from the PyTorch path's; without
// contraction the rotary output matches that path bit for bit.
#pragma GCC optimize("fp-contract=off")

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vector_math.h"

namespace {

constexpr int64_t kParallelElements = 1 << 15;  // below this one thread is faster than a hand-off

// Element conversion to and from float32. bf16 rounds to nearest even like torch (NaN stays NaN).
template <typename scalar_t>
struct Convert {
  static float load(scalar_t x) { return static_cast<float>(x); }
  static scalar_t store(float x) { return static_cast<scalar_t>(x); }
};

template <>
struct Convert<c10::BFloat16> {
  static float load(c10::BFloat16 x) {
    uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
  static c10::BFloat16 store(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return c10::BFloat16(static_cast<uint16_t>(x != x ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
  }
};

// The same value after a round trip through scalar_t (where PyTorch would have stored a tensor).
template <typename scalar_t>
inline float round_to(float x) {
  return Convert<scalar_t>::load(Convert<scalar_t>::store(x));
}

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, row_elements));
}

// ---- RMSNorm ------------------------------------------------------------------------------------

template <typename scalar_t>
float inverse_rms(const scalar_t* x, int64_t n, float eps) {
  float lanes[16] = {0};  // sixteen partial sums: a vectorizable reduction without -ffast-math
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) {
      const float v = Convert<scalar_t>::load(x[i + l]);
      lanes[l] += v * v;
    }
  }
  float sum = 0.0f;
  for (; i < n; ++i) {
    const float v = Convert<scalar_t>::load(x[i]);
    sum += v * v;
  }
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = weight * round(x * inverse_rms(x)); out may alias x.
template <typename scalar_t>
void normalize_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t n, float eps) {
  const float scale = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normalized = round_to<scalar_t>(Convert<scalar_t>::load(x[i]) * scale);
    out[i] = Convert<scalar_t>::store(Convert<scalar_t>::load(weight[i]) * normalized);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The same for bf16 rows, 16 lanes at a time with vcvtneps2bf16's roundings (see swiglu_row_avx512 on
// how they differ from Convert::store: a float32 denormal becomes zero); a row's tail goes through a
// zero-padded vector, so every element sees the same arithmetic.
template <>
void normalize_row(const c10::BFloat16* x, const c10::BFloat16* weight, c10::BFloat16* out, int64_t n, float eps) {
  const __m512 scale = _mm512_set1_ps(inverse_rms(x, n, eps));
  auto load = [](const c10::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  auto row16 = [&](const c10::BFloat16* xs, const c10::BFloat16* ws) {
    const __m512 normalized = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(load(xs), scale)));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load(ws), normalized));
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), row16(x + i, weight + i));
  if (i < n) {
    c10::BFloat16 xs[16] = {}, ws[16] = {}, result[16];
    std::copy(x + i, x + n, xs);
    std::copy(weight + i, weight + n, ws);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(result), row16(xs, ws));
    std::copy(result, result + (n - i), out + i);
  }
}
#endif

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "expected rows [tokens, hidden] with unit stride");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden], contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and input must share a dtype");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) normalize_row(in + r * stride, w, o + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// x += residual (rounded to the dtype, as `residual + sublayer_out` is) in place, and returns RMSNorm of
// the sum: a decoder layer's "add the sublayer's output back, normalize for the next sublayer" in one
// pass. x is the sublayer's fresh output, so nobody else's tensor changes; residual is only read.
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "residual must match the input's shape and dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0), r_stride = residual.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* sum = xs + r * x_stride;
        const scalar_t* res_row = res + r * r_stride;
        for (int64_t i = 0; i < n; ++i) {
          sum[i] = Convert<scalar_t>::store(Convert<scalar_t>::load(res_row[i]) + Convert<scalar_t>::load(sum[i]));
        }
        normalize_row(sum, w, o + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// ---- rotary embedding ---------------------------------------------------------------------------

namespace {

// Rotate-half RoPE on every head of one token's row: (a, b) -> (a cos - b sin, b cos + a sin).
template <typename scalar_t>
void rotate_heads(scalar_t* row, int64_t heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* first = row + h * head_dim;
    scalar_t* second = first + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = Convert<scalar_t>::load(first[i]), b = Convert<scalar_t>::load(second[i]);
      first[i] = Convert<scalar_t>::store(a * cos[i] - b * sin[i]);
      second[i] = Convert<scalar_t>::store(b * cos[i] + a * sin[i]);
    }
  }
}

}  // namespace

// query [tokens, heads * head_dim] and key [tokens, kv_heads * head_dim], rows possibly strided (views
// of the fused qkv output), rotated in place; cos / sin are float32 [max_positions, head_dim / 2].
void rotary_embedding(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor cos,
                      at::Tensor sin, int64_t head_dim) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.stride(1) == 1 && key.stride(1) == 1,
              "query and key must be [tokens, heads * head_dim] with unit stride");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) * 2 == head_dim,
              "cos / sin must be contiguous float32 [positions, head_dim / 2]");
  const int64_t tokens = query.size(0);
  TORCH_CHECK(positions.numel() == tokens && key.size(0) == tokens, "one position per token");
  const int64_t q_heads = query.size(1) / head_dim, k_heads = key.size(1) / head_dim;
  const int64_t q_stride = query.stride(0), k_stride = key.stride(0), half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  const float* cos_table = cos.data_ptr<float>();
  const float* sin_table = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain_rows((q_heads + k_heads) * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cos_table + pos[t] * half;
        const float* s = sin_table + pos[t] * half;
        rotate_heads(q + t * q_stride, q_heads, head_dim, c, s);
        rotate_heads(k + t * k_stride, k_heads, head_dim, c, s);
      }
    });
  });
}

// ---- SwiGLU -------------------------------------------------------------------------------------

namespace {

// dst[i] = round(round(silu(gate[i])) * up[i]): F.silu(gate) * up with its two roundings.
template <typename scalar_t>
void swiglu_row(const scalar_t* gate, const scalar_t* up, scalar_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = Convert<scalar_t>::load(gate[i]);
    const float silu = round_to<scalar_t>(g / (1.0f + vexp(-g)));
    dst[i] = Convert<scalar_t>::store(silu * Convert<scalar_t>::load(up[i]));
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The same, 8 lanes at a time with exp256. The compiler left the loop above scalar (a call per element
// for the rounding in vexp), slow enough at small batch to keep the other thread waiting. A row's tail
// goes through a zero-padded vector, so every element sees the same arithmetic.
inline __m256 swiglu8(__m256 gate, __m256 up, bool bf16) {
  const __m256 exp_minus = exp256(_mm256_xor_ps(gate, _mm256_set1_ps(-0.0f)));
  __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_minus));
  if (bf16) silu = round_to_bf16_8(silu);
  return _mm256_mul_ps(silu, up);
}

template <typename scalar_t>
void swiglu_row_avx2(const scalar_t* gate, const scalar_t* up, scalar_t* dst, int64_t n) {
  constexpr bool bf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, swiglu8(load8(gate + i), load8(up + i), bf16));
  if (i < n) {
    scalar_t g[8] = {}, u[8] = {}, out[8];
    std::copy(gate + i, gate + n, g);
    std::copy(up + i, up + n, u);
    store8(out, swiglu8(load8(g), load8(u), bf16));
    std::copy(out, out + (n - i), dst + i);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The same arithmetic 16 lanes at a time (exp512 is exp256's polynomial; its scalef by 2^n is exact, as
// exp256's exponent bits are), for bf16 rows on CPUs with AVX-512 BF16: half the instructions per element.
// Both roundings are vcvtneps2bf16's (to nearest even, as Convert::store; a float32 denormal becomes
// zero, and a NaN stays a NaN with its own payload), a third of the time of rounding by integer ops.
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

void swiglu_row_avx512(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* dst, int64_t n) {
  auto swiglu16 = [](__m512 g, __m512 u) {
    const __m512 exp_minus = exp512(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN))));
    const __m512 silu = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_minus))));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u));
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), swiglu16(load16(gate + i), load16(up + i)));
  if (i < n) {
    c10::BFloat16 g[16] = {}, u[16] = {}, out[16];
    std::copy(gate + i, gate + n, g);
    std::copy(up + i, up + n, u);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), swiglu16(load16(g), load16(u)));
    std::copy(out, out + (n - i), dst + i);
  }
}
#endif

template <>
void swiglu_row(const float* gate, const float* up, float* dst, int64_t n) {
  swiglu_row_avx2(gate, up, dst, n);
}
template <>
void swiglu_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* dst, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  swiglu_row_avx512(gate, up, dst, n);
#else
  swiglu_row_avx2(gate, up, dst, n);
#endif
}
#endif

}  // namespace

// gate_up [tokens, 2 * inter] (gate then up, as the fused projection writes them) -> [tokens, inter].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "expected [tokens, 2 * intermediate] with unit stride");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) swiglu_row(in + r * stride, in + r * stride + inter, o + r * inter, inter);
    });
  });
  return out;
}
