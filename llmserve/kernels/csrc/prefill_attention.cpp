// Causal attention of one long prompt span over its paged context (bfloat16, AVX-512 BF16): the
// compute-bound half of a prefill, which PyTorch's CPU flash attention runs far below the matmul rate.
//
// The span's queries are the last `num_queries` of `context` positions; position j's K/V row is at
// slot context_slots[j] of the pool, read in place. Blocked in the flash-attention way: keys in tiles of
// 32, query rows (token, head of the KV group) in blocks of R that keep their output accumulators in
// registers for the whole context, with an online softmax (running max and sum) and tiles past a
// block's last position skipped. Both products are bf16 pair dot products (vdpbf16ps: exact products,
// float32 sums), so K and V are first repacked once per call into pair-interleaved tiles:
//   keys   [tile][D/2 pairs][32 keys] (the pair p of each key, so one register holds one pair of 16 keys)
//   values [tile][16 key pairs][D][2] (values of keys 2m and 2m+1 side by side for each of D columns)
// and the probabilities are rounded to bf16 before the second product, as PyTorch's flash kernel does.
// Where the CPU has AMX (and the kernel lets the process use its tile registers), the same tiles feed
// AMX's tile products instead: blocks of 16 query rows, scores and the output accumulators in tile
// registers' shape (16 x 16 floats) kept in L1, the online softmax between the two products in AVX-512
// as before. Same packed layouts, same bf16 products with float32 sums (in another order).
// The entry point at the end checks a call for both dtypes and hands float32, and bf16 on CPUs without
// AVX-512 BF16, to prefill_attention_fma.cpp.
#include "aten.h"
#include <omp.h>

#include "kernels.h"
#include "prefill_problem.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_pairs.h"
#include "vector_math.h"

#include "amx.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LLMSERVE_PREFILL_FAST_PATH 1
#ifdef LLMSERVE_AMX
#define LLMSERVE_PREFILL_AMX 1
#endif
#endif

#ifdef LLMSERVE_PREFILL_FAST_PATH
namespace {

constexpr int kTile = 32;  // keys per tile: two registers of 16 float scores per query row

using Problem = PrefillProblem<uint16_t>;

// Packs tile `tile` of KV head `kv_head`: keys as [D/2][32] pairs, values as [16][D][2]; keys past the
// context are zero (their scores are masked; zero values keep 0 * garbage out of the sums).
template <int D>
void pack_tile(const Problem& pb, int64_t kv_head, int64_t tile, uint32_t* keys, uint16_t* values) {
  const int64_t first = tile * kTile, count = std::min<int64_t>(kTile, pb.context - first);
  const uint16_t* key_rows[kTile];
  const uint16_t* value_rows[kTile];
  for (int j = 0; j < kTile; ++j) {
    const int64_t offset = j < count ? pb.slots[first + j] * pb.slot_stride + kv_head * D : -1;
    key_rows[j] = offset >= 0 ? pb.key_cache + offset : nullptr;
    value_rows[j] = offset >= 0 ? pb.value_cache + offset : nullptr;
  }
  for (int j = 0; j < kTile; ++j) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(key_rows[j]);
    for (int p = 0; p < D / 2; ++p) keys[p * kTile + j] = row != nullptr ? row[p] : 0u;
  }
  for (int m = 0; m < kTile / 2; ++m) {  // key pair m: (V[2m][col], V[2m+1][col]) for every column
    __m512i pairs[D / 16];
    interleave_rows<D>(value_rows[2 * m] != nullptr ? value_rows[2 * m] : kZeroRow,
                       value_rows[2 * m + 1] != nullptr ? value_rows[2 * m + 1] : kZeroRow, pairs);
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_si512(values + (m * D + 16 * c) * 2, pairs[c]);
  }
}

// Which of a tile's 32 keys (two masks of 16) a query row sees: those at most `last` past its first.
inline void visible_keys(int64_t last, __mmask16& first_half, __mmask16& second_half) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i limit = _mm512_set1_epi32(static_cast<int>(last));
  first_half = _mm512_cmple_epi32_mask(lane, limit);
  second_half = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), limit);
}

// Query rows [first_row, first_row + R) of KV head `kv_head` (row = token * group + head in group;
// rows past the span repeat its last row and are not stored) against every tile they can see.
template <int D, int R>
void attend_rows(const Problem& pb, int64_t kv_head, int64_t first_row, const uint32_t* packed_keys,
                 const uint16_t* packed_values) {
  constexpr int P = D / 2;   // bf16 pairs per row
  constexpr int V = D / 16;  // float registers per output row
  const int64_t group = pb.group(), num_rows = pb.num_queries * group;
  const uint32_t* q[R];
  int64_t position[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = std::min(first_row + r, num_rows - 1), token = row / group;
    q[r] = reinterpret_cast<const uint32_t*>(pb.query + token * pb.query_stride + (kv_head * group + row % group) * D);
    position[r] = pb.first_position() + token;
  }
  const int64_t last_position = position[R - 1], first_position = position[0];
  __m512 acc[R][V];
  __m512 running_sum[R];
  float running_max[R];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
    running_sum[r] = _mm512_setzero_ps();
    running_max[r] = -std::numeric_limits<float>::infinity();
  }
  const __m512 scale = _mm512_set1_ps(pb.scale);
  const int64_t end_tile = last_position / kTile + 1;
  const int64_t tile_words = static_cast<int64_t>(kTile) * D / 2;  // uint32 per packed tile
  for (int64_t tile = 0; tile < end_tile; ++tile) {
    const uint32_t* keys = packed_keys + tile * tile_words;
    const uint16_t* values = packed_values + tile * tile_words * 2;
    // scores: R rows x 32 keys
    __m512 s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + p * kTile);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + p * kTile + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][p]));
        s[r][0] = _mm512_dpbf16_ps(s[r][0], qp, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], qp, k1);
      }
    }
    const int64_t first_key = tile * kTile;
    const bool needs_mask = first_key + kTile - 1 > first_position;
    alignas(64) uint32_t probabilities[R][kTile / 2];  // bf16 pairs of each row's 32 probabilities
    for (int r = 0; r < R; ++r) {
      __mmask16 visible0 = 0xFFFF, visible1 = 0xFFFF;
      if (needs_mask) visible_keys(position[r] - first_key, visible0, visible1);
      const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512 s0 = _mm512_mask_mul_ps(minus_inf, visible0, s[r][0], scale);
      const __m512 s1 = _mm512_mask_mul_ps(minus_inf, visible1, s[r][1], scale);
      const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      const float new_max = std::max(running_max[r], tile_max);
      if (new_max > running_max[r]) {  // rescale what was summed so far to the new maximum
        const __m512 correction = exp512(_mm512_set1_ps(running_max[r] - new_max));
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], correction);
        running_sum[r] = _mm512_mul_ps(running_sum[r], correction);
        running_max[r] = new_max;
      }
      const __m512 m = _mm512_set1_ps(new_max);
      // Hidden keys get exactly 0 (exp512 of -inf would be tiny, not zero).
      const __m512 p0 = _mm512_maskz_mov_ps(visible0, exp512(_mm512_sub_ps(s0, m)));
      const __m512 p1 = _mm512_maskz_mov_ps(visible1, exp512(_mm512_sub_ps(s1, m)));
      running_sum[r] = _mm512_add_ps(running_sum[r], _mm512_add_ps(p0, p1));
      _mm512_store_si512(probabilities[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    for (int m = 0; m < kTile / 2; ++m) {  // acc += P V, one key pair at a time
      __m512bh v[V];
      for (int c = 0; c < V; ++c) v[c] = (__m512bh)_mm512_loadu_si512(values + (m * D + 16 * c) * 2);
      for (int r = 0; r < R; ++r) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(probabilities[r][m]));
        for (int c = 0; c < V; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, v[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = first_row + r;
    if (row >= num_rows) break;
    const int64_t token = row / group;
    uint16_t* o = pb.out + (token * pb.num_heads + kv_head * group + row % group) * D;
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(running_sum[r]));
    for (int c = 0; c < V; ++c) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c), (__m256i)rounded);
    }
  }
}

#ifdef LLMSERVE_PREFILL_AMX
constexpr int kAmxRows = 16;

// A row's running maximum is raised only when a score passes it by more than this (natural log units):
// probabilities relative to a slightly stale maximum stay below e^8 (no overflow in float32 sums, and
// bf16 rounds them to the same relative precision), and the output rarely needs rescaling after the
// first tiles, so it can stay in tile registers.
constexpr float kRescaleMargin = 8.0f;

// The four output tiles of attend_rows_amx at D = 64 (tmm4-7), to and from its accumulator rows in L1.
inline void store_output_tiles(float* acc) {
  _tile_stored(4, acc, 64 * 4);
  _tile_stored(5, acc + 16, 64 * 4);
  _tile_stored(6, acc + 32, 64 * 4);
  _tile_stored(7, acc + 48, 64 * 4);
}

inline void load_output_tiles(const float* acc) {
  _tile_loadd(4, acc, 64 * 4);
  _tile_loadd(5, acc + 16, 64 * 4);
  _tile_loadd(6, acc + 32, 64 * 4);
  _tile_loadd(7, acc + 48, 64 * 4);
}

// attend_rows on AMX: 16 query rows (copied, zero past the span) against every tile they can see. Per key
// tile: scores S = Q K^T into two 16 x 16 float tiles (tmm0, tmm1; tmm2 = Q's 32-column slices, tmm3 =
// the keys), the online softmax on them in AVX-512, then O += P V per 16 output columns (tmm2 = P,
// tmm3 = V). At D = 64 the four O tiles stay in tmm4-7 and go to L1 only when some row's maximum rises;
// at D = 128 (eight O tiles, more than there are registers) O lives in L1 and tmm4 visits it.
template <int D>
void attend_rows_amx(const Problem& pb, int64_t kv_head, int64_t first_row, const uint32_t* packed_keys,
                     const uint16_t* packed_values) {
  constexpr int R = kAmxRows;
  constexpr bool kResident = D == 64;
  const int64_t group = pb.group(), num_rows = pb.num_queries * group;
  alignas(64) uint16_t q[R][D];
  alignas(64) float scores[R][kTile];
  alignas(64) uint16_t probabilities[R][kTile];
  alignas(64) float acc[R][D];
  alignas(64) float sums[R][16];  // each row's running sum, 16 lanes apart (added up at the end)
  int64_t position[R];
  float running_max[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = std::min(first_row + r, num_rows - 1), token = row / group;
    std::memcpy(q[r], pb.query + token * pb.query_stride + (kv_head * group + row % group) * D, D * 2);
    position[r] = pb.first_position() + token;
    running_max[r] = -std::numeric_limits<float>::infinity();
  }
  std::memset(acc, 0, sizeof(acc));
  std::memset(sums, 0, sizeof(sums));
  if constexpr (kResident) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
  }
  const int64_t first_position = position[0], end_tile = position[R - 1] / kTile + 1;
  const int64_t tile_words = static_cast<int64_t>(kTile) * D / 2;
  const __m512 scale = _mm512_set1_ps(pb.scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t tile = 0; tile < end_tile; ++tile) {
    const uint32_t* keys = packed_keys + tile * tile_words;
    const uint16_t* values = packed_values + tile * tile_words * 2;
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < D / 32; ++c) {  // 16 pairs of dimensions per product
      _tile_loadd(2, q[0] + 32 * c, D * 2);
      _tile_loadd(3, keys + 16 * c * kTile, kTile * 4);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(3, keys + 16 * c * kTile + 16, kTile * 4);
      _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, scores[0], kTile * 4);
    _tile_stored(1, scores[0] + 16, kTile * 4);
    const int64_t first_key = tile * kTile;
    const bool needs_mask = first_key + kTile - 1 > first_position;
    float correction[R];
    bool rescale = false;
    for (int r = 0; r < R; ++r) {
      __mmask16 visible0 = 0xFFFF, visible1 = 0xFFFF;
      if (needs_mask) visible_keys(position[r] - first_key, visible0, visible1);
      const __m512 s0 = _mm512_mask_mul_ps(minus_inf, visible0, _mm512_load_ps(scores[r]), scale);
      const __m512 s1 = _mm512_mask_mul_ps(minus_inf, visible1, _mm512_load_ps(scores[r] + 16), scale);
      const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      correction[r] = 1.0f;
      if (tile_max > running_max[r] + kRescaleMargin) {  // what was summed so far, to the new maximum
        correction[r] = vexp(running_max[r] - tile_max);
        running_max[r] = tile_max;
        rescale = true;
      }
      const __m512 m = _mm512_set1_ps(running_max[r]);
      // Hidden keys get exactly 0 (exp512 of -inf would be tiny, not zero).
      const __m512 p0 = _mm512_maskz_mov_ps(visible0, exp512(_mm512_sub_ps(s0, m)));
      const __m512 p1 = _mm512_maskz_mov_ps(visible1, exp512(_mm512_sub_ps(s1, m)));
      const __m512 sum = _mm512_mul_ps(_mm512_load_ps(sums[r]), _mm512_set1_ps(correction[r]));
      _mm512_store_ps(sums[r], _mm512_add_ps(sum, _mm512_add_ps(p0, p1)));
      _mm512_store_si512(probabilities[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    if (rescale) {
      if constexpr (kResident) {
        store_output_tiles(acc[0]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 factor = _mm512_set1_ps(correction[r]);
        for (int v = 0; v < D / 16; ++v)
          _mm512_store_ps(acc[r] + 16 * v, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * v), factor));
      }
      if constexpr (kResident) {
        load_output_tiles(acc[0]);
      }
    }
    _tile_loadd(2, probabilities[0], kTile * 2);
    if constexpr (kResident) {  // 16 key pairs x 16 columns of V per product
      _tile_loadd(3, values, D * 4);
      _tile_dpbf16ps(4, 2, 3);
      _tile_loadd(3, values + 32, D * 4);
      _tile_dpbf16ps(5, 2, 3);
      _tile_loadd(3, values + 64, D * 4);
      _tile_dpbf16ps(6, 2, 3);
      _tile_loadd(3, values + 96, D * 4);
      _tile_dpbf16ps(7, 2, 3);
    } else {
      for (int c = 0; c < D / 16; ++c) {
        _tile_loadd(4, acc[0] + 16 * c, D * 4);
        _tile_loadd(3, values + 32 * c, D * 4);
        _tile_dpbf16ps(4, 2, 3);
        _tile_stored(4, acc[0] + 16 * c, D * 4);
      }
    }
  }
  if constexpr (kResident) store_output_tiles(acc[0]);
  for (int r = 0; r < R; ++r) {
    const int64_t row = first_row + r;
    if (row >= num_rows) break;
    const int64_t token = row / group;
    uint16_t* o = pb.out + (token * pb.num_heads + kv_head * group + row % group) * D;
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(sums[r])));
    for (int c = 0; c < D / 16; ++c) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c), (__m256i)rounded);
    }
  }
}
#endif  // LLMSERVE_PREFILL_AMX

template <int D>
void run(const Problem& pb, bool use_amx) {
#ifdef LLMSERVE_PREFILL_AMX
  use_amx = use_amx && amx_permitted();
  const int R = use_amx ? kAmxRows : (D <= 64 ? 4 : 2);
#else
  use_amx = false;
  constexpr int R = D <= 64 ? 4 : 2;  // R * D / 16 accumulators stay in registers
#endif
  const int64_t tile_words = static_cast<int64_t>(kTile) * D / 2;
  const int64_t head_words = pb.num_tiles * tile_words;
  static thread_local std::vector<uint32_t> keys_buffer, values_buffer;  // grown once, reused per layer
  const size_t size = static_cast<size_t>(pb.num_kv_heads * head_words);
  if (keys_buffer.size() < size) keys_buffer.resize(size), values_buffer.resize(size);
  uint32_t* packed_keys = keys_buffer.data();
  uint16_t* packed_values = reinterpret_cast<uint16_t*>(values_buffer.data());
  const int64_t pack_items = pb.num_kv_heads * pb.num_tiles;
  const int64_t row_blocks = (pb.num_queries * pb.group() + R - 1) / R;
  const int64_t items = pb.num_kv_heads * row_blocks;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < pack_items; ++item) {
      const int64_t kv_head = item / pb.num_tiles, tile = item % pb.num_tiles;
      pack_tile<D>(pb, kv_head, tile, packed_keys + kv_head * head_words + tile * tile_words,
                   packed_values + (kv_head * head_words + tile * tile_words) * 2);
    }
    // Later rows see more keys: deal out the costliest blocks first, one at a time.
#ifdef LLMSERVE_PREFILL_AMX
    if (use_amx) {
      const TileConfig config;
      _tile_loadconfig(&config);
    }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t block = row_blocks - 1 - item / pb.num_kv_heads, kv_head = item % pb.num_kv_heads;
      const uint32_t* keys = packed_keys + kv_head * head_words;
      const uint16_t* values = packed_values + kv_head * head_words * 2;
#ifdef LLMSERVE_PREFILL_AMX
      if (use_amx) {
        attend_rows_amx<D>(pb, kv_head, block * R, keys, values);
        continue;
      }
#endif
      attend_rows<D, D <= 64 ? 4 : 2>(pb, kv_head, block * R, keys, values);
    }
#ifdef LLMSERVE_PREFILL_AMX
    if (use_amx) _tile_release();
#endif
  }
}

}  // namespace
#endif  // LLMSERVE_PREFILL_FAST_PATH

bool prefill_attention_amx_supported() {
#ifdef LLMSERVE_PREFILL_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// Which kernel prefill_attention runs for this dtype here: "amx" or "avx512_bf16" (bf16 products), "fma"
// (float32 arithmetic), or "" where it takes no such input.
std::string prefill_attention_path(at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kBFloat16) return "";
#ifdef LLMSERVE_PREFILL_FAST_PATH
  if (dtype == at::kBFloat16) return prefill_attention_amx_supported() ? "amx" : "avx512_bf16";
#endif
  return prefill_attention_fma_supported() ? "fma" : "";
}

bool prefill_attention_supported(at::ScalarType dtype) { return !prefill_attention_path(dtype).empty(); }

// query [Q, H, D] bf16 or float32 (rows of a token contiguous; any token stride); key_cache, value_cache
// [slots, KVH, D] of the query's dtype, contiguous; context_slots [C] int64 with C >= Q: the slots of
// positions 0..C-1, the queries being positions C-Q..C-1. Returns the causal attention output [Q, H, D].
// float32, and bf16 without AVX-512 BF16, go to prefill_attention_fma.cpp.
at::Tensor prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                             at::Tensor context_slots, double scale, bool use_amx) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "prefill_attention takes queries and caches of one dtype");
  TORCH_CHECK(prefill_attention_supported(dtype),
              "prefill_attention takes bfloat16 or float32 (on a CPU with AVX2 and FMA)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [tokens, heads, head_dim] with each token's heads contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must be contiguous and of one shape");
  TORCH_CHECK(context_slots.scalar_type() == at::kLong && context_slots.dim() == 1,
              "context_slots must be a 1-D int64 tensor");
  const int64_t num_queries = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), context = context_slots.size(0);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "prefill_attention supports head_dim 64 and 128");
  TORCH_CHECK(key_cache.size(2) == head_dim, "the cache rows must have head_dim values");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(context >= num_queries, "the context must include the queries' own positions");
  auto slots = context_slots.contiguous();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0);
  for (int64_t j = 0; j < context; ++j)
    TORCH_CHECK(slot_data[j] >= 0 && slot_data[j] < num_slots, "context slot out of range");
  auto out = at::empty({num_queries, num_heads, head_dim}, query.options());
  if (num_queries == 0) return out;
#ifdef LLMSERVE_PREFILL_FAST_PATH
  if (dtype == at::kFloat) {
    prefill_attention_fma(query, key_cache, value_cache, slot_data, context, scale, out);
    return out;
  }
  const Problem pb = prefill_problem<uint16_t>(query, key_cache, value_cache, slot_data, context, out, kTile, scale);
  if (head_dim == 64) run<64>(pb, use_amx);
  else run<128>(pb, use_amx);
#else
  prefill_attention_fma(query, key_cache, value_cache, slot_data, context, scale, out);
#endif
  return out;
}
