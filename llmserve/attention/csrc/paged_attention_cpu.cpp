// Decode attention over the paged KV cache, read in place (no gathered copy of the context).
//
// One work item per (sequence, KV head): the G = num_heads / num_kv_heads query heads that share the
// KV head are processed together, so each K and V row is loaded once for all of them (GQA).
// Scores for the whole context go to a per-thread buffer (two passes: max, then exp-sum and the
// weighted sum of V), which keeps the inner loops simple, contiguous and auto-vectorized.
//
// 8-bit caches (int8, fp8; see kv_format.py) are dequantized row by row as they are read. With a
// sliding window only the sink positions and the window are visited: freed blocks are never touched.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

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

// Readers of one cached (slot, kv head) row into floats. Plain rows are head_dim values of the
// cache's dtype; 8-bit rows (kv_format.py) are head_dim codes followed by the row's float16 scale.
template <typename T>
struct PlainRows {
  using elem_t = T;
  static constexpr int64_t extra = 0;
  static void load(const T* src, float* dst, int64_t n) { load_row(src, dst, n); }
};

inline float read_scale(const uint8_t* src, int64_t n) {
  uint16_t bits;
  std::memcpy(&bits, src + n, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct Int8Rows {
  using elem_t = uint8_t;
  static constexpr int64_t extra = 2;
  static void load(const uint8_t* src, float* dst, int64_t n) {
    const float scale = read_scale(src, n);
    const int8_t* codes = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(codes[i]) * scale;
  }
};

struct Fp8Rows {
  using elem_t = uint8_t;
  static constexpr int64_t extra = 2;
  static const float* table() {  // every float8_e4m3fn bit pattern's value, built once
    static const std::vector<float> values = [] {
      std::vector<float> v(256);
      for (int bits = 0; bits < 256; ++bits)
        v[bits] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
      return v;
    }();
    return values.data();
  }
  static void load(const uint8_t* src, float* dst, int64_t n) {
    const float scale = read_scale(src, n);
    const float* values = table();
    for (int64_t i = 0; i < n; ++i) dst[i] = values[src[i]] * scale;
  }
};

// Calls visit(row, index) for context positions [begin, end) in order, walking the block table one
// block at a time; `index` counts from `first_index` (the position's place in the scores buffer).
template <typename elem_t, typename Visit>
inline void walk_positions(const elem_t* cache, const int64_t* table, int64_t begin, int64_t end,
                           int64_t first_index, int64_t block_size, int64_t slot_stride, Visit&& visit) {
  for (int64_t pos = begin; pos < end;) {
    const int64_t offset = pos % block_size, count = std::min(block_size - offset, end - pos);
    const elem_t* rows = cache + (table[pos / block_size] * block_size + offset) * slot_stride;
    const int64_t index = first_index + pos - begin;
    for (int64_t t = 0; t < count; ++t) visit(rows + t * slot_stride, index + t);
    pos += count;
  }
}

template <typename scalar_t, typename Rows>
void decode_kernel(const scalar_t* query, const typename Rows::elem_t* key_cache,
                   const typename Rows::elem_t* value_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                   int64_t sinks, int64_t window) {
  using elem_t = typename Rows::elem_t;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_len = head_dim + Rows::extra;
  const int64_t slot_stride = num_kv_heads * row_len;  // elements between consecutive slots
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t length = seq_lens[seq];
      // Live context: [0, sink_end) and [window_begin, length); one range when there is no window.
      const int64_t sink_end = window > 0 ? std::min(sinks, length) : length;
      const int64_t window_begin = window > 0 ? std::max(sink_end, length - window) : length;
      const int64_t context = sink_end + length - window_begin;
      const int64_t* table = block_tables + seq * max_blocks;
      const elem_t* keys = key_cache + kv_head * row_len;
      const elem_t* values = value_cache + kv_head * row_len;
      for (int64_t g = 0; g < group; ++g) {
        load_row(query + (seq * num_heads + kv_head * group + g) * head_dim, q.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] *= scale;
      }
      if (static_cast<int64_t>(scores.size()) < group * context) scores.resize(group * context);
      // Pass 1: scores = q . k for every live position, one K row load for the whole group.
      auto score = [&](const elem_t* key_row, int64_t index) {
        Rows::load(key_row, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) scores[g * context + index] = dot(q.data() + g * head_dim, row.data(), head_dim);
      };
      walk_positions(keys, table, 0, sink_end, 0, block_size, slot_stride, score);
      walk_positions(keys, table, window_begin, length, sink_end, block_size, slot_stride, score);
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
      auto accumulate = [&](const elem_t* value_row, int64_t index) {
        Rows::load(value_row, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * context + index], row.data(), acc.data() + g * head_dim, head_dim);
      };
      walk_positions(values, table, 0, sink_end, 0, block_size, slot_stride, accumulate);
      walk_positions(values, table, window_begin, length, sink_end, block_size, slot_stride, accumulate);
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* o = out + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

// query [B, H, D]; key_cache, value_cache [slots, KVH, D] in the query's dtype, or, for an 8-bit
// cache (kv_format 1 = int8, 2 = fp8), [slots, KVH, D + 2] bytes; block_tables [B, max_blocks] int64;
// seq_lens [B] int64; window > 0 keeps only the first `sinks` and the last `window` positions.
// Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size,
                                     double scale, int64_t kv_format, int64_t sinks, int64_t window) {
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
  TORCH_CHECK(kv_format >= 0 && kv_format <= 2, "kv_format must be 0 (plain), 1 (int8) or 2 (fp8)");
  if (kv_format == 0) {
    TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(), "a plain KV cache must have the query's dtype");
  } else {
    TORCH_CHECK(key_cache.scalar_type() == torch::kByte && key_cache.size(2) == head_dim + 2,
                "an 8-bit KV cache must be uint8 rows of head_dim + 2 bytes");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto rows_tag, const auto* keys, const auto* values) {
      using Rows = decltype(rows_tag);
      decode_kernel<scalar_t, Rows>(query.data_ptr<scalar_t>(), keys, values, tables.data_ptr<int64_t>(),
                                    lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_seqs, num_heads,
                                    num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale),
                                    sinks, window);
    };
    if (kv_format == 0) {
      run(PlainRows<scalar_t>{}, key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>());
    } else if (kv_format == 1) {
      run(Int8Rows{}, key_cache.data_ptr<uint8_t>(), value_cache.data_ptr<uint8_t>());
    } else {
      run(Fp8Rows{}, key_cache.data_ptr<uint8_t>(), value_cache.data_ptr<uint8_t>());
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over a paged KV cache (CPU)");
}
