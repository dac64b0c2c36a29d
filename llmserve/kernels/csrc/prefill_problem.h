// The causal span a prefill attention kernel computes (prefill_attention.cpp in bf16, stored as raw
// uint16_t bits; prefill_attention_f32.cpp in float32).
#pragma once

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
