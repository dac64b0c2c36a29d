// Attention over the paged KV cache, read in place (no gathered copy of the context), for sequences
// with few query tokens this step: decodes (one query) and short spans such as a speculative
// verification (k drafts + 1). Long prompt chunks are compute-bound and go to prefill_attention.cpp.
//
// One work item per (sequence, KV head), handed out dynamically (contexts differ in length): every
// query row that shares the KV head (the G = num_heads / num_kv_heads heads of the group, times the
// span's query tokens) is processed together, so each K and V row is read from memory once.
// Two passes: scores for the whole live context into a per-thread buffer, softmax per query row
// (causal: query i of a span sees positions up to its own), then the probability-weighted sum of V.
//
// bfloat16 caches with head_dim 64 or 128 on AVX-512 BF16 take a fast path that walks the context in
// chunks of up to 16 rows of one block: q.k as bf16 pair dot products (vdpbf16ps, exact products,
// float32 sums) for 16 keys, whose 16 partial-sum vectors one transpose-and-add tree reduces; softmax
// numerators rounded to bf16 (as PyTorch's flash kernel does) so that P V also runs on vdpbf16ps, two
// keys per instruction, into accumulators held in registers; one division per row at the end. Each
// row's arithmetic is the same whatever else is in its work item, so a verification span's rows equal
// the decodes they stand for, bit for bit. With fewer (sequence, KV head) pairs than the threads can
// share evenly (batch 1: 3 KV heads, 2 threads), some pairs are split by query rows.
// float32 and bf16 queries with head_dim 64 or 128 over every other cache (float32, bf16 where AVX-512 BF16
// is missing, int8 and fp8 rows of kv_format.py) take the FMA path on AVX2, FMA and F16C, float32
// arithmetic throughout: K and V rows converted 8 lanes at a time inside the loops (bf16 widened, int8
// codes converted, fp8 codes rebuilt as float16 for F16C), an 8-bit row's scale applied once per key to
// its dot product and to its P V weight rather than per element; q.k for 8 keys at a time as FMA partial
// sums reduced by one transpose-and-add tree, softmax 8 lanes at a time, and P V with the accumulators in
// registers, three query rows at a time so that each K and V vector converted serves three rows; bf16
// queries widened once and outputs rounded once. It too splits pairs by query rows at batch 1, and a
// row's arithmetic does not depend on the other rows.
// Everything else (float16, other head sizes) converts each K/V row to float32 and uses plain loops the
// compiler vectorizes. paged_attention_path names the path a combination takes. With a sliding window
// only the sink positions and the window are visited: freed blocks are never touched.
#include "aten.h"
#include <c10/util/Float8_e4m3fn.h>
#include <omp.h>

#include "bf16_pairs.h"
#include "kernels.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LLMSERVE_BF16_FAST_PATH 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMSERVE_FMA_PATH 1
#endif

namespace {

// ---- rows of the cache, converted to float ----------------------------------------------------------

inline void load_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void load_row(const double* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {  // bf16 is the top half of a float32
    const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(float));
    dst[i] = value;
  }
}

// Readers of one cached (slot, kv head) row into floats. Plain rows are head_dim values of the
// cache's dtype; 8-bit rows (kv_format.py) are head_dim codes followed by the row's float16 scale.
// The FMA path reads them 8 lanes at a time instead: lanes8(p) converts the 8 elements at p, and a scaled
// row's lanes are then multiplied by factor(row, n) (in the q.k sums and P V weights, not per element).
template <typename T>
struct PlainRows {
  using elem_t = T;
  static constexpr int64_t extra = 0;
  static constexpr bool scaled = false;
  static void load(const T* src, float* dst, int64_t n) { load_row(src, dst, n); }
#ifdef LLMSERVE_FMA_PATH
  static __m256 lanes8(const T* p) { return load8(p); }  // float32 or bf16 only
  static float factor(const T*, int64_t) { return 1.0f; }
#endif
};

inline float read_scale(const uint8_t* src, int64_t n) {
  uint16_t bits;
  std::memcpy(&bits, src + n, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct Int8Rows {
  using elem_t = uint8_t;
  static constexpr int64_t extra = 2;
  static constexpr bool scaled = true;  // codes times the row's scale
  static void load(const uint8_t* src, float* dst, int64_t n) {
    const float scale = read_scale(src, n);
    const int8_t* codes = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(codes[i]) * scale;
  }
#ifdef LLMSERVE_FMA_PATH
  static __m256 lanes8(const uint8_t* p) { return load8(reinterpret_cast<const int8_t*>(p)); }
  static float factor(const uint8_t* row, int64_t n) { return read_scale(row, n); }
#endif
};

struct Fp8Rows {
  using elem_t = uint8_t;
  static constexpr int64_t extra = 2;
  static constexpr bool scaled = true;  // codes times the row's scale
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
#ifdef LLMSERVE_FMA_PATH
  static __m256 lanes8(const uint8_t* p) { return load8_e4m3_over_256(p); }
  static float factor(const uint8_t* row, int64_t n) { return read_scale(row, n) * 256.0f; }  // exact
#endif
};

// ---- small vector helpers -----------------------------------------------------------------------------

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// ---- which positions a sequence reads, and which of them each query sees ---------------------------

// The live context of one sequence this step: positions [0, sink_end) and [window_begin, length),
// stored in that order at score indices 0..context-1. Without a window it is all of [0, length).
struct Span {
  int64_t length;       // context length, this step's query tokens included
  int64_t num_queries;  // the last num_queries positions are this step's queries
  int64_t window;
  int64_t sink_end;
  int64_t window_begin;
  int64_t context;

  Span(int64_t length, int64_t num_queries, int64_t sinks, int64_t window)
      : length(length), num_queries(num_queries), window(window) {
    sink_end = window > 0 ? std::min(sinks, length) : length;
    window_begin = window > 0 ? std::max(sink_end, length - num_queries - window + 1) : length;
    context = sink_end + length - window_begin;
  }

  // Query i sees score indices [0, a) and [b, c): the sinks up to its own position, and the window
  // positions p - window < pos <= p (everything up to p when there is no window).
  void visible(int64_t query, int64_t& a, int64_t& b, int64_t& c) const {
    const int64_t p = length - num_queries + query;
    a = std::min(sink_end, p + 1);
    const int64_t low = window > 0 ? std::max(window_begin, p - window + 1) : window_begin;
    b = sink_end + low - window_begin;
    c = std::max(b, sink_end + p + 1 - window_begin);
  }
};

// Asks for the `count` rows (of row_bytes each, slot_stride elements apart) to be brought into the
// cache. Blocks sit at scattered places in the pool, so the hardware prefetcher cannot see the next
// one coming; without this every block starts with a stall on memory.
template <typename elem_t>
inline void prefetch_rows(const elem_t* rows, int64_t count, int64_t slot_stride, int64_t row_bytes) {
  for (int64_t t = 0; t < count; ++t) {
    const char* row = reinterpret_cast<const char*>(rows + t * slot_stride);
    for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(row + line, 0, 3);
  }
}

// Calls visit(row, index) for each live position in order, walking the block table one block at a
// time (prefetching the next block's rows first); `index` is the position's place in the scores buffer.
template <typename elem_t, typename Visit>
inline void walk_context(const Span& span, const elem_t* cache, const int64_t* table, int64_t block_size,
                         int64_t slot_stride, int64_t row_bytes, Visit&& visit) {
  auto rows_at = [&](int64_t pos) { return cache + (table[pos / block_size] * block_size + pos % block_size) * slot_stride; };
  auto walk = [&](int64_t begin, int64_t end, int64_t first_index) {
    if (begin < end) prefetch_rows(rows_at(begin), std::min(block_size - begin % block_size, end - begin), slot_stride, row_bytes);
    for (int64_t pos = begin; pos < end;) {
      const int64_t offset = pos % block_size, count = std::min(block_size - offset, end - pos);
      const int64_t next = pos + count, next_count = std::min(block_size, end - next);
      const elem_t* rows = rows_at(pos);
      const elem_t* next_rows = next < end ? rows_at(next) : nullptr;
      const int64_t index = first_index + pos - begin;
      for (int64_t t = 0; t < count; ++t) {  // row t of this block, and a prefetch of the next block's row t
        if (next_rows != nullptr && t < next_count) prefetch_rows(next_rows + t * slot_stride, 1, slot_stride, row_bytes);
        visit(rows + t * slot_stride, index + t);
      }
      if (next_rows != nullptr && next_count > count)  // a short first block: the rest of the next one now
        prefetch_rows(next_rows + count * slot_stride, next_count - count, slot_stride, row_bytes);
      pos = next;
    }
  };
  walk(0, span.sink_end, 0);
  walk(span.window_begin, span.length, span.sink_end);
}

// Softmax of one row of query `query` over what it sees, in place; positions it must not see become exactly 0.
inline void softmax_row(const Span& span, int64_t query, float* s) {
  int64_t a, b, c;
  span.visible(query, a, b, c);
  float max_score = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_score)
  for (int64_t i = 0; i < a; ++i) max_score = std::max(max_score, s[i]);
#pragma omp simd reduction(max : max_score)
  for (int64_t i = b; i < c; ++i) max_score = std::max(max_score, s[i]);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < a; ++i) {
    s[i] = vexp(s[i] - max_score);
    total += s[i];
  }
#pragma omp simd reduction(+ : total)
  for (int64_t i = b; i < c; ++i) {
    s[i] = vexp(s[i] - max_score);
    total += s[i];
  }
  const float inverse = 1.0f / total;
#pragma omp simd
  for (int64_t i = 0; i < a; ++i) s[i] *= inverse;
#pragma omp simd
  for (int64_t i = b; i < c; ++i) s[i] *= inverse;
  std::fill(s + a, s + b, 0.0f);
  std::fill(s + c, s + span.context, 0.0f);
}

// A token tree's verify span (speculative decoding): query i of the span sees the span's own token j < i
// only where bit j of its mask is set (its ancestors; itself always), the context before the span as
// usual. `value` goes where it must not see: -inf before the softmax; then exact 0 in the probabilities
// (the softmax's clamped exponent leaves a term of about 1e-38 there, which its total, at least 1, absorbs).
template <typename T>
inline void hide_tree_positions(const Span& span, int64_t mask, int64_t query, T* s, T value) {
  // the span's token 0 (with a window too: the window begins at or before the span's first query)
  const int64_t first = span.context - span.num_queries;
  for (int64_t j = 0; j < query; ++j)
    if (!((mask >> j) & 1)) s[first + j] = value;
}

// Softmax of every query row of a span (row (query, g) at (query * group + g) * context); `tree`: the
// span's queries' masks (hide_tree_positions), or nullptr.
inline void softmax_rows(const Span& span, int64_t group, float* scores, const int64_t* tree) {
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  for (int64_t query = 0; query < span.num_queries; ++query)
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + (query * group + g) * span.context;
      if (tree != nullptr) hide_tree_positions(span, tree[query], query, s, kHidden);
      softmax_row(span, query, s);
      if (tree != nullptr) hide_tree_positions(span, tree[query], query, s, 0.0f);
    }
}

// Everything one work item needs to know about the batch.
template <typename scalar_t, typename elem_t>
struct Batch {
  const scalar_t* query;  // [num_tokens, num_heads, head_dim]
  const elem_t* key_cache;
  const elem_t* value_cache;
  const int64_t* block_tables;  // [num_seqs, max_blocks]
  const int64_t* seq_lens;      // [num_seqs]
  const int64_t* query_starts;  // [num_seqs + 1]
  scalar_t* out;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, row_len, sinks, window;
  float scale;
  const int64_t* tree_masks;  // [num_tokens] token trees' masks (hide_tree_positions), or nullptr

  int64_t group() const { return num_heads / num_kv_heads; }
  // Sequence seq's queries' tree masks, or nullptr.
  const int64_t* tree(int64_t seq) const { return tree_masks ? tree_masks + query_starts[seq] : nullptr; }
  int64_t slot_stride() const { return num_kv_heads * row_len; }
  // Query row r = (token i of the span, head g of the group), as a pointer into query / out.
  int64_t head_offset(int64_t seq, int64_t kv_head, int64_t row) const {
    const int64_t token = query_starts[seq] + row / group(), head = kv_head * group() + row % group();
    return (token * num_heads + head) * head_dim;
  }
};

// A run of up to 16 consecutive live positions inside one block: its first row's element offset in
// the cache (K and V share the slot layout), its first score index, and its length.
struct Chunk {
  int64_t offset;
  int64_t index;
  int64_t count;
};

// Per-thread buffers, grown as needed and reused across work items.
struct Scratch {
  std::vector<float> scores, queries, acc, row, totals;
  std::vector<uint16_t> probs;  // bf16 softmax numerators (fast path)
  std::vector<const uint16_t*> query_rows;  // bf16 fast path
  std::vector<const float*> query_rows_f32;  // FMA path: float32 queries, then score rows
  std::vector<float*> out_rows_f32;          // FMA path: float32 outputs
  std::vector<Chunk> chunks;
  template <typename T>
  T* grow(std::vector<T>& buffer, int64_t size) {
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    return buffer.data();
  }
};

// ---- the portable kernel: any dtype, any head size ---------------------------------------------------

template <typename scalar_t, typename Rows>
void attend_portable(const Batch<scalar_t, typename Rows::elem_t>& batch, int64_t seq, int64_t kv_head,
                     Scratch& scratch) {
  using elem_t = typename Rows::elem_t;
  const int64_t head_dim = batch.head_dim, group = batch.group();
  const int64_t num_queries = batch.query_starts[seq + 1] - batch.query_starts[seq];
  const Span span(batch.seq_lens[seq], num_queries, batch.sinks, batch.window);
  const int64_t rows = num_queries * group, context = span.context;
  const int64_t* table = batch.block_tables + seq * batch.max_blocks;
  float* q = scratch.grow(scratch.queries, rows * head_dim);
  float* scores = scratch.grow(scratch.scores, rows * context);
  float* acc = scratch.grow(scratch.acc, rows * head_dim);
  float* row = scratch.grow(scratch.row, head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    load_row(batch.query + batch.head_offset(seq, kv_head, r), q + r * head_dim, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) q[r * head_dim + d] *= batch.scale;
  }
  const int64_t stride = batch.slot_stride();
  const int64_t row_bytes = batch.row_len * static_cast<int64_t>(sizeof(elem_t));
  walk_context(span, batch.key_cache + kv_head * batch.row_len, table, batch.block_size, stride, row_bytes,
               [&](const elem_t* key_row, int64_t index) {
                 Rows::load(key_row, row, head_dim);
                 for (int64_t r = 0; r < rows; ++r) scores[r * context + index] = dot(q + r * head_dim, row, head_dim);
               });
  softmax_rows(span, group, scores, batch.tree(seq));
  std::fill(acc, acc + rows * head_dim, 0.0f);
  walk_context(span, batch.value_cache + kv_head * batch.row_len, table, batch.block_size, stride, row_bytes,
               [&](const elem_t* value_row, int64_t index) {
                 Rows::load(value_row, row, head_dim);
                 for (int64_t r = 0; r < rows; ++r) {
                   const float p = scores[r * context + index];
                   if (p != 0.0f) axpy(p, row, acc + r * head_dim, head_dim);
                 }
               });
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* o = batch.out + batch.head_offset(seq, kv_head, r);
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[r * head_dim + d]);
  }
}

// The live context as chunks, in score-index order (a list, so that the passes over it are plain loops
// whose accumulators the compiler keeps in registers).
inline void list_chunks(const Span& span, const int64_t* table, int64_t block_size, int64_t slot_stride,
                        std::vector<Chunk>& chunks) {
  chunks.clear();
  auto walk = [&](int64_t begin, int64_t end, int64_t first_index) {
    for (int64_t pos = begin; pos < end;) {
      const int64_t next = std::min({pos + 16, (pos / block_size + 1) * block_size, end});
      chunks.push_back({(table[pos / block_size] * block_size + pos % block_size) * slot_stride,
                        first_index + pos - begin, next - pos});
      pos = next;
    }
  };
  walk(0, span.sink_end, 0);
  walk(span.window_begin, span.length, span.sink_end);
}

// How many chunks ahead the passes over the context ask for a chunk's rows: blocks are scattered in
// the pool, so the hardware prefetcher cannot see them coming; a lead of one chunk left the passes
// waiting on memory when K/V come from DRAM, and longer leads than three gained nothing.
constexpr int64_t kPrefetchChunks = 3;

// ---- the FMA path (AVX2, FMA, F16C): float32 arithmetic over any cache row format ---------------------

#ifdef LLMSERVE_FMA_PATH

// q.k for 8 keys (rows `stride` elements apart; a short run repeats its last key) and R query rows at once,
// one vector per row: per key one FMA chain over the row (a multiply, then FMAs in column order) on the
// key's lanes as Rows converts them, then a transpose-and-add tree, lane k = ((x0 + x1) + (x2 + x3)) +
// ((x4 + x5) + (x6 + x7)) of key k's partial sums whatever the other keys and rows hold. Four keys at a
// time keep R x 4 chains in registers, and each key vector converted serves all R rows (their float32
// queries are read from L1 as FMA operands).
template <int D, int R, typename Rows>
inline void dot_8_keys(const float* const* q_rows, const typename Rows::elem_t* keys, int64_t stride, int count,
                       __m256 (&out)[R]) {
  // The query pointers made opaque here, in the loop that calls this: otherwise GCC hoists all R rows'
  // query vectors (8R registers) out of the loop over keys and spills the accumulators around them.
  const float* q[R];
  LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
    q[r] = q_rows[r];
    asm volatile("" : "+r"(q[r]));
  }
  __m256 low[R];
  LLMSERVE_UNROLL for (int half = 0; half < 2; ++half) {
    const typename Rows::elem_t* key[4];
    LLMSERVE_UNROLL for (int j = 0; j < 4; ++j) key[j] = keys + std::min(4 * half + j, count - 1) * stride;
    __m256 acc[R][4];
    LLMSERVE_UNROLL for (int j = 0; j < 4; ++j) {
      const __m256 k = Rows::lanes8(key[j]);
      LLMSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][j] = _mm256_mul_ps(_mm256_loadu_ps(q[r]), k);
    }
    LLMSERVE_UNROLL for (int piece = 1; piece < D / 8; ++piece) {
      LLMSERVE_UNROLL for (int j = 0; j < 4; ++j) {
        const __m256 k = Rows::lanes8(key[j] + 8 * piece);
        LLMSERVE_UNROLL for (int r = 0; r < R; ++r)
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + 8 * piece), k, acc[r][j]);
      }
    }
    LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {  // [keys' partial pairs of the low 128 bits | of the high]
      const __m256 four = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
      if (half == 0) {
        low[r] = four;
      } else {
        out[r] = _mm256_add_ps(_mm256_permute2f128_ps(low[r], four, 0x20), _mm256_permute2f128_ps(low[r], four, 0x31));
      }
    }
  }
}

// What multiplies the dot products of 8 keys (as dot_8_keys picks them): the attention scale, times each
// key row's own factor for a scaled (8-bit) cache. Per key, so a row's scores do not depend on the others.
template <int D, typename Rows>
inline __m256 key_factors(const typename Rows::elem_t* keys, int64_t stride, int count, float scale) {
  if constexpr (!Rows::scaled) {
    return _mm256_set1_ps(scale);
  } else {
    alignas(32) float factors[8];
    for (int k = 0; k < 8; ++k) factors[k] = Rows::factor(keys + std::min(k, count - 1) * stride, D);
    return _mm256_mul_ps(_mm256_load_ps(factors), _mm256_set1_ps(scale));
  }
}

// Adds one chunk's P V to R rows' 32 columns from `column`: R x 4 accumulators in registers, loaded from
// the rows' outputs (zeros at the first chunk) and stored back, each one FMA per position in order (a
// hidden position has p = 0 and adds nothing), so a row's sums are those of one pass over its context.
// A scaled row's factor multiplies its weight (factors[t], one per position of the chunk), not its lanes.
// Chunk by chunk, every row of the item reads a chunk's values from L1 while it is there, instead of
// each row group walking the whole context again from L2.
template <int R, typename Rows>
inline void add_chunk_values(const float* const* p, const typename Rows::elem_t* value_rows, int64_t stride,
                             int64_t count, int64_t index, const float* factors, bool first, float* const* out) {
  __m256 acc[R][4];
  LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
    LLMSERVE_UNROLL for (int j = 0; j < 4; ++j) acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out[r] + 8 * j);
  }
  for (int64_t t = 0; t < count; ++t) {
    __m256 w[R];
    LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
      if constexpr (Rows::scaled) w[r] = _mm256_set1_ps(p[r][index + t] * factors[t]);
      else w[r] = _mm256_broadcast_ss(p[r] + index + t);
    }
    const typename Rows::elem_t* v = value_rows + t * stride;
    LLMSERVE_UNROLL for (int j = 0; j < 4; ++j) {
      const __m256 value = Rows::lanes8(v + 8 * j);
      LLMSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(w[r], value, acc[r][j]);
    }
  }
  LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
    LLMSERVE_UNROLL for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out[r] + 8 * j, acc[r][j]);
  }
}

// softmax_row for the FMA path, 8 lanes at a time over the whole buffer (which has room for whole
// vectors past `context`) with the hidden lanes zeroed: they add exact zeros, so a row's values depend
// only on what it sees, as in a decode of it. Plain loads and stores: AVX2's masked stores are microcoded
// on AMD Zen and took a third of this kernel's time there.
// A row that sees one run [0, a) (no window in reach: every row without a sliding window) takes
// softmax_prefix_f32, which masks only the vector holding a; the same lanes add the same values in the
// same order, so its result is bit-identical to the masked loop's.
inline void softmax_row_f32(const Span& span, int64_t query, float* s) {
  int64_t a, b, c;
  span.visible(query, a, b, c);
  const int64_t context = span.context;
  if (b >= c) {
    softmax_prefix_f32(s, a, context);
    return;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i a_v = _mm256_set1_epi32(static_cast<int>(a)), b_v = _mm256_set1_epi32(static_cast<int>(b));
  const __m256i c_v = _mm256_set1_epi32(static_cast<int>(c));
  auto visible = [&](int64_t i) {  // lanes below `context` that this query sees
    const __m256i index = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(i)));
    const __m256i low = _mm256_cmpgt_epi32(a_v, index);
    const __m256i high = _mm256_andnot_si256(_mm256_cmpgt_epi32(b_v, index), _mm256_cmpgt_epi32(c_v, index));
    return _mm256_castsi256_ps(_mm256_or_si256(low, high));
  };
  __m256 max_vector = minus_inf;
  for (int64_t i = 0; i < context; i += 8)
    max_vector = _mm256_max_ps(max_vector, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(s + i), visible(i)));
  const __m256 row_max = _mm256_set1_ps(horizontal_max8(max_vector));
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < context; i += 8) {
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), row_max)), visible(i));
    total = _mm256_add_ps(total, e);
    _mm256_storeu_ps(s + i, e);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / horizontal_sum8(total));
  for (int64_t i = 0; i < context; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inverse));
}

// Query rows [row_begin, row_end) of (seq, kv_head), any query dtype (float32 or bf16) and any row format
// Rows reads 8 lanes at a time (float32, bf16, int8 or fp8 codes and a scale); row r = (token r / group,
// head r % group of the group). Cache rows are converted inside the q.k and P V loops, never copied.
// Rows go three at a time (a remainder of one or two at the end) through the q.k and P V loops, so each
// K and V vector read from L1/L2 serves three rows: verification spans and GQA groups cost a fraction of a
// pass per row. bf16 queries are widened (exactly) once per work item and bf16 outputs rounded once at the
// end, so a bf16 model gets float32 arithmetic throughout.
template <int D, typename scalar_t, typename Rows>
void attend_fma(const Batch<scalar_t, typename Rows::elem_t>& batch, int64_t seq, int64_t kv_head, int64_t row_begin,
                int64_t row_end, Scratch& scratch) {
  static_assert(D % 32 == 0, "the V pass takes 32 columns at a time");
  using elem_t = typename Rows::elem_t;
  constexpr bool f32 = std::is_same_v<scalar_t, float>;
  const int64_t group = batch.group();
  const int64_t num_queries = batch.query_starts[seq + 1] - batch.query_starts[seq];
  const Span span(batch.seq_lens[seq], num_queries, batch.sinks, batch.window);
  const int64_t rows = row_end - row_begin, context = span.context;
  const int64_t* table = batch.block_tables + seq * batch.max_blocks;
  const int64_t stride = batch.slot_stride();
  const int64_t row_bytes = batch.row_len * static_cast<int64_t>(sizeof(elem_t));
  // Score rows `pitch` apart, with room for a whole vector past the context: stores of 8 dots write the
  // lanes past a chunk's last key too (the next chunk's stores overwrite them).
  const int64_t pitch = (context + 7) / 8 * 8 + 8;
  float* scores = scratch.grow(scratch.scores, rows * pitch);
  // Row r's float32 query, scores and output, found once here rather than by divisions in every chunk:
  // float32 rows where they are, bf16 ones through buffers.
  const float** q_rows = scratch.grow(scratch.query_rows_f32, 2 * rows);
  const float** p_rows = q_rows + rows;
  float** out_rows = scratch.grow(scratch.out_rows_f32, rows);
  float* wide_queries = f32 ? nullptr : scratch.grow(scratch.queries, rows * D);
  float* wide_out = f32 ? nullptr : scratch.grow(scratch.acc, rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t offset = batch.head_offset(seq, kv_head, row_begin + r);
    if constexpr (f32) {
      q_rows[r] = batch.query + offset;
      out_rows[r] = batch.out + offset;
    } else {
      load_row(batch.query + offset, wide_queries + r * D, D);
      q_rows[r] = wide_queries + r * D;
      out_rows[r] = wide_out + r * D;
    }
    p_rows[r] = scores + r * pitch;
  }
  std::vector<Chunk>& chunks = scratch.chunks;
  list_chunks(span, table, batch.block_size, stride, chunks);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  // scores, 8 keys at a time
  const elem_t* keys = batch.key_cache + kv_head * batch.row_len;
  const elem_t* values = batch.value_cache + kv_head * batch.row_len;
  // the K pass asks for each chunk's V rows too: the V pass then starts from the caches, not memory
  for (int64_t i = 0; i < std::min(kPrefetchChunks, num_chunks); ++i) {
    prefetch_rows(keys + chunks[i].offset, chunks[i].count, stride, row_bytes);
    prefetch_rows(values + chunks[i].offset, chunks[i].count, stride, row_bytes);
  }
  for (int64_t i = 0; i < num_chunks; ++i) {
    if (i + kPrefetchChunks < num_chunks) {
      prefetch_rows(keys + chunks[i + kPrefetchChunks].offset, chunks[i + kPrefetchChunks].count, stride, row_bytes);
      prefetch_rows(values + chunks[i + kPrefetchChunks].offset, chunks[i + kPrefetchChunks].count, stride, row_bytes);
    }
    const Chunk chunk = chunks[i];
    for (int64_t first = 0; first < chunk.count; first += 8) {
      const int count = static_cast<int>(std::min<int64_t>(8, chunk.count - first));
      const elem_t* key_rows = keys + chunk.offset + first * stride;
      const __m256 factors = key_factors<D, Rows>(key_rows, stride, count, batch.scale);
      auto store = [&](int64_t r, __m256 dots) {
        _mm256_storeu_ps(scores + r * pitch + chunk.index + first, _mm256_mul_ps(dots, factors));
      };
      int64_t r = 0;
      for (; r + 3 <= rows; r += 3) {
        __m256 dots[3];
        dot_8_keys<D, 3, Rows>(q_rows + r, key_rows, stride, count, dots);
        for (int j = 0; j < 3; ++j) store(r + j, dots[j]);
      }
      if (rows - r == 2) {
        __m256 dots[2];
        dot_8_keys<D, 2, Rows>(q_rows + r, key_rows, stride, count, dots);
        store(r, dots[0]);
        store(r + 1, dots[1]);
      } else if (rows - r == 1) {
        __m256 dots[1];
        dot_8_keys<D, 1, Rows>(q_rows + r, key_rows, stride, count, dots);
        store(r, dots[0]);
      }
    }
  }
  const int64_t* tree = batch.tree(seq);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t query = (row_begin + r) / group;
    float* s = scores + r * pitch;
    if (tree != nullptr) hide_tree_positions(span, tree[query], query, s, -std::numeric_limits<float>::infinity());
    softmax_row_f32(span, query, s);
    if (tree != nullptr) hide_tree_positions(span, tree[query], query, s, 0.0f);
  }
  // P V, chunk by chunk (all rows, 32 columns at a time), accumulating in the rows' outputs; its own lead
  // too (a context past the caches has lost the first chunks' V rows again by now)
  for (int64_t i = 0; i < std::min(kPrefetchChunks, num_chunks); ++i)
    prefetch_rows(values + chunks[i].offset, chunks[i].count, stride, row_bytes);
  if (num_chunks == 0) {  // nothing visible (cannot happen for a real query, which sees itself)
    for (int64_t r = 0; r < rows; ++r) std::fill(out_rows[r], out_rows[r] + D, 0.0f);
  }
  float* out_at[3];
  float value_factors[16];  // a chunk's value rows' factors (scaled rows only)
  for (int64_t i = 0; i < num_chunks; ++i) {
    if (i + kPrefetchChunks < num_chunks)
      prefetch_rows(values + chunks[i + kPrefetchChunks].offset, chunks[i + kPrefetchChunks].count, stride, row_bytes);
    const Chunk chunk = chunks[i];
    if constexpr (Rows::scaled)
      for (int64_t t = 0; t < chunk.count; ++t) value_factors[t] = Rows::factor(values + chunk.offset + t * stride, D);
    for (int64_t column = 0; column < D; column += 32) {
      const elem_t* value_rows = values + chunk.offset + column;
      for (int64_t r = 0; r < rows; r += 3) {
        const int64_t n = std::min<int64_t>(3, rows - r);
        for (int64_t j = 0; j < n; ++j) out_at[j] = out_rows[r + j] + column;
        if (n == 3)
          add_chunk_values<3, Rows>(p_rows + r, value_rows, stride, chunk.count, chunk.index, value_factors, i == 0, out_at);
        else if (n == 2)
          add_chunk_values<2, Rows>(p_rows + r, value_rows, stride, chunk.count, chunk.index, value_factors, i == 0, out_at);
        else
          add_chunk_values<1, Rows>(p_rows + r, value_rows, stride, chunk.count, chunk.index, value_factors, i == 0, out_at);
      }
    }
  }
  if constexpr (!f32) {  // round to the output dtype (nearest even), 8 values at a time
    for (int64_t r = 0; r < rows; ++r) {
      scalar_t* o = batch.out + batch.head_offset(seq, kv_head, row_begin + r);
      for (int64_t d = 0; d < D; d += 8) store8(o + d, _mm256_loadu_ps(out_rows[r] + d));
    }
  }
}

#endif  // LLMSERVE_FMA_PATH

// ---- the bfloat16 fast path (AVX-512 BF16) -----------------------------------------------------------

#ifdef LLMSERVE_BF16_FAST_PATH

// Sixteen vectors of partial sums in, one vector out whose lane k is the sum of all lanes of v[k]: a
// transpose-and-add tree (45 shuffles and adds for 16 dot products instead of 16 horizontal reductions).
inline __m512 reduce_16(__m512 v[16]) {
  __m512 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves added: c[i] = [v[2i] in 8 lanes | v[2i+1] in 8 lanes]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit chunk j of d[i] holds key 4i + j in 4 lanes
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    e[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4j + t of f holds key j + 4t
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, f);
}

template <int D>
inline void prefetch_chunk(const uint16_t* rows, const Chunk& chunk, int64_t stride) {
  prefetch_rows(rows + chunk.offset, chunk.count, stride, 2 * D);
}

// V pass for query rows [first, first + R): acc += P V with the probabilities as bf16 pairs (two keys per
// vdpbf16ps), accumulators in registers for the whole context.
template <int D, int R>
inline void accumulate_values(const std::vector<Chunk>& chunks, const uint16_t* values, int64_t stride,
                              const uint16_t* probs, int64_t probs_stride, int64_t first, float* acc) {
  constexpr int V = D / 16;
  __m512 sum[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) sum[r][c] = _mm512_setzero_ps();
  const uint16_t* p = probs + first * probs_stride;
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  for (int64_t i = 0; i < std::min(kPrefetchChunks, num_chunks); ++i) prefetch_chunk<D>(values, chunks[i], stride);
  for (int64_t i = 0; i < num_chunks; ++i) {
    const Chunk chunk = chunks[i];
    if (i + kPrefetchChunks < num_chunks) prefetch_chunk<D>(values, chunks[i + kPrefetchChunks], stride);
    const uint16_t* rows = values + chunk.offset;
    for (int64_t k = 0; k < chunk.count; k += 2) {
      __m512i v[V];
      interleave_rows<D>(rows + k * stride, k + 1 < chunk.count ? rows + (k + 1) * stride : kZeroRow, v);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;  // (p[index + k], p[index + k + 1]); a lone last row pairs with zeros
        std::memcpy(&pair, p + r * probs_stride + chunk.index + k, sizeof(pair));
        const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int c = 0; c < V; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], weights, (__m512bh)v[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + (first + r) * D + 16 * c, sum[r][c]);
}

// Softmax numerators of query rows [row_begin, row_begin + rows) as bf16 (exp(s - max) <= 1; hidden
// positions exactly 0), each row padded with zeros to an even length (keys go in pairs), and each row's
// total; the division by it comes at the end.
inline void bf16_probabilities(const Span& span, int64_t group, int64_t row_begin, int64_t rows, const float* scores,
                               uint16_t* probs, int64_t probs_stride, float* totals) {
  const int64_t context = span.context;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t a, b, c;  // visible score indices: [0, a) and [b, c)
    span.visible((row_begin + r) / group, a, b, c);
    const float* s = scores + r * context;
    uint16_t* p = probs + r * probs_stride;
    // Lanes i..i+15 that the row sees: all or none but in the vectors across a boundary, whose mask alone
    // is computed; hidden vectors are skipped (they added exact zeros to the lane sums).
    auto visible_lanes = [&](int64_t i) -> __mmask16 {
      if (i + 16 <= a || (i >= b && i + 16 <= c)) return 0xFFFF;
      if (i >= a && (i + 16 <= b || i >= c)) return 0;
      const __m512i index = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i)));
      const __mmask16 low = _mm512_cmplt_epi32_mask(index, _mm512_set1_epi32(static_cast<int>(a)));
      const __mmask16 high = _mm512_cmpge_epi32_mask(index, _mm512_set1_epi32(static_cast<int>(b))) &
                             _mm512_cmplt_epi32_mask(index, _mm512_set1_epi32(static_cast<int>(c)));
      return static_cast<__mmask16>(low | high);
    };
    __m512 max_vector = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < context; i += 16) {
      const __mmask16 visible = visible_lanes(i);
      if (visible != 0)
        max_vector = _mm512_mask_max_ps(max_vector, visible, max_vector, _mm512_maskz_loadu_ps(visible, s + i));
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(max_vector));
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < context; i += 16) {
      const __mmask16 visible = visible_lanes(i);
      __m256i e16 = _mm256_setzero_si256();
      if (visible != 0) {
        const __m512 e = _mm512_maskz_mov_ps(visible, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(visible, s + i), row_max)));
        total = _mm512_add_ps(total, e);
        e16 = (__m256i)_mm512_cvtneps_pbh(e);
      }
      if (i + 16 <= context) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), e16);
      } else {
        _mm256_mask_storeu_epi16(p + i, static_cast<__mmask16>((1u << (context - i)) - 1), e16);
      }
    }
    p[context] = p[context + 1] = 0;
    totals[r] = _mm512_reduce_add_ps(total);
  }
}

// Query rows [row_begin, row_end) of (seq, kv_head); row r = (token r / group, head r % group of the group).
template <int D>
void attend_bf16(const Batch<c10::BFloat16, c10::BFloat16>& batch, int64_t seq, int64_t kv_head, int64_t row_begin,
                 int64_t row_end, Scratch& scratch) {
  constexpr int K = D / 32;  // 512-bit registers of bf16 pairs per row
  const int64_t group = batch.group();
  const int64_t num_queries = batch.query_starts[seq + 1] - batch.query_starts[seq];
  const Span span(batch.seq_lens[seq], num_queries, batch.sinks, batch.window);
  const int64_t rows = row_end - row_begin, context = span.context;
  const int64_t* table = batch.block_tables + seq * batch.max_blocks;
  const int64_t stride = batch.slot_stride();
  float* scores = scratch.grow(scratch.scores, rows * context);
  float* acc = scratch.grow(scratch.acc, rows * D);
  // The query rows are read where they are, as bf16: vdpbf16ps multiplies bf16 pairs exactly and sums
  // in float32. Row r = (token i, head g of the group) is at queries + i * token_stride + g * D, found
  // once here rather than by two divisions per row in every chunk.
  const auto* queries = reinterpret_cast<const uint16_t*>(batch.query + batch.head_offset(seq, kv_head, 0));
  const int64_t token_stride = batch.num_heads * D;
  const uint16_t** q_rows = scratch.grow(scratch.query_rows, rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row_begin + r;
    q_rows[r] = queries + (row / group) * token_stride + (row % group) * D;
  }
  const __m512 scale = _mm512_set1_ps(batch.scale);
  const auto* keys = reinterpret_cast<const uint16_t*>(batch.key_cache) + kv_head * batch.row_len;
  std::vector<Chunk>& chunks = scratch.chunks;
  list_chunks(span, table, batch.block_size, stride, chunks);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  for (int64_t i = 0; i < std::min(kPrefetchChunks, num_chunks); ++i) prefetch_chunk<D>(keys, chunks[i], stride);
  for (int64_t i = 0; i < num_chunks; ++i) {
    const Chunk chunk = chunks[i];
    if (i + kPrefetchChunks < num_chunks) prefetch_chunk<D>(keys, chunks[i + kPrefetchChunks], stride);
    const uint16_t* key_rows = keys + chunk.offset;
    const int count = static_cast<int>(chunk.count);
    for (int64_t r = 0; r < rows; ++r) {
      __m512bh qv[K];
      for (int j = 0; j < K; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q_rows[r] + 32 * j);
      __m512 partial[16];
      for (int k = 0; k < 16; ++k) {  // a short chunk repeats its last row (those lanes are not stored)
        const uint16_t* key = key_rows + std::min(k, count - 1) * stride;
        __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(key));
        for (int j = 1; j < K; ++j) sum = _mm512_dpbf16_ps(sum, qv[j], (__m512bh)_mm512_loadu_si512(key + 32 * j));
        partial[k] = sum;
      }
      const __m512 dots = _mm512_mul_ps(reduce_16(partial), scale);
      _mm512_mask_storeu_ps(scores + r * context + chunk.index, static_cast<__mmask16>((1u << count) - 1), dots);
    }
  }
  const int64_t probs_stride = context + 2;
  uint16_t* probs = scratch.grow(scratch.probs, rows * probs_stride);
  float* totals = scratch.grow(scratch.totals, rows);
  const int64_t* tree = batch.tree(seq);
  if (tree != nullptr)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t query = (row_begin + r) / group;
      hide_tree_positions(span, tree[query], query, scores + r * context, -std::numeric_limits<float>::infinity());
    }
  bf16_probabilities(span, group, row_begin, rows, scores, probs, probs_stride, totals);
  if (tree != nullptr)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t query = (row_begin + r) / group;
      hide_tree_positions(span, tree[query], query, probs + r * probs_stride, uint16_t{0});
    }
  // Query rows per V pass: R * D / 16 accumulators in registers. Each pass after the first reads the
  // values again (from L2), so spans take 6 rows at a time where head_dim 64 leaves the registers for it.
  const auto* values = reinterpret_cast<const uint16_t*>(batch.value_cache) + kv_head * batch.row_len;
  constexpr int R = D <= 64 ? 4 : 2;
  int64_t first = 0;
  if constexpr (D <= 64)
    for (; first + 6 <= rows; first += 6)
      accumulate_values<D, 6>(chunks, values, stride, probs, probs_stride, first, acc);
  for (; first + R <= rows; first += R)
    accumulate_values<D, R>(chunks, values, stride, probs, probs_stride, first, acc);
  switch (rows - first) {
    case 3: accumulate_values<D, 3>(chunks, values, stride, probs, probs_stride, first, acc); break;
    case 2: accumulate_values<D, 2>(chunks, values, stride, probs, probs_stride, first, acc); break;
    case 1: accumulate_values<D, 1>(chunks, values, stride, probs, probs_stride, first, acc); break;
    default: break;
  }
  for (int64_t r = 0; r < rows; ++r) {  // normalize, round to bf16 (nearest even), 16 values at a time
    auto* o = reinterpret_cast<uint16_t*>(batch.out + batch.head_offset(seq, kv_head, row_begin + r));
    const __m512 inverse = _mm512_set1_ps(1.0f / totals[r]);
    for (int j = 0; j < D / 16; ++j) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * j), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * j), (__m256i)rounded);
    }
  }
}

#endif  // LLMSERVE_BF16_FAST_PATH

// Runs attend(seq, kv_head, row_begin, row_end, scratch) for every (sequence, KV head), longest contexts
// first, dealt out to the threads one item at a time so uneven lengths do not leave a thread idle. With
// enough sequences to keep every thread busy, an item is a whole sequence, its KV heads one after
// another: a head's rows share their pages (and 64-byte-line neighbours) with the other heads' rows of
// the same slots, so the later heads find the block's pages in the TLB instead of another core walking
// them. With split_rows and fewer (sequence, KV head) pairs than twice the threads, the pairs beyond a
// multiple of the threads (the shortest) are split into up to `threads` parts by query rows, each part
// over the whole context (nothing to merge, and each row computed as before): at batch 1 the 3 KV heads
// no longer leave one of 2 threads with two of them, although the split head's blocks are read twice
// (a net gain for spans and decodes alike).
template <typename Attend>
void for_each_item(int64_t num_seqs, int64_t num_kv_heads, const int64_t* seq_lens, const int64_t* query_starts,
                   int64_t group, bool split_rows, Attend&& attend) {
  struct Item {
    int64_t seq, first_head, num_heads, row_begin, row_end;
  };
  std::vector<int64_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return seq_lens[a] > seq_lens[b]; });
  const ThreadShare share = thread_share();
  const int64_t max_threads = share.threads > 0 ? share.threads : at::get_num_threads();
  const int64_t heads_per_item = num_seqs >= 4 * max_threads ? num_kv_heads : 1;
  const int64_t pairs = num_seqs * num_kv_heads;
  const int64_t split_from = split_rows && pairs < 2 * max_threads ? pairs - pairs % max_threads : pairs;
  std::vector<Item> items;
  items.reserve(split_from + (pairs - split_from) * max_threads);
  int64_t pair = 0;
  for (const int64_t seq : order) {
    const int64_t rows = (query_starts[seq + 1] - query_starts[seq]) * group;
    for (int64_t head = 0; head < num_kv_heads; head += heads_per_item, pair += heads_per_item) {
      const int64_t parts = pair >= split_from ? std::clamp<int64_t>(rows, 1, max_threads) : 1;
      for (int64_t part = 0; part < parts; ++part)
        items.push_back({seq, head, heads_per_item, rows * part / parts, rows * (part + 1) / parts});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const auto run_item = [&](int64_t i) {
    static thread_local Scratch scratch;  // kept across calls: no allocation per layer once grown
    const Item& item = items[i];
    for (int64_t head = item.first_head; head < item.first_head + item.num_heads; ++head)
      attend(item.seq, head, item.row_begin, item.row_end, scratch);
  };
  if (share.threads > 0) {  // a thread of the caller's region: every threads-th item from its own
    for (int64_t i = share.thread; i < num_items; i += share.threads) run_item(i);
    return;
  }
  const int threads = static_cast<int>(std::min<int64_t>(max_threads, num_items));
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < num_items; ++i) run_item(i);
}

// Which kernel paged_attention runs for queries of `dtype`, a cache of kv_format and head_dim, as compiled
// at this level: the one place that decides, for the dispatch and for paged_attention_path.
enum class Path { kPortable, kFma, kBf16Pairs };

Path choose_path(at::ScalarType dtype, int64_t kv_format, int64_t head_dim) {
  if (head_dim != 64 && head_dim != 128) return Path::kPortable;
#ifdef LLMSERVE_BF16_FAST_PATH
  if (dtype == at::kBFloat16 && kv_format == 0) return Path::kBf16Pairs;
#endif
#ifdef LLMSERVE_FMA_PATH
  if (dtype == at::kFloat || dtype == at::kBFloat16) return Path::kFma;
#endif
  return Path::kPortable;
}

}  // namespace

// "bf16_pairs" (AVX-512 BF16 pair products: probabilities rounded to bf16), "fma" (float32 FMAs over
// cache rows converted 8 lanes at a time) or "portable" (rows converted one at a time, plain loops).
std::string paged_attention_path(at::ScalarType dtype, int64_t kv_format, int64_t head_dim) {
  switch (choose_path(dtype, kv_format, head_dim)) {
    case Path::kBf16Pairs: return "bf16_pairs";
    case Path::kFma: return "fma";
    default: return "portable";
  }
}

// query [T, H, D]: the query tokens of every sequence, sequence b's at rows query_starts[b] ..
// query_starts[b + 1] - 1 (its last positions). key_cache, value_cache [slots, KVH, D] in the query's
// dtype, or, for an 8-bit cache (kv_format 1 = int8, 2 = fp8), [slots, KVH, D + 2] bytes; block_tables
// [B, max_blocks] int64; seq_lens [B] int64 (context lengths, this step's tokens included); window > 0
// keeps only the first `sinks` and the last `window` positions. Returns [T, H, D].
at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_starts,
                           int64_t block_size, double scale, int64_t kv_format, int64_t sinks, int64_t window,
                           const std::optional<at::Tensor>& tree_masks) {
  auto out = at::empty_like(query);
  paged_attention_into(query, key_cache, value_cache, block_tables, seq_lens, query_starts, block_size, scale,
                       kv_format, sinks, window, tree_masks, out);
  return out;
}

void paged_attention_into(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                          int64_t block_size, double scale, int64_t kv_format, int64_t sinks, int64_t window,
                          const std::optional<at::Tensor>& tree_masks, at::Tensor& out) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_attention needs contiguous tensors");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "paged_attention's output must be contiguous, shaped and typed as the query");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_starts.scalar_type() == at::kLong,
              "block_tables, seq_lens and query_starts must be int64");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_starts.contiguous();
  const int64_t num_seqs = lens.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1);
  TORCH_CHECK(starts.size(0) == num_seqs + 1 && starts.data_ptr<int64_t>()[num_seqs] == query.size(0),
              "query_starts must have num_seqs + 1 entries ending at the number of query tokens");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(kv_format >= 0 && kv_format <= 2, "kv_format must be 0 (plain), 1 (int8) or 2 (fp8)");
  if (kv_format == 0) {
    TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(), "a plain KV cache must have the query's dtype");
  } else {
    TORCH_CHECK(key_cache.scalar_type() == at::kByte && key_cache.size(2) == head_dim + 2,
                "an 8-bit KV cache must be uint8 rows of head_dim + 2 bytes");
  }
  at::Tensor masks;
  if (tree_masks && tree_masks->defined()) {
    masks = tree_masks->contiguous();
    TORCH_CHECK(masks.scalar_type() == at::kLong && masks.dim() == 1 && masks.size(0) == query.size(0),
                "tree_masks must be int64 [num_tokens]");
    const int64_t* s = starts.data_ptr<int64_t>();
    for (int64_t b = 0; b < num_seqs; ++b)
      TORCH_CHECK(s[b + 1] - s[b] <= 64, "a token tree's span holds at most 64 queries (one bit each)");
  }
  if (num_seqs == 0) return;
  const int64_t* lens_ptr = lens.data_ptr<int64_t>();
  const int64_t* starts_ptr = starts.data_ptr<int64_t>();
  const int64_t group = num_heads / num_kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    auto run = [&](auto rows_tag, const auto* keys, const auto* values) {
      using Rows = decltype(rows_tag);
      using elem_t = typename Rows::elem_t;
      const Batch<scalar_t, elem_t> batch{query.data_ptr<scalar_t>(), keys, values, tables.data_ptr<int64_t>(),
                                          lens_ptr, starts.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                          num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
                                          head_dim + Rows::extra, sinks, window, static_cast<float>(scale),
                                          masks.defined() ? masks.data_ptr<int64_t>() : nullptr};
      const Path path = choose_path(query.scalar_type(), kv_format, head_dim);
#ifdef LLMSERVE_BF16_FAST_PATH
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<elem_t, c10::BFloat16>) {
        if (path == Path::kBf16Pairs) {
          for_each_item(num_seqs, num_kv_heads, lens_ptr, starts_ptr, group, /*split_rows=*/true,
                        [&](int64_t s, int64_t h, int64_t first, int64_t end, Scratch& x) {
                          if (head_dim == 64) attend_bf16<64>(batch, s, h, first, end, x);
                          else attend_bf16<128>(batch, s, h, first, end, x);
                        });
          return;
        }
      }
#endif
#ifdef LLMSERVE_FMA_PATH
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
        if (path == Path::kFma) {
          for_each_item(num_seqs, num_kv_heads, lens_ptr, starts_ptr, group, /*split_rows=*/true,
                        [&](int64_t s, int64_t h, int64_t first, int64_t end, Scratch& x) {
                          if (head_dim == 64) attend_fma<64, scalar_t, Rows>(batch, s, h, first, end, x);
                          else attend_fma<128, scalar_t, Rows>(batch, s, h, first, end, x);
                        });
          return;
        }
      }
#endif
      for_each_item(num_seqs, num_kv_heads, lens_ptr, starts_ptr, group, /*split_rows=*/false,
                    [&](int64_t s, int64_t h, int64_t, int64_t, Scratch& x) {
                      attend_portable<scalar_t, Rows>(batch, s, h, x);
                    });
    };
    if (kv_format == 0) {
      run(PlainRows<scalar_t>{}, key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>());
    } else if (kv_format == 1) {
      run(Int8Rows{}, key_cache.data_ptr<uint8_t>(), value_cache.data_ptr<uint8_t>());
    } else {
      run(Fp8Rows{}, key_cache.data_ptr<uint8_t>(), value_cache.data_ptr<uint8_t>());
    }
  });
}
