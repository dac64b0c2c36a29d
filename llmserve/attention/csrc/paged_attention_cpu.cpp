// Decode attention over the paged KV cache, read in place (no gathered copy of the context).
//
// One work item per (sequence, KV head): the G = num_heads / num_kv_heads query heads that share the
// KV head are processed together, so each K and V row is loaded once for all of them (GQA).
// Scores for the whole context go to a per-thread buffer (two passes: max, then exp-sum and the
// weighted sum of V), which keeps the inner loops simple, contiguous and auto-vectorized.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Row conversion to float, written so the compiler vectorizes it (bf16 is the top half of a float).
inline void load_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void load_row(const double* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {  // widen 16 halves to 32 bits and shift them into the float's top
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16)));
  }
#endif
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) = 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-6 Taylor polynomial
// (relative error ~1e-7). Unlike std::exp it vectorizes, and softmax spends most of its time here.
inline float vexp(float x) {
  const float t = std::max(x, -87.0f) * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.6931471805599453f;  // back to natural-log units: 2^(t-n) = e^f
  const float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename scalar_t>
void decode_kernel(const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                   const int64_t* block_tables, const int64_t* seq_lens, scalar_t* out,
                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive slots
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t context = seq_lens[seq];
      const int64_t* table = block_tables + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        load_row(query + (seq * num_heads + kv_head * group + g) * head_dim, q.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] *= scale;
      }
      if (static_cast<int64_t>(scores.size()) < group * context) scores.resize(group * context);
      const int64_t num_blocks = (context + block_size - 1) / block_size;
      // Pass 1: scores = q . k for every context position, one K row load for the whole group.
      for (int64_t block = 0; block < num_blocks; ++block) {
        const scalar_t* keys = key_cache + table[block] * block_size * slot_stride + kv_head * head_dim;
        const int64_t first = block * block_size, count = std::min(block_size, context - first);
        for (int64_t t = 0; t < count; ++t) {
          load_row(keys + t * slot_stride, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g)
            scores[g * context + first + t] = dot(q.data() + g * head_dim, row.data(), head_dim);
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * context;
        float max_score = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_score)
        for (int64_t pos = 0; pos < context; ++pos) max_score = std::max(max_score, s[pos]);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t pos = 0; pos < context; ++pos) {
          s[pos] = vexp(s[pos] - max_score);
          total += s[pos];
        }
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t pos = 0; pos < context; ++pos) s[pos] *= inverse;
      }
      // Pass 2: out = sum_pos p[pos] * v[pos].
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t block = 0; block < num_blocks; ++block) {
        const scalar_t* values = value_cache + table[block] * block_size * slot_stride + kv_head * head_dim;
        const int64_t first = block * block_size, count = std::min(block_size, context - first);
        for (int64_t t = 0; t < count; ++t) {
          load_row(values + t * slot_stride, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g)
            axpy(scores[g * context + first + t], row.data(), acc.data() + g * head_dim, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* o = out + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

// query [B, H, D]; key_cache, value_cache [slots, KVH, D]; block_tables [B, max_blocks] int64;
// seq_lens [B] int64; returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size,
                                     double scale) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode_attention needs contiguous tensors");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                            value_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                            lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_seqs, num_heads,
                            num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over a paged KV cache (CPU)");
}
