// A mixture-of-experts layer's experts on quantized weights, in one call: what
// QuantizedMoEExperts.forward (quantization/moe.py) composes from PyTorch ops at ~15 calls a layer,
// which at decode batch sizes cost more than a tenth of the layer's time.
//
// The (token, expert) pairs are counting-sorted by expert (stable: a token's pairs keep their order
// within an expert), each pair's token row is gathered, the experts' gate/up and down projections run
// as one grouped call each (grouped_linear_int8/int4, linear_quantized.cpp) with silu_and_mul between
// them, and moe_combine sums each token's pairs back. moe_combine is also what the per-expert path
// calls, so both give the same bits. Under expert parallelism a rank holds a run of the experts: pairs
// routed to the others' are skipped here (they add nothing to this rank's partial sums).
#include "aten.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

// (order, ends): order [P'] the indices (token * k + j) of the pairs routed to the held experts
// [first, first + held), sorted by expert, stable; ends [held] each held expert's end in that order.
std::pair<at::Tensor, at::Tensor> sort_pairs(const at::Tensor& experts, int64_t first, int64_t held,
                                             int64_t num_experts) {
  const int64_t pairs = experts.numel();
  const int64_t* chosen = experts.data_ptr<int64_t>();
  auto ends = at::zeros({held}, experts.options());
  int64_t* end = ends.data_ptr<int64_t>();
  int64_t kept = 0;
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(chosen[p] >= 0 && chosen[p] < num_experts, "moe_experts: an expert index out of range");
    const int64_t local = chosen[p] - first;
    if (local >= 0 && local < held) ++end[local], ++kept;
  }
  std::vector<int64_t> next(held);
  for (int64_t e = 0, start = 0; e < held; ++e) {
    next[e] = start;
    start += end[e];
    end[e] = start;
  }
  auto order = at::empty({kept}, experts.options());
  int64_t* sorted = order.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t local = chosen[p] - first;
    if (local >= 0 && local < held) sorted[next[local]++] = p;
  }
  return {order, ends};
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& ends, const at::Tensor& packed,
                          const at::Tensor& scales, int64_t out_features) {
  // int4's parameters are [E, N'/32, groups, 2, 32]; int8's scales [E, N] or [E, N'/32, groups, 32]
  if (scales.dim() == 5) return grouped_linear_int4(x, ends, packed, scales, out_features);
  return grouped_linear_int8(x, ends, packed, scales, out_features);
}

}  // namespace

// rows [P', D]: pair order[i]'s expert output in row i; weights [T, k] float32, each pair's weight
// (pair p = token * k + j). Returns [T, D] in rows' dtype: per token, the float32 sum over its pairs
// that have a row (all of them, except under expert parallelism), in row order, of weight x row,
// rounded once; zeros for a token none of whose pairs has one.
at::Tensor moe_combine(at::Tensor rows, at::Tensor weights, at::Tensor order) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(), "moe_combine takes contiguous rows [P, D]");
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  weights.numel() >= rows.size(0),
              "moe_combine takes float32 weights [T, k], one per pair");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.is_contiguous() &&
                  order.numel() == rows.size(0),
              "moe_combine takes the rows' pair indices [P] int64");
  const int64_t tokens = weights.size(0), top_k = weights.size(1), width = rows.size(1);
  const int64_t* pairs = order.data_ptr<int64_t>();
  std::vector<int64_t> row_of(weights.numel(), -1);  // pair -> its row (-1: none)
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(pairs[i] >= 0 && pairs[i] < weights.numel() && row_of[pairs[i]] < 0,
                "moe_combine's order must name distinct pairs");
    row_of[pairs[i]] = i;
  }
  auto out = at::empty({tokens, width}, rows.options());
  const float* pair_weights = weights.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "moe_combine", [&] {
    const scalar_t* in = rows.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
      std::vector<float> acc(width);
      std::vector<int64_t> mine(top_k);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t j = 0; j < top_k; ++j) mine[j] = row_of[t * top_k + j];
        std::sort(mine.begin(), mine.end());  // row order: the same sum whatever the batch
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (const int64_t i : mine) {
          if (i < 0) continue;  // a pair another rank computes
          const float weight = pair_weights[pairs[i]];
          const scalar_t* row = in + i * width;
          for (int64_t d = 0; d < width; ++d) acc[d] += weight * static_cast<float>(row[d]);
        }
        for (int64_t d = 0; d < width; ++d) dst[t * width + d] = static_cast<scalar_t>(acc[d]);
      }
    });
  });
  return out;
}

// hidden [T, D] (bf16, or float32 where the level's int8/int4 kernels take it), weights [T, k] float32
// and experts [T, k] int64 (the router's choice among num_experts), and the held experts' (first_expert
// onwards, as many as are stacked) gate/up ([gate; up] rows, 2 I outputs) and down (D outputs) weights
// packed and stacked as grouped_linear_int8/int4 take them. out_features: down's (D). Returns [T, D]:
// sum over each token's chosen experts among the held ones of weight x down(silu(gate) x up).
at::Tensor moe_experts(at::Tensor hidden, at::Tensor weights, at::Tensor experts,
                       at::Tensor gate_up_packed, at::Tensor gate_up_scales, at::Tensor down_packed,
                       at::Tensor down_scales, int64_t intermediate_size, int64_t out_features,
                       int64_t first_expert, int64_t num_experts) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "moe_experts takes contiguous hidden [T, D]");
  TORCH_CHECK(experts.dim() == 2 && experts.scalar_type() == at::kLong && experts.is_contiguous() &&
                  experts.size(0) == hidden.size(0) && weights.sizes() == experts.sizes() &&
                  weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moe_experts takes int64 experts and float32 weights [T, k]");
  TORCH_CHECK(out_features == hidden.size(1), "moe_experts: the down projection's outputs must be hidden's width");
  const int64_t top_k = experts.size(1), width = hidden.size(1);
  if (hidden.size(0) == 0) return at::empty_like(hidden);  // no tokens routed here (expert parallelism)
  const int64_t held = gate_up_packed.size(0);
  TORCH_CHECK(first_expert >= 0 && first_expert + held <= num_experts,
              "moe_experts: the held experts must lie within num_experts");
  auto [order, ends] = sort_pairs(experts, first_expert, held, num_experts);
  auto routed = at::empty({order.numel(), width}, hidden.options());
  const int64_t row_bytes = width * hidden.element_size();
  const char* src = static_cast<const char*>(hidden.data_ptr());
  char* dst = static_cast<char*>(routed.data_ptr());
  const int64_t* pairs = order.data_ptr<int64_t>();
  at::parallel_for(0, order.numel(), std::max<int64_t>(1, 65536 / std::max<int64_t>(row_bytes, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst + i * row_bytes, src + pairs[i] / top_k * row_bytes, row_bytes);
  });
  const auto gate_up = grouped_linear(routed, ends, gate_up_packed, gate_up_scales, 2 * intermediate_size);
  const auto down = grouped_linear(silu_and_mul(gate_up), ends, down_packed, down_scales, width);
  return moe_combine(down, weights, order);
}
