// Causal attention of one long prompt span over its paged context with float32 arithmetic (AVX2 and
// FMA): the counterpart of prefill_attention.cpp's bf16 kernel for CPUs without native bf16, where
// PyTorch's CPU flash attention (after a gather of the context) runs prompt spans far below the matmul
// rate, in float32 and even more so in bf16. Queries, caches and output are float32, or bf16 widened
// exactly as they are read (each block's query rows into a float32 buffer, the cache into the packed
// tiles) and the output rounded to bf16 (nearest even) as it is stored.
//
// The span's queries are the last `num_queries` of `context` positions; position j's K/V row is at slot
// context_slots[j] of the pool. Each KV head's context is first copied once per call into tiles of 16
// keys: K transposed ([D][16], so that q.k for 16 keys is a broadcast query value times one 16-key
// column per dimension) and V as plain rows ([16][D], contiguous). Query rows (token, head of the KV
// group; token-major) then go in blocks of R, two passes per block as the decode kernel does: the scores
// of the block's rows against every key up to its last row's position, an exact softmax per row (keys
// after a row's own position get probability 0), then P V with R rows x 16 columns of output in
// registers. Blocks are dealt out to the threads costliest (latest) first.
#include "aten.h"
#include <omp.h>

#include "kernels.h"
#include "prefill_problem.h"
#include "vector_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int kTile = 16;  // keys per packed tile: two vectors of scores per query row
constexpr int R = 6;       // query rows per block: 12 score (or output) accumulators in registers


// Tile `tile` of KV head `kv_head`: keys as [D][16], values as [16][D]; keys past the context are zero
// (never visible, so their probability is 0, and zero values keep 0 * garbage out of the sums).
template <int D, typename T>
void pack_tile(const PrefillProblem<T>& pb, int64_t kv_head, int64_t tile, float* keys, float* values) {
  const int64_t first = tile * kTile, count = std::min<int64_t>(kTile, pb.context - first);
  for (int64_t j = 0; j < kTile; ++j) {
    float* value_row = values + j * D;
    if (j >= count) {
      for (int d = 0; d < D; ++d) keys[d * kTile + j] = 0.0f;
      std::fill(value_row, value_row + D, 0.0f);
      continue;
    }
    const int64_t offset = pb.slots[first + j] * pb.slot_stride + kv_head * D;
    const T* key_row = pb.key_cache + offset;
    for (int d = 0; d < D; ++d) keys[d * kTile + j] = static_cast<float>(key_row[d]);
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(value_row, pb.value_cache + offset, D * sizeof(float));
    } else {
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(value_row + d, load8(pb.value_cache + offset + d));
    }
  }
}

// Query rows [first_row, first_row + R) of KV head `kv_head` (rows past the span repeat its last row
// and are not stored) over the packed context; `scores` holds R rows of `pitch` floats.
template <int D, typename T>
void attend_rows(const PrefillProblem<T>& pb, int64_t kv_head, int64_t first_row, const float* packed_keys,
                 const float* packed_values, float* scores, int64_t pitch) {
  const int64_t group = pb.group(), num_rows = pb.num_queries * group;
  const float* q[R];
  alignas(32) float widened[std::is_same_v<T, float> ? 1 : R * D];  // bf16 query rows as float32
  int64_t visible[R];  // keys [0, visible) for each row
  for (int r = 0; r < R; ++r) {
    const int64_t row = std::min(first_row + r, num_rows - 1), token = row / group;
    const T* query_row = pb.query + token * pb.query_stride + (kv_head * group + row % group) * D;
    if constexpr (std::is_same_v<T, float>) {
      q[r] = query_row;
    } else {
      for (int d = 0; d < D; d += 8) _mm256_store_ps(widened + r * D + d, load8(query_row + d));
      q[r] = widened + r * D;
    }
    visible[r] = pb.first_position() + token + 1;
  }
  const int64_t num_keys = visible[R - 1], num_tiles = (num_keys + kTile - 1) / kTile;
  // scores: R rows x 16 keys per tile, one FMA chain over the dimensions per (row, 8 keys)
  const __m256 scale = _mm256_set1_ps(pb.scale);
  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    const float* keys = packed_keys + tile * kTile * D;
    __m256 s[R][2];
    LLMSERVE_UNROLL for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(keys + d * kTile), k1 = _mm256_loadu_ps(keys + d * kTile + 8);
      LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
        const __m256 qd = _mm256_broadcast_ss(q[r] + d);
        s[r][0] = _mm256_fmadd_ps(qd, k0, s[r][0]);
        s[r][1] = _mm256_fmadd_ps(qd, k1, s[r][1]);
      }
    }
    LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(scores + r * pitch + tile * kTile, _mm256_mul_ps(s[r][0], scale));
      _mm256_storeu_ps(scores + r * pitch + tile * kTile + 8, _mm256_mul_ps(s[r][1], scale));
    }
  }
  for (int r = 0; r < R; ++r) softmax_prefix_f32(scores + r * pitch, visible[r], num_tiles * kTile);
  // P V, 16 columns at a time over every key the block sees (a row's hidden keys add 0 * V)
  T* out[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = first_row + r, token = row / group;
    out[r] = row < num_rows ? pb.out + (token * pb.num_heads + kv_head * group + row % group) * D : nullptr;
  }
  for (int column = 0; column < D; column += 16) {
    __m256 acc[R][2];
    LLMSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* values = packed_values + column;
    for (int64_t j = 0; j < num_keys; ++j) {
      const __m256 v0 = _mm256_loadu_ps(values + j * D), v1 = _mm256_loadu_ps(values + j * D + 8);
      LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_broadcast_ss(scores + r * pitch + j);
        acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      if (out[r] == nullptr) break;
      store8(out[r] + column, acc[r][0]);
      store8(out[r] + column + 8, acc[r][1]);
    }
  }
}

template <int D, typename T>
void run(const PrefillProblem<T>& pb) {
  const int64_t tile_floats = static_cast<int64_t>(kTile) * D;
  const int64_t head_floats = pb.num_tiles * tile_floats;
  static thread_local std::vector<float> keys_buffer, values_buffer;  // grown once, reused per layer
  const size_t size = static_cast<size_t>(pb.num_kv_heads * head_floats);
  if (keys_buffer.size() < size) keys_buffer.resize(size), values_buffer.resize(size);
  float* packed_keys = keys_buffer.data();
  float* packed_values = values_buffer.data();
  const int64_t pack_items = pb.num_kv_heads * pb.num_tiles;
  const int64_t row_blocks = (pb.num_queries * pb.group() + R - 1) / R;
  const int64_t items = pb.num_kv_heads * row_blocks;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
  const int64_t pitch = pb.num_tiles * kTile;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < pack_items; ++item) {
      const int64_t kv_head = item / pb.num_tiles, tile = item % pb.num_tiles;
      pack_tile<D>(pb, kv_head, tile, packed_keys + kv_head * head_floats + tile * tile_floats,
                   packed_values + kv_head * head_floats + tile * tile_floats);
    }
    static thread_local std::vector<float> scores;
    if (scores.size() < static_cast<size_t>(R * pitch)) scores.resize(R * pitch);
    // Later rows see more keys: deal out the costliest blocks first, one at a time.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t block = row_blocks - 1 - item / pb.num_kv_heads, kv_head = item % pb.num_kv_heads;
      attend_rows<D>(pb, kv_head, block * R, packed_keys + kv_head * head_floats,
                     packed_values + kv_head * head_floats, scores.data(), pitch);
    }
  }
}

}  // namespace

bool prefill_attention_fma_supported() { return true; }

namespace {
template <typename T>
void run_problem(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const int64_t* slots, int64_t context, double scale, at::Tensor& out) {
  const auto pb = prefill_problem<T>(query, key_cache, value_cache, slots, context, out, kTile, scale);
  if (query.size(2) == 64) run<64>(pb);
  else run<128>(pb);
}
}  // namespace

void prefill_attention_fma(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const int64_t* slots, int64_t context, double scale,
                           at::Tensor& out) {
  if (query.scalar_type() == at::kBFloat16) {
    run_problem<c10::BFloat16>(query, key_cache, value_cache, slots, context, scale, out);
  } else {
    run_problem<float>(query, key_cache, value_cache, slots, context, scale, out);
  }
}

#else

bool prefill_attention_fma_supported() { return false; }

void prefill_attention_fma(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int64_t*, int64_t,
                           double, at::Tensor&) {
  TORCH_CHECK(false, "prefill_attention in float32 needs a CPU with AVX2 and FMA");
}

#endif
