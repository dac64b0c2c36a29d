// Writing this step's K (or V) rows into their slots of the paged pool.
//
// `index_copy_` does this through a generic indexed-copy loop, slow for a few KB twice per layer. A
// row per token is one contiguous run of kv_heads * head_dim elements in the pool, so the write is one
// memcpy per token.
//
// Decode rows land in different blocks scattered over the pool, so each memcpy would wait for its
// destination lines to come from memory, one row after another. Prefetching every destination line
// for writing first lets those misses overlap; the copies then hit the cache.
#include "aten.h"

#include "kernels.h"

#include <cstring>

// cache [num_slots, kv_heads, head_dim] (contiguous), slots [tokens] int64, rows [tokens, kv_heads,
// head_dim] with each token's heads contiguous (rows may be a strided view of the qkv projection).
void write_kv_rows(at::Tensor cache, at::Tensor slots, at::Tensor rows) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 3, "cache must be contiguous [slots, kv_heads, row]");
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(1) && rows.size(2) == cache.size(2),
              "rows must be [tokens, kv_heads, row] like the cache");
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == rows.size(2), "each token's heads must be contiguous");
  TORCH_CHECK(rows.scalar_type() == cache.scalar_type(), "rows and cache must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows.size(0),
              "slots must be int64, one per row");
  const int64_t tokens = rows.size(0), num_slots = cache.size(0);
  const int64_t row_bytes = rows.size(1) * rows.size(2) * rows.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot out of range");
  const char* src = static_cast<const char*>(rows.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t src_stride = rows.stride(0) * rows.element_size();
  at::parallel_for(0, tokens, std::max<int64_t>(1, (1 << 16) / row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(dst + slot[t] * row_bytes + line, 1, 3);
    for (int64_t t = begin; t < end; ++t) std::memcpy(dst + slot[t] * row_bytes, src + t * src_stride, row_bytes);
  });
}
