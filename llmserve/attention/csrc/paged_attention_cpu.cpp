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
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename scalar_t>
void decode_kernel(const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                   const int64_t* block_tables, const int64_t* seq_lens, scalar_t* out,
                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive slots
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t context = seq_lens[seq];
      const int64_t* table = block_tables + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* q_row = query + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = to_float(q_row[d]) * scale;
      }
      scores.assign(group * context, 0.0f);
      // Pass 1: scores = q . k for every context position.
      for (int64_t pos = 0; pos < context; ++pos) {
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const scalar_t* k = key_cache + slot * slot_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(k[d]);
          scores[g * context + pos] = dot;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * context;
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t pos = 0; pos < context; ++pos) max_score = std::max(max_score, s[pos]);
        float total = 0.0f;
        for (int64_t pos = 0; pos < context; ++pos) {
          s[pos] = std::exp(s[pos] - max_score);
          total += s[pos];
        }
        const float inverse = 1.0f / total;
        for (int64_t pos = 0; pos < context; ++pos) s[pos] *= inverse;
      }
      // Pass 2: out = sum_pos p[pos] * v[pos].
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t pos = 0; pos < context; ++pos) {
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const scalar_t* v = value_cache + slot * slot_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * context + pos];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(v[d]);
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
