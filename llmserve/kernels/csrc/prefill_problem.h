// The causal span a prefill attention kernel computes (prefill_attention.cpp in bf16, stored as raw
// uint16_t bits; prefill_attention_fma.cpp in float32 arithmetic over float or c10::BFloat16).
#pragma once

#include "aten.h"

#include <cstdint>

template <typename T>
struct PrefillProblem {
  const T* query;  // row (token i, head h) at query + i * query_stride + h * D
  const T* key_cache;
  const T* value_cache;
  const int64_t* slots;  // the slot of each context position
  T* out;                // [num_queries, num_heads, D]
  int64_t query_stride, num_queries, context, num_heads, num_kv_heads, slot_stride, num_tiles;
  float scale;
  int64_t group() const { return num_heads / num_kv_heads; }
  // the queries are the context's last positions
  int64_t first_position() const { return context - num_queries; }
};

// The problem over tensors prefill_attention has checked: query [Q, H, D] (any token stride), caches
// [slots, KVH, D] contiguous, out [Q, H, D]; T is the element type as the kernel reads it.
template <typename T>
PrefillProblem<T> prefill_problem(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const int64_t* slots, int64_t context,
                                  at::Tensor& out, int64_t tile, double scale) {
  const int64_t num_kv_heads = key_cache.size(1), head_dim = query.size(2);
  return {static_cast<const T*>(query.data_ptr()),
          static_cast<const T*>(key_cache.data_ptr()),
          static_cast<const T*>(value_cache.data_ptr()),
          slots,
          static_cast<T*>(out.data_ptr()),
          query.stride(0),
          query.size(0),
          context,
          query.size(1),
          num_kv_heads,
          num_kv_heads * head_dim,
          (context + tile - 1) / tile,
          static_cast<float>(scale)};
}
