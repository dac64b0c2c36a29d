// The LoRA deltas of a step's rows, every adapter in one call (Punica's BGMV on the CPU): for each row t
// whose slot s = token_slots[t] is not negative, out[t] += (A[s] x[t]) Bt[s], shrink then expand.
//
// A stacks each slot's down-projection [W, in] and Bt each slot's up-projection transposed [W, out]
// (lora/weights.py), so both steps stream contiguous rows: W dot products of x with A's rows, then W
// multiply-adds of Bt's rows into a float32 accumulator of the output row. Columns past the slot's width
// (its rank times the fused layer's shards) are zeros and skipped. float32 arithmetic (bf16 widened
// exactly), the delta rounded once as it joins the output row. Each row is computed alone, the same
// whatever else the step holds; rows are shared among torch's threads when there are enough of them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vector_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kParallelWork = 1 << 16;  // multiply-adds a thread hand-off pays for

// sum of a[k] x[k] over k < n (n a multiple of 8)
template <typename T>
float dot(const T* a, const T* x, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    s0 = _mm256_fmadd_ps(load8(a + k), load8(x + k), s0);
    s1 = _mm256_fmadd_ps(load8(a + k + 8), load8(x + k + 8), s1);
  }
  if (k < n) s0 = _mm256_fmadd_ps(load8(a + k), load8(x + k), s0);
  return horizontal_sum8(_mm256_add_ps(s0, s1));
}

template <typename T>
void lora_rows(const torch::Tensor& x, torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& bt,
               const int64_t* slots, const int64_t* widths) {
  const int64_t rows = x.size(0), in = x.size(1), out_features = out.size(1), width = a.size(1);
  const T* x_data = static_cast<const T*>(x.data_ptr());
  T* out_data = static_cast<T*>(out.data_ptr());
  const T* a_data = static_cast<const T*>(a.data_ptr());
  const T* bt_data = static_cast<const T*>(bt.data_ptr());
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, width * (in + out_features)));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> hidden(width), acc(out_features);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || widths[slot] == 0) continue;
      const int64_t used = widths[slot];
      const T* x_row = x_data + t * x_stride;
      const T* a_slot = a_data + slot * width * in;
      for (int64_t w = 0; w < used; ++w) hidden[w] = dot(a_slot + w * in, x_row, in);
      std::fill(acc.begin(), acc.end(), 0.0f);
      const T* bt_slot = bt_data + slot * width * out_features;
      for (int64_t w = 0; w < used; ++w) {
        const __m256 h = _mm256_set1_ps(hidden[w]);
        const T* b_row = bt_slot + w * out_features;
        for (int64_t j = 0; j < out_features; j += 8)
          _mm256_storeu_ps(acc.data() + j, _mm256_fmadd_ps(h, load8(b_row + j), _mm256_loadu_ps(acc.data() + j)));
      }
      T* out_row = out_data + t * out_stride;
      for (int64_t j = 0; j < out_features; j += 8)
        store8(out_row + j, _mm256_add_ps(load8(out_row + j), _mm256_loadu_ps(acc.data() + j)));
    }
  });
}

}  // namespace

bool lora_delta_supported() { return true; }

// x [T, in] and out [T, out_features] (rows contiguous, any row stride), a [S, W, in] and bt [S, W,
// out_features] contiguous, all of one dtype (float32 or bf16); token_slots [T] int64 (-1: no adapter);
// widths [S] int64: the columns of W each slot uses. in and out_features multiples of 8. out is updated in
// place.
void lora_delta(const torch::Tensor& x, torch::Tensor out, const torch::Tensor& a, const torch::Tensor& bt,
                const torch::Tensor& token_slots, const torch::Tensor& widths) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "lora_delta takes float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dtype && a.scalar_type() == dtype && bt.scalar_type() == dtype,
              "lora_delta takes x, out, a and bt of one dtype");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "x and out must be [rows, features]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x's and out's rows must be contiguous");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous(),
              "a and bt must be contiguous [slots, width, features]");
  TORCH_CHECK(a.size(0) == bt.size(0) && a.size(1) == bt.size(1) && a.size(2) == x.size(1) &&
                  bt.size(2) == out.size(1),
              "a must be [slots, width, in] and bt [slots, width, out] of x's and out's features");
  TORCH_CHECK(x.size(1) % 8 == 0 && out.size(1) % 8 == 0, "lora_delta needs feature counts that are multiples of 8");
  TORCH_CHECK(token_slots.scalar_type() == torch::kInt64 && token_slots.dim() == 1 &&
                  token_slots.size(0) == x.size(0) && token_slots.is_contiguous(),
              "token_slots must be a contiguous int64 tensor with one slot per row");
  TORCH_CHECK(widths.scalar_type() == torch::kInt64 && widths.dim() == 1 && widths.is_contiguous() &&
                  widths.size(0) == a.size(0),
              "widths must be a contiguous int64 tensor with one width per slot");
  const int64_t* width_data = widths.data_ptr<int64_t>();
  for (int64_t s = 0; s < widths.size(0); ++s)
    TORCH_CHECK(width_data[s] >= 0 && width_data[s] <= a.size(1), "a slot's width must be within [0, W]");
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(slots[t] < a.size(0), "token slot ", slots[t], " out of range");
  if (dtype == torch::kFloat) lora_rows<float>(x, out, a, bt, slots, width_data);
  else lora_rows<c10::BFloat16>(x, out, a, bt, slots, width_data);
}

#else

bool lora_delta_supported() { return false; }

void lora_delta(const torch::Tensor&, torch::Tensor, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                const torch::Tensor&) {
  TORCH_CHECK(false, "lora_delta needs a CPU with AVX2 and FMA");
}

#endif
