// The LoRA deltas of a step's rows, every adapter in one call (Punica's BGMV on the CPU): for each row t
// whose slot s = token_slots[t] is not negative, out[t] += (A[s] x[t]) Bt[s], shrink then expand.
//
// A stacks each slot's down-projection [W, in] and Bt each slot's up-projection transposed [W, out]
// (lora/weights.py), so both steps stream contiguous rows: dot products of x with A's rows, then
// multiply-adds of Bt's rows into float32 accumulators of the output rows. Rows are grouped by slot and
// taken up to 8 at a time (4 with AVX2), each load of A's and Bt's rows serving them all; of a fused
// layer's B (block-diagonal: shard p's rank columns feed only shard p's output rows) only the blocks are
// read, and columns past the slot's width are skipped. float32 arithmetic (bf16 widened exactly; a bf16
// adapter's shrink rounded to bf16 before the expand, as PEFT's bf16 modules round lora_A's output), the
// delta rounded once as it joins the output row; each row sums in one order whatever else the step
// holds (batch invariant). Where the level has AVX-512 the same loops run 16 lanes wide (the shrink only
// for inputs in whole vectors of 16, a fixed choice per layer), and with AVX-512 BF16 a bf16 adapter's
// products go by pairs (vdpbf16ps). Tiles are shared among torch's threads when there are enough; a
// step's only tile is split among them (its columns, then its output rows); inside the decode stack's
// region each thread shrinks its share of the columns and expands the rows it wrote (lora_shrink_part).
#include "aten.h"

#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "vector_math.h"

constexpr int64_t kMaxWidth = LoraExchange::kMaxWidth;

void lora_check_stacks(const at::Tensor& a, const at::Tensor& bt, const at::Tensor& widths,
                       const at::Tensor& shard_starts, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(a.scalar_type() == bt.scalar_type() && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_delta takes a and bt of one dtype, float32 or bfloat16");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous(),
              "a and bt must be contiguous [slots, width, features]");
  TORCH_CHECK(a.size(0) == bt.size(0) && a.size(1) == bt.size(1) && a.size(2) == in_features &&
                  bt.size(2) == out_features,
              "a must be [slots, width, in] and bt [slots, width, out] of x's and out's features");
  TORCH_CHECK(a.size(1) <= kMaxWidth, "lora_delta takes widths (rank times shards) up to ", kMaxWidth);
  TORCH_CHECK(widths.scalar_type() == at::kLong && widths.dim() == 1 && widths.is_contiguous() &&
                  widths.size(0) == a.size(0),
              "widths must be a contiguous int64 tensor with one width per slot");
  TORCH_CHECK(shard_starts.scalar_type() == at::kLong && shard_starts.dim() == 1 &&
                  shard_starts.is_contiguous() && shard_starts.size(0) >= 2,
              "shard_starts must be a contiguous int64 tensor of the shards' first rows and out_features");
  const int64_t shards = shard_starts.size(0) - 1;
  const int64_t* starts = shard_starts.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[shards] == out_features, "shard_starts must run from 0 to out_features");
  for (int64_t p = 0; p <= shards; ++p)
    TORCH_CHECK(starts[p] % 8 == 0 && (p == 0 || starts[p] >= starts[p - 1]),
                "lora_delta needs shard starts that are rising multiples of 8");
  TORCH_CHECK(in_features % 8 == 0, "lora_delta needs feature counts that are multiples of 8");
}

void lora_check_step(const at::Tensor& a, const at::Tensor& widths, int64_t shards, const at::Tensor& token_slots,
                     int64_t rows) {
  const int64_t* width_data = widths.data_ptr<int64_t>();
  for (int64_t s = 0; s < widths.size(0); ++s)
    TORCH_CHECK(width_data[s] >= 0 && width_data[s] <= a.size(1) && width_data[s] % shards == 0,
                "a slot's width must be within [0, W], its rank times the shards");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.dim() == 1 && token_slots.size(0) == rows &&
                  token_slots.is_contiguous(),
              "token_slots must be a contiguous int64 tensor with one slot per row");
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(slots[t] < a.size(0), "token slot ", slots[t], " out of range");
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kParallelWork = 1 << 16;  // multiply-adds a thread hand-off pays for
// rows of one slot sharing each load of A's and Bt's rows: as many as the registers hold beside their
// chains (32 vector registers with AVX-512, 16 with AVX2)
#if defined(__AVX512F__) && defined(__AVX512DQ__)
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 4;
#endif
constexpr int64_t kSplitWork = 1 << 12;      // a lone tile's multiply-adds below which it stays on one thread
// How far ahead of its block the expand prefetches each row of Bt it reads, in outputs (past a row's end
// it fetches the next row's start; a prefetch never faults)
constexpr int64_t kExpandAhead = 128;

struct Tile {
  int64_t slot, first, count;  // rows order[first, first + count), all of `slot`
};

// The rows with an adapter grouped by slot (a stable counting sort: each row keeps its place among its
// slot's), cut into tiles of at most kTileRows.
void tiles_by_slot(const int64_t* slots, const int64_t* widths, int64_t rows, int64_t num_slots,
                   std::vector<int64_t>& order, std::vector<Tile>& tiles) {
  std::vector<int64_t> starts(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0 && widths[slots[t]] > 0) ++starts[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) starts[s + 1] += starts[s];
  order.resize(starts[num_slots]);
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0 && widths[slots[t]] > 0) order[next[slots[t]]++] = t;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t first = starts[s]; first < starts[s + 1]; first += kTileRows)
      tiles.push_back({s, first, std::min<int64_t>(kTileRows, starts[s + 1] - first)});
}

template <typename T>
struct Problem {
  const T *x, *a, *bt;
  T* out;
  int64_t in, out_features, width, x_stride, out_stride;
  const int64_t* shard_starts;  // output rows of shard p: [shard_starts[p], shard_starts[p + 1])
  int64_t shards;
};

// float32 vectors of 8 lanes (AVX2) or 16 (AVX-512), loaded from and stored to float32 or bf16.
struct Lanes8 {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) { return horizontal_sum8(v); }
  template <typename T>
  static V load(const T* p) { return load8(p); }
  template <typename T>
  static void store(T* p, V v) { store8(p, v); }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define LLMSERVE_LORA_16_LANES 1
struct Lanes16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  template <typename T>
  static void store(T* p, V v) {
    store8(p, _mm512_castps512_ps256(v));
    store8(p + 8, _mm512_extractf32x8_ps(v, 1));
  }
};
#endif

// Chains side by side for N rows (columns in the shrink, output vectors in the expand): as many as the
// registers hold (16 with AVX2, 32 with AVX-512), N x chains accumulators beside N row operands and one
// weight vector. More independent chains than the FMA latency needs keep more loads in flight.
template <typename L, int N>
constexpr int chains() {
  if constexpr (L::kWidth == 16) return N == 1 ? 8 : N == 2 ? 6 : N <= 4 ? 4 : 2;
  return N == 1 ? 8 : N == 2 ? 4 : 2;  // N > 4 only where AVX-512 gives 32 registers
}

// A shrink's sum as the expand takes it: rounded to bf16 where the adapter is bf16 (as PEFT's bf16
// modules round lora_A's output), as it is in float32.
template <typename T>
inline float hidden_value(float sum) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return static_cast<float>(c10::BFloat16(sum));
  return sum;
}

// hidden[r][c..c + C) = A[s][c..c + C) . x[row r]: N x C dot products side by side (independent chains
// that fill the FMA pipes), each summed L::kWidth lanes at a time over k in order, whatever N and C are
// (a layer always takes one lane count: 16 where the level has AVX-512 and its inputs fill them).
template <typename L, typename T, int N, int C>
void shrink_columns(const Problem<T>& pb, const T* const* x_rows, const T* a_slot, int64_t c,
                    float (*hidden)[kMaxWidth]) {
  typename L::V acc[N][C];
  LLMSERVE_UNROLL for (int r = 0; r < N; ++r) LLMSERVE_UNROLL for (int i = 0; i < C; ++i) acc[r][i] = L::zero();
  for (int64_t k = 0; k < pb.in; k += L::kWidth) {
    typename L::V xv[N];
    LLMSERVE_UNROLL for (int r = 0; r < N; ++r) xv[r] = L::load(x_rows[r] + k);
    LLMSERVE_UNROLL for (int i = 0; i < C; ++i) {
      const typename L::V av = L::load(a_slot + (c + i) * pb.in + k);
      LLMSERVE_UNROLL for (int r = 0; r < N; ++r) acc[r][i] = L::fma(av, xv[r], acc[r][i]);
    }
  }
  LLMSERVE_UNROLL for (int r = 0; r < N; ++r) LLMSERVE_UNROLL for (int i = 0; i < C; ++i) hidden[r][c + i] =
      hidden_value<T>(L::sum(acc[r][i]));
}

// out[row r][j..j + W J) += sum over columns c in [first, last) of hidden[r][c] Bt[s][c][j..j + W J), W
// = L::kWidth, in c order: N x J chains side by side, each output's sum the same chain of FMAs whatever
// N, J and the lane count are (bit for bit).
template <typename L, typename T, int N, int J>
void expand_block(const Problem<T>& pb, T* const* out_rows, const T* bt_slot, int64_t first, int64_t last,
                  int64_t j, const float (*hidden)[kMaxWidth]) {
  typename L::V acc[N][J];
  LLMSERVE_UNROLL for (int r = 0; r < N; ++r) LLMSERVE_UNROLL for (int i = 0; i < J; ++i) acc[r][i] = L::zero();
  for (int64_t c = first; c < last; ++c) {
    const T* b_row = bt_slot + c * pb.out_features + j;
    _mm_prefetch(reinterpret_cast<const char*>(b_row + kExpandAhead), _MM_HINT_T0);  // as expand_block_pairs
    LLMSERVE_UNROLL for (int i = 0; i < J; ++i) {
      const typename L::V bv = L::load(b_row + L::kWidth * i);
      LLMSERVE_UNROLL for (int r = 0; r < N; ++r) acc[r][i] = L::fma(L::set1(hidden[r][c]), bv, acc[r][i]);
    }
  }
  LLMSERVE_UNROLL for (int r = 0; r < N; ++r) LLMSERVE_UNROLL for (int i = 0; i < J; ++i) {
    T* o = out_rows[r] + j + L::kWidth * i;
    L::store(o, L::add(L::load(o), acc[r][i]));
  }
}

// Columns [c, end) of N rows' shrink, chains<L, N>() side by side, then one at a time.
template <typename L, typename T, int N>
void shrink_range(const Problem<T>& pb, const T* const* x_rows, const T* a_slot, int64_t c, int64_t end,
                  float (*hidden)[kMaxWidth]) {
  constexpr int kChains = chains<L, N>();
  for (; c + kChains <= end; c += kChains) shrink_columns<L, T, N, kChains>(pb, x_rows, a_slot, c, hidden);
  for (; c < end; ++c) shrink_columns<L, T, N, 1>(pb, x_rows, a_slot, c, hidden);
}

#if defined(LLMSERVE_LORA_16_LANES) && defined(__AVX512BF16__)
#define LLMSERVE_LORA_BF16_PAIRS 1
// shrink_columns of bf16 inputs by pairs (vdpbf16ps: each of 16 lanes adds the exact products of its
// pair of k, the odd one's first, as two chained FMAs would, denormals as zero): one instruction for 32
// multiply-adds and no widening of x's or A's elements. Inputs in whole vectors of 32.
template <int N, int C>
void shrink_columns_pairs(const Problem<c10::BFloat16>& pb, const c10::BFloat16* const* x_rows,
                          const c10::BFloat16* a_slot, int64_t c, float (*hidden)[kMaxWidth]) {
  __m512 acc[N][C];
  LLMSERVE_UNROLL for (int r = 0; r < N; ++r) LLMSERVE_UNROLL for (int i = 0; i < C; ++i) acc[r][i] =
      _mm512_setzero_ps();
  for (int64_t k = 0; k < pb.in; k += 32) {
    __m512bh xv[N];
    LLMSERVE_UNROLL for (int r = 0; r < N; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(x_rows[r] + k);
    LLMSERVE_UNROLL for (int i = 0; i < C; ++i) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(a_slot + (c + i) * pb.in + k);
      LLMSERVE_UNROLL for (int r = 0; r < N; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], av, xv[r]);
    }
  }
  LLMSERVE_UNROLL for (int r = 0; r < N; ++r) LLMSERVE_UNROLL for (int i = 0; i < C; ++i) hidden[r][c + i] =
      hidden_value<c10::BFloat16>(_mm512_reduce_add_ps(acc[r][i]));
}

template <int N>
void shrink_range_pairs(const Problem<c10::BFloat16>& pb, const c10::BFloat16* const* x_rows,
                        const c10::BFloat16* a_slot, int64_t c, int64_t end, float (*hidden)[kMaxWidth]) {
  constexpr int kChains = chains<Lanes16, N>();
  for (; c + kChains <= end; c += kChains) shrink_columns_pairs<N, kChains>(pb, x_rows, a_slot, c, hidden);
  for (; c < end; ++c) shrink_columns_pairs<N, 1>(pb, x_rows, a_slot, c, hidden);
}
#endif

// The slot's columns [begin, end) of N rows' shrink: bf16 pairs where the level has them (vdpbf16ps)
// and the inputs fill vectors of 32, else 16 lanes where the level has them and the inputs fill them,
// else 8 (a fixed choice per layer).
template <typename T, int N>
void shrink(const Problem<T>& pb, const T* const* x_rows, const T* a_slot, int64_t begin, int64_t end,
            float (*hidden)[kMaxWidth]) {
#ifdef LLMSERVE_LORA_BF16_PAIRS
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (pb.in % 32 == 0) return shrink_range_pairs<N>(pb, x_rows, a_slot, begin, end, hidden);
#endif
#ifdef LLMSERVE_LORA_16_LANES
  if (pb.in % 16 == 0) return shrink_range<Lanes16, T, N>(pb, x_rows, a_slot, begin, end, hidden);
#endif
  shrink_range<Lanes8, T, N>(pb, x_rows, a_slot, begin, end, hidden);
}

// Output rows [j, end) of N rows' expand in blocks of L::kWidth (chains<L, N>() side by side); returns
// where it stopped (the rest is less than one vector of L).
template <typename L, typename T, int N>
int64_t expand_rows(const Problem<T>& pb, T* const* out_rows, const T* bt_slot, int64_t first, int64_t last,
                    int64_t j, int64_t end, const float (*hidden)[kMaxWidth]) {
  constexpr int kChains = chains<L, N>();
  for (; j + L::kWidth * kChains <= end; j += L::kWidth * kChains)
    expand_block<L, T, N, kChains>(pb, out_rows, bt_slot, first, last, j, hidden);
  for (; j + L::kWidth <= end; j += L::kWidth) expand_block<L, T, N, 1>(pb, out_rows, bt_slot, first, last, j, hidden);
  return j;
}

#ifdef LLMSERVE_LORA_BF16_PAIRS
// expand_block of a bf16 adapter by pairs of columns (vdpbf16ps): rows c and c + 1 of Bt interleaved
// into one vector of 16 outputs' pairs, each row's (hidden[c], hidden[c + 1]) broadcast (the hidden
// values are bf16 already: hidden_value), one instruction for 32 multiply-adds. An odd last column pairs
// with zeros. Each output's sum runs over the pairs in c order (each pair's odd column first, as the
// instruction adds them) whatever N and J are.
template <int N, int J>
void expand_block_pairs(const Problem<c10::BFloat16>& pb, c10::BFloat16* const* out_rows,
                        const c10::BFloat16* bt_slot, int64_t first, int64_t last, int64_t j,
                        const uint32_t (*pairs)[kMaxWidth / 2]) {
  // word 2m of the result is word m of the first operand, word 2m + 1 word m of the second
  alignas(64) static constexpr uint16_t kInterleave[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                            37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                            11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  __m512 acc[N][J];
  LLMSERVE_UNROLL for (int r = 0; r < N; ++r) LLMSERVE_UNROLL for (int i = 0; i < J; ++i) acc[r][i] =
      _mm512_setzero_ps();
  for (int64_t c = first; c < last; c += 2) {
    const c10::BFloat16* row = bt_slot + c * pb.out_features + j;
    // the same rows' next blocks, a few ahead: one stream per row of B, more than the hardware follows
    _mm_prefetch(reinterpret_cast<const char*>(row + kExpandAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + pb.out_features + kExpandAhead), _MM_HINT_T0);
    __m512bh bv[J];
    LLMSERVE_UNROLL for (int i = 0; i < J; ++i) {
      const __m512i low = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * i)));
      const __m512i high = c + 1 < last ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                              reinterpret_cast<const __m256i*>(row + pb.out_features + 16 * i)))
                                        : _mm512_setzero_si512();
      bv[i] = (__m512bh)_mm512_permutex2var_epi16(low, interleave, high);
    }
    LLMSERVE_UNROLL for (int r = 0; r < N; ++r) {
      const __m512bh h = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][(c - first) / 2]));
      LLMSERVE_UNROLL for (int i = 0; i < J; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], bv[i], h);
    }
  }
  LLMSERVE_UNROLL for (int r = 0; r < N; ++r) LLMSERVE_UNROLL for (int i = 0; i < J; ++i) {
    c10::BFloat16* o = out_rows[r] + j + 16 * i;
    Lanes16::store(o, _mm512_add_ps(Lanes16::load(o), acc[r][i]));
  }
}

// Output rows [j, end) of N rows' expand by pairs in blocks of 16 (chains<Lanes16, N>() side by side);
// returns where it stopped.
template <int N>
int64_t expand_rows_pairs(const Problem<c10::BFloat16>& pb, c10::BFloat16* const* out_rows,
                          const c10::BFloat16* bt_slot, int64_t first, int64_t last, int64_t j, int64_t end,
                          const float (*hidden)[kMaxWidth]) {
  uint32_t pairs[N][kMaxWidth / 2];  // each row's hidden values of columns [first, last), two by two
  for (int r = 0; r < N; ++r)
    for (int64_t c = first; c < last; c += 2)
      pairs[r][(c - first) / 2] =
          c10::BFloat16(hidden[r][c]).x | (c + 1 < last ? uint32_t{c10::BFloat16(hidden[r][c + 1]).x} << 16 : 0u);
  constexpr int kChains = chains<Lanes16, N>();
  for (; j + 16 * kChains <= end; j += 16 * kChains)
    expand_block_pairs<N, kChains>(pb, out_rows, bt_slot, first, last, j, pairs);
  for (; j + 16 <= end; j += 16) expand_block_pairs<N, 1>(pb, out_rows, bt_slot, first, last, j, pairs);
  return j;
}
#endif

// Output rows [begin, end) of shard p (B is block-diagonal: only its rank columns feed them, the other
// columns are zeros there, never read): bf16 pairs where the level has them (vdpbf16ps) and the shard
// starts on a multiple of 16, else 16 lanes where the level has them, then 8. Pairs sum in another order
// than single lanes, so each output must take the same one whatever range a call covers: a caller's range
// starts at the shard's start, at a multiple of 32 (a thread's rows in the stack's region) or a multiple
// of 16 past the shard's start (split_tile's shares), which on a shard starting at a multiple of 16 puts
// every output in the same block of 16.
template <typename T, int N>
void expand_shard(const Problem<T>& pb, T* const* out_rows, const T* bt_slot, int64_t p, int64_t rank,
                  int64_t begin, int64_t end, const float (*hidden)[kMaxWidth]) {
#ifdef LLMSERVE_LORA_BF16_PAIRS
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (pb.shard_starts[p] % 16 == 0)
      begin = expand_rows_pairs<N>(pb, out_rows, bt_slot, p * rank, (p + 1) * rank, begin, end, hidden);
#endif
#ifdef LLMSERVE_LORA_16_LANES
  begin = expand_rows<Lanes16, T, N>(pb, out_rows, bt_slot, p * rank, (p + 1) * rank, begin, end, hidden);
#endif
  expand_rows<Lanes8, T, N>(pb, out_rows, bt_slot, p * rank, (p + 1) * rank, begin, end, hidden);
}

// A tile's N rows: where each reads x and adds to out.
template <typename T, int N>
struct TileRows {
  const T* x[N];
  T* out[N];
  TileRows(const Problem<T>& pb, const int64_t* rows) {
    for (int r = 0; r < N; ++r) {
      x[r] = pb.x + rows[r] * pb.x_stride;
      out[r] = pb.out + rows[r] * pb.out_stride;
    }
  }
};

// One tile of N rows of one slot: the shrink for the slot's columns, then each shard's output rows.
template <typename T, int N>
void run_tile(const Problem<T>& pb, const int64_t* rows, int64_t slot, int64_t used) {
  const TileRows<T, N> tile(pb, rows);
  float hidden[N][kMaxWidth];
  shrink<T, N>(pb, tile.x, pb.a + slot * pb.width * pb.in, 0, used, hidden);
  const T* bt_slot = pb.bt + slot * pb.width * pb.out_features;
  for (int64_t p = 0; p < pb.shards; ++p)
    expand_shard<T, N>(pb, tile.out, bt_slot, p, used / pb.shards, pb.shard_starts[p], pb.shard_starts[p + 1],
                       hidden);
}

// The L2 prefetch of bytes [p, p + bytes): a lone tile's reads are too short for the hardware's stream
// prefetchers to reach full speed before they end.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

// run(std::integral_constant<int, N>) for a tile of `count` rows, 1 <= count <= kTileRows.
template <typename Run>
void by_count(int64_t count, const Run& run) {
  switch (count) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    case 8: return run(std::integral_constant<int, 8>{});
    case 7: return run(std::integral_constant<int, 7>{});
    case 6: return run(std::integral_constant<int, 6>{});
    case 5: return run(std::integral_constant<int, 5>{});
#endif
    case 4: return run(std::integral_constant<int, 4>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 2: return run(std::integral_constant<int, 2>{});
    default: return run(std::integral_constant<int, 1>{});
  }
}

// A step's only tile (batch 1, or a few rows of one adapter) shared by `threads`: thread i shrinks its
// share of the slot's columns, then, after a barrier, expands all of them into its share of each shard's
// output rows. Every column's and output's sum is the one run_tile computes (same chains, same order).
template <typename T, int N>
void split_tile(const Problem<T>& pb, const int64_t* rows, int64_t slot, int64_t used, int threads) {
  const int64_t rank = used / pb.shards;
  const TileRows<T, N> tile(pb, rows);
  float hidden[N][kMaxWidth];
  const T* a_slot = pb.a + slot * pb.width * pb.in;
  const T* bt_slot = pb.bt + slot * pb.width * pb.out_features;
#pragma omp parallel num_threads(threads)
  {
    const int64_t thread = omp_get_thread_num(), count = omp_get_num_threads();
    const int64_t c_begin = used * thread / count, c_end = used * (thread + 1) / count;
    prefetch_bytes(a_slot + c_begin * pb.in, (c_end - c_begin) * pb.in * static_cast<int64_t>(sizeof(T)));
    // this thread's output rows of shard p: whole vectors of 16, the last thread the rest
    const auto share = [&](int64_t p) {
      const int64_t start = pb.shard_starts[p], vectors = (pb.shard_starts[p + 1] - start) / 16;
      return std::pair<int64_t, int64_t>{start + 16 * (vectors * thread / count),
                                         thread + 1 == count ? pb.shard_starts[p + 1]
                                                             : start + 16 * (vectors * (thread + 1) / count)};
    };
    shrink<T, N>(pb, tile.x, a_slot, c_begin, c_end, hidden);
    for (int64_t p = 0; p < pb.shards; ++p) {
      const auto [begin, end] = share(p);
      for (int64_t c = p * rank; c < (p + 1) * rank; ++c)
        prefetch_bytes(bt_slot + c * pb.out_features + begin, (end - begin) * static_cast<int64_t>(sizeof(T)));
    }
#pragma omp barrier
    for (int64_t p = 0; p < pb.shards; ++p) {
      const auto [begin, end] = share(p);
      expand_shard<T, N>(pb, tile.out, bt_slot, p, rank, begin, end, hidden);
    }
  }
}

template <typename T>
void lora_tiles(const Problem<T>& pb, const int64_t* widths, const std::vector<int64_t>& order,
                const std::vector<Tile>& tiles) {
  // multiply-adds of one row and one of a slot's columns: its shrink's dot product, its expand's row of B
  const int64_t per_column = pb.in + pb.out_features / std::max<int64_t>(1, pb.shards);
  const int64_t tile_max = kTileRows * pb.width * per_column;  // a whole tile's, the widest slot's
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, tile_max));
  // at most one thread per column: the shrink's share of a thread is its columns
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), widths[tiles[0].slot]));
  const int64_t tile_work = tiles[0].count * widths[tiles[0].slot] * per_column;
  if (tiles.size() == 1 && threads > 1 && tile_work >= kSplitWork && !at::in_parallel_region()) {
    const Tile& tile = tiles[0];
    const int64_t* rows = order.data() + tile.first;
    const int64_t used = widths[tile.slot];
    by_count(tile.count, [&](auto n) { split_tile<T, decltype(n)::value>(pb, rows, tile.slot, used, threads); });
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tile = tiles[i];
      const int64_t* rows = order.data() + tile.first;
      const int64_t used = widths[tile.slot];
      by_count(tile.count, [&](auto n) { run_tile<T, decltype(n)::value>(pb, rows, tile.slot, used); });
    }
  });
}

// A region's step has at most LoraExchange::kMaxRows rows: its tiles without the heap (the calls run
// twice per projection per layer on every thread).
struct RegionTiles {
  int64_t order[LoraExchange::kMaxRows];
  Tile tiles[LoraExchange::kMaxRows];
  int64_t count = 0;
  RegionTiles(const int64_t* slots, const int64_t* widths, int64_t rows) {
    bool placed[LoraExchange::kMaxRows] = {};
    int64_t next = 0;
    for (int64_t t = 0; t < rows; ++t) {  // each slot's rows in order, by first appearance
      if (placed[t] || slots[t] < 0 || widths[slots[t]] <= 0) continue;
      for (int64_t u = t; u < rows; ++u) {
        if (placed[u] || slots[u] != slots[t]) continue;
        if (count == 0 || tiles[count - 1].slot != slots[t] || tiles[count - 1].count == kTileRows)
          tiles[count++] = {slots[t], next, 0};
        placed[u] = true;
        order[next++] = u;
        ++tiles[count - 1].count;
      }
    }
  }
};


// This thread's share of every tile's columns (as split_tile shares them) into the hidden rows of the
// tile's places in the order.
template <typename T>
void shrink_share(const Problem<T>& pb, const int64_t* widths, const RegionTiles& plan, int64_t thread,
                  int64_t threads, float (*hidden)[kMaxWidth]) {
  for (int64_t i = 0; i < plan.count; ++i) {
    const Tile& tile = plan.tiles[i];
    const int64_t used = widths[tile.slot];
    const int64_t begin = used * thread / threads, end = used * (thread + 1) / threads;
    if (begin == end) continue;
    by_count(tile.count, [&](auto n) {
      constexpr int N = decltype(n)::value;
      const T* x[N];
      for (int r = 0; r < N; ++r) x[r] = pb.x + plan.order[tile.first + r] * pb.x_stride;
      shrink<T, N>(pb, x, pb.a + tile.slot * pb.width * pb.in, begin, end, hidden + tile.first);
    });
  }
}

// Every tile's expand into the output rows [rows_begin, rows_end), each shard's part of them.
template <typename T>
void expand_share(const Problem<T>& pb, const int64_t* widths, const RegionTiles& plan, int64_t rows_begin,
                  int64_t rows_end, const float (*hidden)[kMaxWidth]) {
  for (int64_t i = 0; i < plan.count; ++i) {
    const Tile& tile = plan.tiles[i];
    const int64_t rank = widths[tile.slot] / pb.shards;
    by_count(tile.count, [&](auto n) {
      constexpr int N = decltype(n)::value;
      T* out[N];
      for (int r = 0; r < N; ++r) out[r] = pb.out + plan.order[tile.first + r] * pb.out_stride;
      const T* bt_slot = pb.bt + tile.slot * pb.width * pb.out_features;
      for (int64_t p = 0; p < pb.shards; ++p) {
        const int64_t begin = std::max(pb.shard_starts[p], rows_begin);
        const int64_t end = std::min(pb.shard_starts[p + 1], rows_end);
        if (begin < end) expand_shard<T, N>(pb, out, bt_slot, p, rank, begin, end, hidden + tile.first);
      }
    });
  }
}

}  // namespace

bool lora_delta_supported() { return true; }

// x [T, in] and out [T, out_features] (rows contiguous, any row stride), a [S, W, in] and bt [S, W,
// out_features] contiguous, all of one dtype (float32 or bf16); token_slots [T] int64 (-1: no adapter);
// widths [S] int64: the columns of W each slot uses, its rank times the layer's shards; shard_starts
// [shards + 1] int64: each shard's first output row (its B block's rows), the last out_features. in and
// every shard start multiples of 8, W at most kMaxWidth. out is updated in place.
void lora_delta(const at::Tensor& x, at::Tensor out, const at::Tensor& a, const at::Tensor& bt,
                const at::Tensor& token_slots, const at::Tensor& widths, const at::Tensor& shard_starts) {
  TORCH_CHECK(thread_share().threads == 0, "lora_delta inside a region: lora_shrink_part and lora_expand_part");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_delta takes float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dtype && a.scalar_type() == dtype && bt.scalar_type() == dtype,
              "lora_delta takes x, out, a and bt of one dtype");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "x and out must be [rows, features]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x's and out's rows must be contiguous");
  lora_check_stacks(a, bt, widths, shard_starts, x.size(1), out.size(1));
  const int64_t shards = shard_starts.size(0) - 1;
  const int64_t* starts = shard_starts.data_ptr<int64_t>();
  lora_check_step(a, widths, shards, token_slots, x.size(0));
  const int64_t* width_data = widths.data_ptr<int64_t>();
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  std::vector<int64_t> order;
  std::vector<Tile> tiles;
  tiles_by_slot(slots, width_data, x.size(0), a.size(0), order, tiles);
  if (tiles.empty()) return;
  if (dtype == at::kFloat) {
    const Problem<float> pb{x.data_ptr<float>(), a.data_ptr<float>(), bt.data_ptr<float>(), out.data_ptr<float>(),
                            x.size(1), out.size(1), a.size(1), x.stride(0), out.stride(0), starts, shards};
    lora_tiles(pb, width_data, order, tiles);
  } else {
    using B = c10::BFloat16;
    const Problem<B> pb{x.data_ptr<B>(), a.data_ptr<B>(), bt.data_ptr<B>(), out.data_ptr<B>(), x.size(1),
                        out.size(1), a.size(1), x.stride(0), out.stride(0), starts, shards};
    lora_tiles(pb, width_data, order, tiles);
  }
}

void lora_shrink_part(const at::Tensor& x, const at::Tensor& a, const at::Tensor& token_slots,
                      const at::Tensor& widths, int64_t call, LoraExchange& exchange) {
  const ThreadShare& share = thread_share();
  const RegionTiles plan(token_slots.data_ptr<int64_t>(), widths.data_ptr<int64_t>(), token_slots.size(0));
  float (*hidden)[kMaxWidth] = exchange.hidden[call & 1];
  if (x.scalar_type() == at::kFloat) {
    const Problem<float> pb{x.data_ptr<float>(), a.data_ptr<float>(), nullptr, nullptr, x.size(1), 0,
                            a.size(1), x.stride(0), 0, nullptr, 1};
    shrink_share(pb, widths.data_ptr<int64_t>(), plan, share.thread, share.threads, hidden);
  } else {
    using B = c10::BFloat16;
    const Problem<B> pb{x.data_ptr<B>(), a.data_ptr<B>(), nullptr, nullptr, x.size(1), 0, a.size(1), x.stride(0), 0,
                        nullptr, 1};
    shrink_share(pb, widths.data_ptr<int64_t>(), plan, share.thread, share.threads, hidden);
  }
  exchange.arrived.fetch_add(1, std::memory_order_release);
}

void lora_expand_part(at::Tensor& out, const at::Tensor& bt, const at::Tensor& token_slots,
                      const at::Tensor& widths, const at::Tensor& shard_starts, int64_t call,
                      LoraExchange& exchange) {
  const ThreadShare& share = thread_share();
  const RegionTiles plan(token_slots.data_ptr<int64_t>(), widths.data_ptr<int64_t>(), token_slots.size(0));
  if (plan.count == 0 || share.rows_end <= share.rows_begin) return;
  // every thread's columns of this call: long since written, as each shrinks before its linear part
  while (exchange.arrived.load(std::memory_order_acquire) < (call + 1) * share.threads) {
    if (exchange.failed != nullptr && exchange.failed->load(std::memory_order_relaxed))
      throw std::runtime_error("lora_expand_part: another thread of the region failed");
    _mm_pause();
  }
  const float(*hidden)[kMaxWidth] = exchange.hidden[call & 1];
  const int64_t shards = shard_starts.size(0) - 1;
  if (out.scalar_type() == at::kFloat) {
    const Problem<float> pb{nullptr, nullptr, bt.data_ptr<float>(), out.data_ptr<float>(), 0, out.size(1),
                            bt.size(1), 0, out.stride(0), shard_starts.data_ptr<int64_t>(), shards};
    expand_share(pb, widths.data_ptr<int64_t>(), plan, share.rows_begin, share.rows_end, hidden);
  } else {
    using B = c10::BFloat16;
    const Problem<B> pb{nullptr, nullptr, bt.data_ptr<B>(), out.data_ptr<B>(), 0, out.size(1), bt.size(1), 0,
                        out.stride(0), shard_starts.data_ptr<int64_t>(), shards};
    expand_share(pb, widths.data_ptr<int64_t>(), plan, share.rows_begin, share.rows_end, hidden);
  }
}

#else

bool lora_delta_supported() { return false; }

void lora_delta(const at::Tensor&, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "lora_delta needs a CPU with AVX2 and FMA");
}

void lora_shrink_part(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                      LoraExchange&) {
  TORCH_CHECK(false, "lora_shrink_part needs a CPU with AVX2 and FMA");
}

void lora_expand_part(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      int64_t, LoraExchange&) {
  TORCH_CHECK(false, "lora_expand_part needs a CPU with AVX2 and FMA");
}

#endif
