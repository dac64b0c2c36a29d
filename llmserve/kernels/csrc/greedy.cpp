// Greedy sampling: the index of each row's largest logit, the first of equal maxima as torch.argmax
// returns it, in one pass over the row in 16-float vectors (AVX-512) or 4 x 8 (AVX2), with rows (or parts
// of a row, when there are fewer rows than threads) shared among torch's threads.
//
// torch's CPU argmax reduces each row serially and does not share rows among threads, slowly in bf16,
// and the Sampler first copied the logits to float32; this reads them in place. A row holding NaN has no
// defined answer here (torch would return the NaN's index); finite and infinite logits match torch.
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vector_math.h"

namespace {

constexpr int64_t kMinPart = 8192;  // logits per work item when a row is split among threads

struct Best {
  float value;
  int64_t index;  // -1: nothing above -inf seen
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#elif defined(__AVX2__)
// AVX2: four independent sets of 8 lanes over 32 logits at a time (one compare-and-blend chain would
// wait on its own latency), each lane keeping its first maximum, as in the AVX-512 loop.
template <typename scalar_t>
inline void lanes_max(const scalar_t* row, int64_t& i, int64_t end, Best& best) {
  constexpr int kSets = 4;
  __m256 lane_max[kSets];
  __m256i lane_index[kSets], index[kSets];
  for (int s = 0; s < kSets; ++s) {
    lane_max[s] = _mm256_set1_ps(-INFINITY);
    lane_index[s] = _mm256_set1_epi32(-1);
    index[s] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i + 8 * s)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  const __m256i step = _mm256_set1_epi32(8 * kSets);
  for (; i + 8 * kSets <= end; i += 8 * kSets) {
    for (int s = 0; s < kSets; ++s) {
      const __m256 values = load8(row + i + 8 * s);
      const __m256 greater = _mm256_cmp_ps(values, lane_max[s], _CMP_GT_OQ);
      lane_max[s] = _mm256_blendv_ps(lane_max[s], values, greater);
      lane_index[s] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(lane_index[s]), _mm256_castsi256_ps(index[s]), greater));
      index[s] = _mm256_add_epi32(index[s], step);
    }
  }
  // each lane holds its first maximum; of the lanes at the overall maximum, the smallest index wins
  alignas(32) float values[8 * kSets];
  alignas(32) int32_t indices[8 * kSets];
  for (int s = 0; s < kSets; ++s) {
    _mm256_store_ps(values + 8 * s, lane_max[s]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices + 8 * s), lane_index[s]);
  }
  for (int lane = 0; lane < 8 * kSets; ++lane) {
    if (indices[lane] < 0) continue;
    if (values[lane] > best.value || (values[lane] == best.value && indices[lane] < best.index)) {
      best = {values[lane], indices[lane]};
    }
  }
}
#endif

// The largest value in row[begin, end) and its first index; strict comparisons keep the earliest.
template <typename scalar_t>
Best part_max(const scalar_t* row, int64_t begin, int64_t end) {
  Best best{-INFINITY, -1};
  int64_t i = begin;
#ifdef __AVX512F__
  if (end - begin >= 16) {
    __m512 lane_max = _mm512_set1_ps(-INFINITY);
    __m512i lane_index = _mm512_set1_epi32(-1);
    __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(begin)),
                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= end; i += 16) {
      const __m512 values = load16(row + i);
      const __mmask16 greater = _mm512_cmp_ps_mask(values, lane_max, _CMP_GT_OQ);
      lane_max = _mm512_mask_mov_ps(lane_max, greater, values);
      lane_index = _mm512_mask_mov_epi32(lane_index, greater, index);
      index = _mm512_add_epi32(index, step);
    }
    // each lane holds its first maximum; of the lanes at the overall maximum, the smallest index wins
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, lane_max);
    _mm512_store_si512(reinterpret_cast<__m512i*>(indices), lane_index);
    for (int lane = 0; lane < 16; ++lane) {
      if (indices[lane] < 0) continue;
      if (values[lane] > best.value || (values[lane] == best.value && indices[lane] < best.index)) {
        best = {values[lane], indices[lane]};
      }
    }
  }
#elif defined(__AVX2__)
  if (end - begin >= 32) lanes_max(row, i, end, best);
#endif
  for (; i < end; ++i) {  // the tail (or everything without vectors): later indices win only if greater
    const float value = to_float(row[i]);
    if (value > best.value) best = {value, i};
  }
  return best;
}

template <typename scalar_t>
void greedy_rows(const scalar_t* logits, int64_t* out, int64_t rows, int64_t vocab) {
  const int64_t threads = at::get_num_threads();
  // split rows only when there are fewer of them than threads, and never into parts under kMinPart
  const int64_t parts = rows >= threads ? 1 : std::max<int64_t>(1, std::min((threads + rows - 1) / rows,
                                                                         vocab / kMinPart));
  const int64_t part_len = (vocab + parts - 1) / parts;
  std::vector<Best> found(rows * parts);
  at::parallel_for(0, rows * parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = item / parts, part = item % parts;
      const int64_t begin = part * part_len, end = std::min(vocab, begin + part_len);
      found[item] = part_max(logits + row * vocab, begin, end);
    }
  });
  for (int64_t row = 0; row < rows; ++row) {
    Best best = found[row * parts];
    for (int64_t part = 1; part < parts; ++part) {  // parts in order: a later one must be greater
      const Best& candidate = found[row * parts + part];
      if (candidate.index >= 0 && (best.index < 0 || candidate.value > best.value)) best = candidate;
    }
    out[row] = best.index < 0 ? 0 : best.index;  // a row of -inf: its first index, as torch
  }
}

}  // namespace

at::Tensor greedy_sample(at::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "greedy_sample takes contiguous 2-D CPU logits");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "greedy_sample: vocabulary too large for 32-bit indices");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.size(0) == 0) return out;
  if (logits.scalar_type() == at::kBFloat16) {
    greedy_rows(reinterpret_cast<const c10::BFloat16*>(logits.data_ptr()), out.data_ptr<int64_t>(),
                logits.size(0), logits.size(1));
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kFloat, "greedy_sample takes bfloat16 or float32 logits");
    greedy_rows(logits.data_ptr<float>(), out.data_ptr<int64_t>(), logits.size(0), logits.size(1));
  }
  return out;
}
