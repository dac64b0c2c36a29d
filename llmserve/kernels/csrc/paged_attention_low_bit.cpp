// Decode attention over a 4-bit or 2-bit KV cache (KIVI: attention/kv_format.py, attention/low_bit.py), read
// in place: one query per sequence, at position length - 1, and what it reads is low_bit.py's rule. Before its
// first span of window blocks is complete a sequence reads every position from its full-precision window;
// after, its first `sink_tokens` positions from its sink entry, the positions of its complete spans from the
// pool's packed codes, and its incomplete span from its window.
//
// Keys in the pool are quantized per channel over a block, k = m_d + s_d c: a block's q.k are the codes' dot
// products with q * s plus q . m, so q * s and q . m are made once per block and query row and the codes are
// widened once per position for all the rows of the group. Values are quantized per position in groups of 32
// channels, v = m_g + s_g c: P V adds (p s_g) times the codes and p m_g once per position and group, and the
// V pass takes one group (32 columns, four vectors) at a time. float32 arithmetic on AVX2, FMA and F16C (the
// FMA path of paged_attention.cpp's level), for float32 and bf16 queries and full-precision rows.
#include "aten.h"
#include <c10/util/Half.h>
#include <omp.h>

#include "kernels.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMSERVE_LOW_BIT_PATH 1
#endif

namespace {

#ifdef LLMSERVE_LOW_BIT_PATH

// Codes 8 * piece .. 8 * piece + 7 of a row packed `Bits` bits each from the low bits up (they fill `Bits`
// bytes from byte piece * Bits), as float32 lanes.
template <int Bits>
inline __m256 codes8(const uint8_t* row, int64_t piece) {
  uint32_t word = 0;
  std::memcpy(&word, row + piece * Bits, Bits);
  const __m256i shifts = Bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                   : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                                         _mm256_set1_epi32((1 << Bits) - 1));
  return _mm256_cvtepi32_ps(codes);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <typename scalar_t>
struct LowBitBatch {
  const scalar_t* query;  // [seqs, heads, D]
  const uint8_t* key_cache;  // [slots, kv_heads, row_bytes]
  const uint8_t* value_cache;
  const scalar_t* window_keys;  // [window slots * window_blocks * block, kv_heads, D]
  const scalar_t* window_values;
  const scalar_t* sink_keys;  // [entries * sink_tokens, kv_heads, D]
  const scalar_t* sink_values;
  const int64_t* block_tables;  // [seqs, max_blocks]
  const int64_t* seq_lens;
  const int64_t* window_slots;
  const int64_t* sink_entries;
  scalar_t* out;
  int64_t num_heads, num_kv_heads, block, max_blocks, row_bytes, window_blocks, sink_tokens;
  float scale;
};

struct LowBitScratch {
  std::vector<float> scores, queries, scaled, acc, channel;
  float* grow(std::vector<float>& buffer, int64_t size) {
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    return buffer.data();
  }
};

template <int D>
inline float dot_row(const float* q, const float* row) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(row));
  LLMSERVE_UNROLL for (int p = 1; p < D / 8; ++p) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * p), _mm256_loadu_ps(row + 8 * p), acc);
  return horizontal_sum8(acc);
}

template <int D, typename T>
inline float dot_row(const float* q, const T* row) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), load8(row));
  LLMSERVE_UNROLL for (int p = 1; p < D / 8; ++p) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * p), load8(row + 8 * p), acc);
  return horizontal_sum8(acc);
}

template <int D, typename T>
inline void add_row(float weight, const T* row, float* acc) {
  const __m256 w = _mm256_set1_ps(weight);
  LLMSERVE_UNROLL for (int p = 0; p < D / 8; ++p)
    _mm256_storeu_ps(acc + 8 * p, _mm256_fmadd_ps(w, load8(row + 8 * p), _mm256_loadu_ps(acc + 8 * p)));
}

// q.k of four consecutive positions' codes (rows `stride` bytes apart) for R query rows: per position one FMA
// chain over the row on codes widened once for all R rows, then one transpose-and-add per row for the four.
template <int D, int Bits, int R>
inline void dots4(const float* const* rows, const uint8_t* codes, int64_t stride, const float* bias, float* const* out) {
  __m256 acc[R][4];
  LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
    LLMSERVE_UNROLL for (int k = 0; k < 4; ++k) acc[r][k] = _mm256_setzero_ps();
  }
  LLMSERVE_UNROLL for (int64_t p = 0; p < D / 8; ++p) {
    __m256 c[4];
    LLMSERVE_UNROLL for (int k = 0; k < 4; ++k) c[k] = codes8<Bits>(codes + k * stride, p);
    LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m256 q = _mm256_loadu_ps(rows[r] + 8 * p);
      LLMSERVE_UNROLL for (int k = 0; k < 4; ++k) acc[r][k] = _mm256_fmadd_ps(q, c[k], acc[r][k]);
    }
  }
  LLMSERVE_UNROLL for (int r = 0; r < R; ++r) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
    _mm_storeu_ps(out[r], _mm_add_ps(sums, _mm_set1_ps(bias[r])));
  }
}

// Query rows [row_begin, row_end) of (sequence, KV head) (of its `group`) against its context.
template <int D, int Bits, typename scalar_t>
void attend_low_bit(const LowBitBatch<scalar_t>& b, int64_t seq, int64_t kv_head, int64_t row_begin,
                    int64_t row_end, LowBitScratch& scratch) {
  const int64_t group = row_end - row_begin, length = b.seq_lens[seq];
  const int64_t first_head = kv_head * (b.num_heads / b.num_kv_heads) + row_begin;
  const int64_t block = b.block, span = b.window_blocks * block;
  const int64_t window_from = length / span * span;  // positions before it: sinks and quantized blocks
  const int64_t quantized_blocks = window_from / block;
  const int64_t pitch = (length + 7) / 8 * 8;
  const int64_t kv_stride = b.num_kv_heads * D;  // full-precision rows of a head, one position apart
  const int64_t code_stride = b.num_kv_heads * b.row_bytes;
  const int64_t code_bytes = D * Bits / 8;
  const int64_t* table = b.block_tables + seq * b.max_blocks;
  float* q = scratch.grow(scratch.queries, group * D);
  float* qs = scratch.grow(scratch.scaled, group * D);
  float* scores = scratch.grow(scratch.scores, group * pitch);
  float* acc = scratch.grow(scratch.acc, group * D);
  float* channel = scratch.grow(scratch.channel, 2 * D);  // a block's key scales, then minimums
  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* row = b.query + (seq * b.num_heads + first_head + g) * D;
    for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<float>(row[d]) * b.scale;
  }
  auto window_row = [&](const scalar_t* rows, int64_t pos) {
    const int64_t place = b.window_slots[seq] * b.window_blocks + (pos / block) % b.window_blocks;
    return rows + (place * block + pos % block) * kv_stride + kv_head * D;
  };
  auto sink_row = [&](const scalar_t* rows, int64_t pos) {
    return rows + (b.sink_entries[seq] * b.sink_tokens + pos) * kv_stride + kv_head * D;
  };
  const int64_t num_sinks = window_from > 0 ? std::min(b.sink_tokens, length) : 0;
  // scores: complete spans from the codes, the sinks over their block's first rows, then the window
  for (int64_t j = 0; j < quantized_blocks; ++j) {
    const uint8_t* rows = b.key_cache + table[j] * block * code_stride + kv_head * b.row_bytes;
    const int64_t per_row = D / block;  // channels whose (scale, minimum) pair each row carries
    for (int64_t t = 0; t < block; ++t) {
      const uint8_t* pairs = rows + t * code_stride + code_bytes;
      for (int64_t i = 0; i < per_row; ++i) {
        channel[t * per_row + i] = half_at(pairs + 4 * i);
        channel[D + t * per_row + i] = half_at(pairs + 4 * i + 2);
      }
    }
    float bias[16];
    for (int64_t g = 0; g < group; ++g) {
      __m256 dot = _mm256_setzero_ps();
      for (int64_t p = 0; p < D / 8; ++p) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + 8 * p);
        _mm256_storeu_ps(qs + g * D + 8 * p, _mm256_mul_ps(qv, _mm256_loadu_ps(channel + 8 * p)));
        dot = _mm256_fmadd_ps(qv, _mm256_loadu_ps(channel + D + 8 * p), dot);
      }
      bias[g] = horizontal_sum8(dot);
    }
    for (int64_t t = 0; t < block; t += 4) {  // four positions at a time, three rows at a time
      const uint8_t* codes = rows + t * code_stride;
      for (int64_t g = 0; g < group; g += 3) {
        const float* q_rows[3] = {qs + g * D, qs + (g + 1) * D, qs + (g + 2) * D};
        float* out[3] = {scores + g * pitch + j * block + t, scores + (g + 1) * pitch + j * block + t,
                         scores + (g + 2) * pitch + j * block + t};
        switch (std::min<int64_t>(3, group - g)) {
          case 3: dots4<D, Bits, 3>(q_rows, codes, code_stride, bias + g, out); break;
          case 2: dots4<D, Bits, 2>(q_rows, codes, code_stride, bias + g, out); break;
          default: dots4<D, Bits, 1>(q_rows, codes, code_stride, bias + g, out); break;
        }
      }
    }
  }
  for (int64_t pos = 0; pos < num_sinks; ++pos)
    for (int64_t g = 0; g < group; ++g) scores[g * pitch + pos] = dot_row<D>(q + g * D, sink_row(b.sink_keys, pos));
  for (int64_t pos = window_from; pos < length; ++pos)
    for (int64_t g = 0; g < group; ++g) scores[g * pitch + pos] = dot_row<D>(q + g * D, window_row(b.window_keys, pos));
  for (int64_t g = 0; g < group; ++g) softmax_prefix_f32(scores + g * pitch, length, length);
  // P V: the same three sources; a quantized value's group minimum adds p * m to its 32 columns
  std::fill(acc, acc + group * D, 0.0f);
  for (int64_t j = 0; j < quantized_blocks; ++j) {
    const uint8_t* rows = b.value_cache + table[j] * block * code_stride + kv_head * b.row_bytes;
    for (int64_t t = j == 0 ? num_sinks : 0; t < block; ++t) {
      const uint8_t* codes = rows + t * code_stride;
      const int64_t pos = j * block + t;
      for (int64_t c = 0; c < D / 32; ++c) {
        const float scale = half_at(codes + code_bytes + 4 * c), minimum = half_at(codes + code_bytes + 4 * c + 2);
        __m256 v[4];
        LLMSERVE_UNROLL for (int k = 0; k < 4; ++k) v[k] = codes8<Bits>(codes, 4 * c + k);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * pitch + pos];
          const __m256 w = _mm256_set1_ps(p * scale), m = _mm256_set1_ps(p * minimum);
          float* out = acc + g * D + 32 * c;
          LLMSERVE_UNROLL for (int k = 0; k < 4; ++k)
            _mm256_storeu_ps(out + 8 * k, _mm256_add_ps(_mm256_fmadd_ps(w, v[k], _mm256_loadu_ps(out + 8 * k)), m));
        }
      }
    }
  }
  for (int64_t pos = 0; pos < num_sinks; ++pos)
    for (int64_t g = 0; g < group; ++g) add_row<D>(scores[g * pitch + pos], sink_row(b.sink_values, pos), acc + g * D);
  for (int64_t pos = window_from; pos < length; ++pos)
    for (int64_t g = 0; g < group; ++g)
      add_row<D>(scores[g * pitch + pos], window_row(b.window_values, pos), acc + g * D);
  for (int64_t g = 0; g < group; ++g) {
    scalar_t* o = b.out + (seq * b.num_heads + first_head + g) * D;
    for (int64_t d = 0; d < D; d += 8) store8(o + d, _mm256_loadu_ps(acc + g * D + d));
  }
}

template <typename scalar_t>
void launch(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& window_keys, const at::Tensor& window_values, const at::Tensor& sink_keys,
            const at::Tensor& sink_values, const at::Tensor& block_tables, const at::Tensor& seq_lens,
            const at::Tensor& window_slots, const at::Tensor& sink_entries, int64_t block_size,
            int64_t window_blocks, int64_t sink_tokens, double scale, int64_t bits, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1);
  const LowBitBatch<scalar_t> batch{query.data_ptr<scalar_t>(), key_cache.data_ptr<uint8_t>(),
                                    value_cache.data_ptr<uint8_t>(), window_keys.data_ptr<scalar_t>(),
                                    window_values.data_ptr<scalar_t>(), sink_keys.data_ptr<scalar_t>(),
                                    sink_values.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
                                    seq_lens.data_ptr<int64_t>(), window_slots.data_ptr<int64_t>(),
                                    sink_entries.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_heads,
                                    num_kv_heads, block_size, block_tables.size(1), key_cache.size(2),
                                    window_blocks, sink_tokens, static_cast<float>(scale)};
  auto attend = [&](int64_t seq, int64_t head, int64_t first, int64_t end, LowBitScratch& scratch) {
    if (head_dim == 64) {
      bits == 4 ? attend_low_bit<64, 4>(batch, seq, head, first, end, scratch)
                : attend_low_bit<64, 2>(batch, seq, head, first, end, scratch);
    } else {
      bits == 4 ? attend_low_bit<128, 4>(batch, seq, head, first, end, scratch)
                : attend_low_bit<128, 2>(batch, seq, head, first, end, scratch);
    }
  };
  // (sequence, KV head) items, longest first; with fewer than twice the threads (batch 1: 3 KV heads on 2
  // threads), those beyond a multiple of the threads split by query rows (each part over the whole context)
  struct Item {
    int64_t seq, head, first, end;
  };
  const int64_t group = num_heads / num_kv_heads, max_threads = at::get_num_threads();
  std::vector<int64_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  const int64_t pairs = num_seqs * num_kv_heads;
  const int64_t split_from = pairs < 2 * max_threads ? pairs - pairs % max_threads : pairs;
  std::vector<Item> items;
  int64_t pair = 0;
  for (const int64_t seq : order) {
    for (int64_t head = 0; head < num_kv_heads; ++head, ++pair) {
      const int64_t parts = pair >= split_from ? std::clamp<int64_t>(group, 1, max_threads) : 1;
      for (int64_t part = 0; part < parts; ++part)
        items.push_back({seq, head, group * part / parts, group * (part + 1) / parts});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_threads, num_items)));
#pragma omp parallel num_threads(threads)
  {
    static thread_local LowBitScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) attend(items[i].seq, items[i].head, items[i].first, items[i].end, scratch);
  }
}

#endif  // LLMSERVE_LOW_BIT_PATH

}  // namespace

bool paged_attention_low_bit_supported(at::ScalarType dtype, int64_t head_dim) {
#ifdef LLMSERVE_LOW_BIT_PATH
  return (dtype == at::kFloat || dtype == at::kBFloat16) && (head_dim == 64 || head_dim == 128);
#else
  return false;
#endif
}

// query [seqs, heads, D] (one per sequence); key_cache, value_cache [slots, kv_heads, D * bits / 8 + D / 8]
// bytes; window_keys, window_values [window slots * window_blocks * block, kv_heads, D] and sink_keys,
// sink_values [entries * sink_tokens, kv_heads, D] in the query's dtype; block_tables [seqs, max_blocks],
// seq_lens, window_slots, sink_entries [seqs] int64. Returns [seqs, heads, D].
at::Tensor paged_attention_low_bit(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor window_keys, at::Tensor window_values, at::Tensor sink_keys,
                                   at::Tensor sink_values, at::Tensor block_tables, at::Tensor seq_lens,
                                   at::Tensor window_slots, at::Tensor sink_entries, int64_t block_size,
                                   int64_t window_blocks, int64_t sink_tokens, double scale, int64_t bits) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(paged_attention_low_bit_supported(query.scalar_type(), head_dim),
              "paged_attention_low_bit takes float32 or bf16 queries with head_dim 64 or 128 on AVX2, FMA and F16C");
  TORCH_CHECK(bits == 4 || bits == 2, "bits must be 4 or 2");
  TORCH_CHECK(block_size == 32, "low-bit caches quantize keys over blocks of 32 tokens");
  for (const auto* t : {&query, &key_cache, &value_cache, &window_keys, &window_values, &sink_keys, &sink_values})
    TORCH_CHECK(t->is_contiguous(), "paged_attention_low_bit needs contiguous tensors");
  TORCH_CHECK(key_cache.scalar_type() == at::kByte && key_cache.size(2) == head_dim * bits / 8 + head_dim / 8,
              "a low-bit KV cache is uint8 rows of head_dim * bits / 8 + head_dim / 8 bytes");
  for (const auto* t : {&window_keys, &window_values, &sink_keys, &sink_values})
    TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->size(2) == head_dim, "windows and sinks are rows of the query's dtype");
  for (const auto* t : {&block_tables, &seq_lens, &window_slots, &sink_entries})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "tables, lengths, slots and entries are int64");
  const int64_t num_kv_heads = key_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 16, "1 to 16 query heads per KV head");
  auto out = at::empty_like(query);
#ifdef LLMSERVE_LOW_BIT_PATH
  auto run = [&](auto tag) {
    launch<decltype(tag)>(query, key_cache, value_cache, window_keys, window_values, sink_keys, sink_values,
                          block_tables, seq_lens, window_slots, sink_entries, block_size, window_blocks, sink_tokens,
                          scale, bits, out);
  };
  if (query.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
#endif
  return out;
}

namespace {

// A group's float16 (scale, minimum) as kv_format.py's _pairs makes them: the minimum rounded first,
// the scale then spanning up to the maximum from it, both kept in float16's range (and the scale at
// least its smallest normal).
inline void low_bit_pair(float low, float high, int levels, c10::Half& scale, c10::Half& minimum) {
  constexpr float kLimit = 65504.0f, kTiny = 6.103515625e-05f;
  minimum = c10::Half(std::clamp(low, -kLimit, kLimit));
  scale = c10::Half(std::clamp((high - static_cast<float>(minimum)) / static_cast<float>(levels), kTiny, kLimit));
}

constexpr int kKeyClipSteps = 4;  // kv_format.py's _KEY_CLIP_STEPS

// Each channel's pair over a block of keys x [block][dim] (float32) as kv_format.py's _key_pairs chooses
// it: of its range with the low end moved in by a and the high end by b parts of 2^(bits + 2) of it,
// candidate a * kKeyClipSteps + b, the first with the least squared error. 8 channels at a time; every
// product rounded before its sum (GCC would otherwise fuse multiply-adds, even across statements), the
// float16 roundings by F16C (to nearest even, as c10::Half and torch round), the sums token by token,
// so both keep the same pair.
__attribute__((optimize("fp-contract=off"))) void key_pairs(const float* x, int64_t block, int64_t dim,
                                                             int bits, c10::Half* scales, c10::Half* minimums) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const float part = 1.0f / static_cast<float>(1 << (bits + 2));
  const __m256 top = _mm256_set1_ps(static_cast<float>((1 << bits) - 1)), zero = _mm256_setzero_ps();
  const __m256 limit = _mm256_set1_ps(65504.0f), lowest = _mm256_set1_ps(-65504.0f);
  const __m256 tiny = _mm256_set1_ps(6.103515625e-05f);  // float16's smallest normal
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  for (int64_t d = 0; d < dim; d += 8) {
    __m256 low = _mm256_loadu_ps(x + d), high = low;
    for (int64_t t = 1; t < block; ++t) {
      const __m256 value = _mm256_loadu_ps(x + t * dim + d);
      low = _mm256_min_ps(value, low);
      high = _mm256_max_ps(value, high);
    }
    const __m256 span = _mm256_min_ps(_mm256_sub_ps(high, low), largest);  // an infinite key: no 0 * inf
    __m256 best = zero;
    __m128i best_scale = _mm_setzero_si128(), best_minimum = _mm_setzero_si128();
    for (int a = 0; a < kKeyClipSteps; ++a)
      for (int b = 0; b < kKeyClipSteps; ++b) {
        const __m256 moved_low = _mm256_add_ps(low, _mm256_mul_ps(_mm256_set1_ps(a * part), span));
        const __m256 moved_high = _mm256_sub_ps(high, _mm256_mul_ps(_mm256_set1_ps(b * part), span));
        // low_bit_pair: the minimum rounded first, the scale spanning up to the moved maximum from it
        const __m128i minimum = _mm256_cvtps_ph(_mm256_min_ps(_mm256_max_ps(moved_low, lowest), limit), kNearest);
        const __m256 start = _mm256_cvtph_ps(minimum);
        const __m256 quotient = _mm256_div_ps(_mm256_sub_ps(moved_high, start), top);
        const __m128i scale = _mm256_cvtps_ph(_mm256_min_ps(_mm256_max_ps(quotient, tiny), limit), kNearest);
        const __m256 step = _mm256_cvtph_ps(scale);
        __m256 total = zero;
        for (int64_t t = 0; t < block; ++t) {
          const __m256 value = _mm256_loadu_ps(x + t * dim + d);
          const __m256 code = _mm256_min_ps(
              _mm256_max_ps(_mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(value, start), step), kNearest), zero), top);
          const __m256 error = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(code, step), start), value);
          total = _mm256_add_ps(total, _mm256_mul_ps(error, error));
        }
        const __m256 better = (a == 0 && b == 0) ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                                                 : _mm256_cmp_ps(total, best, _CMP_LT_OQ);
        const __m256i lanes = _mm256_castps_si256(better);
        const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
        best = _mm256_blendv_ps(best, total, better);
        best_scale = _mm_blendv_epi8(best_scale, scale, halves);
        best_minimum = _mm_blendv_epi8(best_minimum, minimum, halves);
      }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + d), best_scale);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(minimums + d), best_minimum);
  }
}

// Codes of 8 elements against per-lane (start, step) into row bytes (zeroed before), from bit d * bits on:
// round((x - start) / step) kept in 0..levels, as kv_format.py's _codes computes them.
inline void pack_codes8(__m256 x, __m256 start, __m256 step, __m256 top, uint8_t* row, int64_t d, int bits) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 code = _mm256_min_ps(
      _mm256_max_ps(_mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(x, start), step), kNearest), _mm256_setzero_ps()),
      top);
  alignas(32) int32_t codes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(codes), _mm256_cvtps_epi32(code));
  for (int i = 0; i < 8; ++i) row[(d + i) * bits / 8] |= static_cast<uint8_t>(codes[i] << (((d + i) * bits) % 8));
}

template <typename T>
void quantize_blocks(const T* keys, const T* values, uint8_t* key_rows, uint8_t* value_rows, int64_t blocks,
                     int64_t block, int64_t heads, int64_t dim, int bits) {
  const int levels = (1 << bits) - 1;
  const int64_t code_bytes = dim * bits / 8, row = code_bytes + dim / 8;
  const __m256 top = _mm256_set1_ps(static_cast<float>(levels));
  at::parallel_for(0, blocks * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<c10::Half> scales(dim), minimums(dim);
    std::vector<float> block_keys(block * dim), value_row_floats(dim), steps(dim), starts(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / heads, h = item % heads;
      auto at = [&](int64_t t, int64_t d) { return ((n * block + t) * heads + h) * dim + d; };
      auto out = [&](uint8_t* rows, int64_t t) { return rows + ((n * block + t) * heads + h) * row; };
      for (int64_t t = 0; t < block; ++t)  // keys: per channel over the block
        for (int64_t d = 0; d < dim; ++d) block_keys[t * dim + d] = static_cast<float>(keys[at(t, d)]);
      key_pairs(block_keys.data(), block, dim, bits, scales.data(), minimums.data());
      for (int64_t d = 0; d < dim; ++d) {
        steps[d] = static_cast<float>(scales[d]);
        starts[d] = static_cast<float>(minimums[d]);
      }
      for (int64_t t = 0; t < block; ++t) {
        uint8_t* key_row = out(key_rows, t);
        std::fill(key_row, key_row + code_bytes, 0);
        for (int64_t d = 0; d < dim; d += 8)
          pack_codes8(_mm256_loadu_ps(&block_keys[t * dim + d]), _mm256_loadu_ps(&starts[d]),
                      _mm256_loadu_ps(&steps[d]), top, key_row, d, bits);
        const int64_t per_row = dim / block;  // row t carries channels [t * per_row, (t + 1) * per_row)'s pairs
        for (int64_t i = 0; i < per_row; ++i) {
          std::memcpy(key_row + code_bytes + 4 * i, &scales[t * per_row + i], 2);
          std::memcpy(key_row + code_bytes + 4 * i + 2, &minimums[t * per_row + i], 2);
        }
        uint8_t* value_row = out(value_rows, t);  // values: per row, groups of 32 channels
        std::fill(value_row, value_row + code_bytes, 0);
        float* x = value_row_floats.data();
        for (int64_t d = 0; d < dim; ++d) x[d] = static_cast<float>(values[at(t, d)]);
        for (int64_t g = 0; g < dim / 32; ++g) {
          float* group = x + 32 * g;
          __m256 low = _mm256_loadu_ps(group), high = low;
          for (int64_t i = 8; i < 32; i += 8) {
            low = _mm256_min_ps(_mm256_loadu_ps(group + i), low);
            high = _mm256_max_ps(_mm256_loadu_ps(group + i), high);
          }
          alignas(32) float lows[8], highs[8];
          _mm256_store_ps(lows, low);
          _mm256_store_ps(highs, high);
          c10::Half scale, minimum;
          low_bit_pair(*std::min_element(lows, lows + 8), *std::max_element(highs, highs + 8), levels, scale, minimum);
          const __m256 step = _mm256_set1_ps(static_cast<float>(scale)), start = _mm256_set1_ps(static_cast<float>(minimum));
          for (int64_t i = 0; i < 32; i += 8) pack_codes8(_mm256_loadu_ps(group + i), start, step, top, value_row, 32 * g + i, bits);
          std::memcpy(value_row + code_bytes + 4 * g, &scale, 2);
          std::memcpy(value_row + code_bytes + 4 * g + 2, &minimum, 2);
        }
      }
    }
  });
}

}  // namespace

// keys, values [blocks, block, kv_heads, D] float32 or bf16 (contiguous) -> (key rows, value rows)
// [blocks, block, kv_heads, D * bits / 8 + D / 8] uint8, byte for byte as kv_format.py's
// quantize_key_blocks and quantize_values make them.
std::vector<at::Tensor> quantize_low_bit_blocks(at::Tensor keys, at::Tensor values, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 2, "bits must be 4 or 2");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.scalar_type() == values.scalar_type(),
              "keys and values must be [blocks, block, kv_heads, head_dim] alike");
  TORCH_CHECK(keys.size(1) == 32, "a block must hold 32 tokens: a key row carries head_dim / 32 channels' pairs");
  TORCH_CHECK(keys.size(3) % 32 == 0, "head_dim must be a multiple of 32");
  auto k = keys.contiguous(), v = values.contiguous();
  const int64_t dim = k.size(3);
  auto options = k.options().dtype(at::kByte);
  auto key_rows = at::empty({k.size(0), k.size(1), k.size(2), dim * bits / 8 + dim / 8}, options);
  auto value_rows = at::empty_like(key_rows);
  if (k.scalar_type() == at::kFloat) {
    quantize_blocks(k.data_ptr<float>(), v.data_ptr<float>(), key_rows.data_ptr<uint8_t>(), value_rows.data_ptr<uint8_t>(),
                    k.size(0), k.size(1), k.size(2), dim, static_cast<int>(bits));
  } else {
    TORCH_CHECK(k.scalar_type() == at::kBFloat16, "keys and values must be float32 or bf16");
    quantize_blocks(k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), key_rows.data_ptr<uint8_t>(),
                    value_rows.data_ptr<uint8_t>(), k.size(0), k.size(1), k.size(2), dim, static_cast<int>(bits));
  }
  return {key_rows, value_rows};
}
