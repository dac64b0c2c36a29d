// The decoder layers of a decode step, one call from Python instead of ~12 per layer.
//
// At small batch the kernels of a step are fast enough that calling them from Python (module calls,
// argument checks, views, pybind conversions, per layer) is a large share of the step. This
// runs the same kernels in the same order on the same tensors as LlamaDecoderLayer.forward does on
// the CPU (small_batch_linear or oneDNN's GEMM on the packed copy, rms_norm, rotary_embedding,
// write_kv_rows, paged_attention, add_rms_norm, silu_and_mul, the residual add), so its output is
// bit-identical to the Python path (tested); only the dispatch goes. Linear layers may be bf16,
// per-channel int8 or group-wise int4, each through its small-batch kernel, or float32 in a float32
// model (linear_f32.cpp; int8 and int4 too where their kernels take float32 inputs, at any row count);
// above 8 rows, bf16 ones go to AMX (linear_amx.cpp), the small-batch kernel in tiles of 8 (no AMX, up to
// kernel_max_rows) or oneDNN's GEMM, as the modules choose. The model uses it when every sequence is
// a decode or a short span (models/decode_stack.py says when). Under tensor parallelism the layers are
// one rank's shards, and the o and down projections' outputs are summed over the ranks in the stack
// (shm_collectives.cpp on one host), as the modules sum them. int8, int4 and bf16 layers at 1-8 rows run
// in one OpenMP region for the whole step (forward_in_one_region, decode_stack.h says why).
#include <ATen/ThreadLocalState.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>

#include <cstring>
#include <exception>
#include <mutex>

#include "decode_stack.h"
#include "kernels.h"

at::Tensor small_batch_linear_packed(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& scales, int64_t out_features) {
  if (weight.scalar_type() == at::kByte && scales.dim() == 4)
    return small_batch_linear_int4(x, weight, scales, out_features);
  if (weight.scalar_type() == at::kByte) return small_batch_linear_int8(x, weight, scales, out_features);
  if (x.scalar_type() == at::kFloat) return small_batch_linear_f32(x, weight, out_features);
  return small_batch_linear(x, weight, out_features);
}

namespace {

// The small-batch kernels' row limit (MAX_ROWS in small_batch_linear.py, where the modules switch to
// oneDNN); FusedDecodeStack.max_rows says whether the stack may be handed more.
constexpr int64_t kSmallBatchRows = 8;

// The rows oneDNN runs for `rows` (onednn_rows in small_batch_linear.py): rounded up to a multiple of 1/8
// of the power of two below, so its primitive cache holds 8 sizes per octave, not every count a step has.
int64_t onednn_rows(int64_t rows) {
  int64_t bits = 0;
  for (int64_t r = rows; r > 0; r >>= 1) ++bits;
  const int64_t step = int64_t{1} << std::max<int64_t>(bits - 4, 0);
  return (rows + step - 1) / step * step;
}

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""): the call SmallBatchLinear makes
// above 8 rows, through the dispatcher (a boxed call: a few microseconds, 4 per layer), on as many
// rows as it pads to (the extra rows are never read back: a row's result depends only on that row).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0), padded = onednn_rows(rows);
  at::Tensor input = x;
  if (padded != rows) {
    input = at::empty({padded, x.size(1)}, x.options());
    input.narrow(0, 0, rows).copy_(x);
  }
  torch::jit::Stack stack{input, packed, bias.defined() && bias.numel() ? c10::IValue(bias) : c10::IValue(),
                          std::string("none"), c10::List<std::optional<c10::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  at::Tensor out = stack[0].toTensor();
  return padded == rows ? out : out.narrow(0, 0, rows);
}

// An int8 (kv_format 1) or fp8 (2) cache's rows [n, kv_heads, head_dim] as QuantizedKVCacheFormat.quantize
// makes them (attention/kv_format.py), op for op: codes against the float16-rounded scale, then the
// scale's two bytes.
at::Tensor quantize_kv_rows(const at::Tensor& rows, int64_t kv_format) {
  constexpr double kMinScale = 6.103515625e-05;  // float16's smallest normal, kv_format.py's _MIN_SCALE
  const bool int8 = kv_format == 1;
  const double code_max = int8 ? 127.0 : 448.0;
  const auto x = rows.to(at::kFloat);
  const auto scale = (x.abs().amax(-1, /*keepdim=*/true) / code_max).clamp_min(kMinScale).to(at::kHalf);
  auto scaled = (x / scale.to(at::kFloat)).clamp(-code_max, code_max);
  if (int8) scaled = scaled.round();  // float8 rounds to nearest in the cast itself
  const auto codes = scaled.to(int8 ? at::kChar : at::kFloat8_e4m3fn);
  return at::cat({codes.view(at::kByte), scale.view(at::kByte)}, -1);
}

// A layer's new K or V rows [tokens, kv_heads, head_dim] into its cache, as KVCacheFormat.write writes
// them: a plain copy, or an indexed copy of the rows quantized to the 8-bit format.
void write_cache_rows(const at::Tensor& cache, const at::Tensor& slot_mapping, const at::Tensor& rows,
                      int64_t kv_format) {
  if (kv_format)
    cache.index_copy_(0, slot_mapping, quantize_kv_rows(rows, kv_format));
  else
    write_kv_rows(cache, slot_mapping, rows);
}

// x W^T (+ bias) as the layer's module computes it for this many rows: the small-batch kernel up to
// kSmallBatchRows, int8 and int4 weights at any row count, bf16 weights up to kernel_max_rows (the bias
// added after); above that AMX on the same bf16 copy up to amx_max_rows, oneDNN on its blocked copy beyond.
at::Tensor stack_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                        const at::Tensor& onednn_weight, const at::Tensor& bias, int64_t out_features,
                        int64_t amx_max_rows, int64_t kernel_max_rows) {
  const int64_t rows = x.size(0);
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const bool has_bias = bias.defined() && bias.numel();
  const bool quantized = weight.scalar_type() == at::kByte;  // its kernel takes any row count
  if (rows <= kSmallBatchRows || quantized || (bf16 && rows <= kernel_max_rows)) {
    auto out = small_batch_linear_packed(x, weight, scales, out_features);
    return has_bias ? out + bias : out;
  }
  if (bf16 && rows <= amx_max_rows)
    return amx_linear(x.contiguous(), weight, has_bias ? std::optional<at::Tensor>(bias) : std::nullopt,
                      out_features, false);
  TORCH_CHECK(onednn_weight.numel(), "DecodeStack: more rows than the small-batch kernels take need the layers' oneDNN copies");
  return onednn_linear(x, onednn_weight, bias);
}

}  // namespace

DecodeStack::DecodeStack(std::vector<at::Tensor> layer_tensors, at::Tensor final_norm, at::Tensor cos,
                         at::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t intermediate_size, double eps, double scale, int64_t amx_max_rows,
                         int64_t kernel_max_rows, int64_t kv_format)
    : tensors_(std::move(layer_tensors)),
      final_norm_(std::move(final_norm)),
      cos_(std::move(cos)),
      sin_(std::move(sin)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      intermediate_size_(intermediate_size),
      hidden_size_(final_norm_.numel()),
      amx_max_rows_(amx_max_rows),
      kernel_max_rows_(kernel_max_rows),
      kv_format_(kv_format),
      eps_(eps),
      scale_(scale) {
  TORCH_CHECK(kv_format >= 0 && kv_format <= 2, "DecodeStack takes plain, int8 and fp8 KV caches");
  TORCH_CHECK(!tensors_.empty() && tensors_.size() % kTensorsPerLayer == 0,
              "DecodeStack takes 26 tensors per layer");
  // int8/int4 weights with their scales, or, in a bf16 model, bf16 ones on the small-batch kernel (a
  // float32 model's bf16 copies are the float32 kernel's layout)
  const bool bf16_model = final_norm_.scalar_type() == at::kBFloat16;
  const auto in_region = [bf16_model](const at::Tensor& weight, const at::Tensor& scales) {
    if (!weight.defined()) return false;
    if (weight.scalar_type() == at::kBFloat16) return bf16_model && (!scales.defined() || !scales.numel());
    return weight.scalar_type() == at::kByte && scales.defined() && scales.numel();
  };
  region_layers_ = true;
  for (size_t base = 0; base < tensors_.size(); base += kTensorsPerLayer) {
    const at::Tensor* t = tensors_.data() + base;
    region_layers_ = region_layers_ && in_region(t[1], t[2]) && in_region(t[4], t[5]) && in_region(t[7], t[8]) &&
                     in_region(t[9], t[10]) && !t[22].numel() && (!t[23].numel() || in_region(t[23], t[24]));
    two_part_qkv_ = two_part_qkv_ || t[23].numel();
  }
}

void DecodeStack::set_lora(std::vector<at::Tensor> lora_tensors) {
  TORCH_CHECK(lora_tensors.size() == tensors_.size() / kTensorsPerLayer * kLoraTensorsPerLayer,
              "DecodeStack::set_lora takes 16 tensors per layer");
  const int64_t q_size = num_heads_ * head_dim_, qkv_size = q_size + 2 * num_kv_heads_ * head_dim_;
  // each projection's (in, out) features: qkv, o, gate_up, down
  const int64_t features[4][2] = {
      {hidden_size_, qkv_size}, {q_size, hidden_size_}, {hidden_size_, 2 * intermediate_size_},
      {intermediate_size_, hidden_size_}};
  for (size_t i = 0; i < lora_tensors.size(); i += 4) {
    const int64_t p = (i / 4) % 4;
    lora_check_stacks(lora_tensors[i], lora_tensors[i + 1], lora_tensors[i + 2], lora_tensors[i + 3], features[p][0],
                      features[p][1]);
  }
  lora_ = std::move(lora_tensors);
}

at::Tensor DecodeStack::forward(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping,
                                at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_starts,
                                int64_t block_size, int64_t sinks, int64_t window,
                                const std::optional<at::Tensor>& token_slots,
                                const std::optional<at::Tensor>& tree_masks) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size_, "hidden must be [tokens, hidden_size]");
  TORCH_CHECK(!token_slots || !lora_.empty(), "DecodeStack: token slots given but no LoRA adapters bound");
  const int64_t tokens = hidden.size(0);
  const int64_t threads = at::get_num_threads();
  // (a Python dispatch mode would have the region's other threads wait for the GIL this one holds)
  if (region_layers_ && tokens <= kSmallBatchRows && !all_reduce_ && threads > 1 && !(token_slots && two_part_qkv_) &&
      !at::in_parallel_region() && !c10::impl::TorchDispatchModeTLS::any_modes_set()) {
    ++one_region_calls_;
    return forward_in_one_region(hidden, positions, slot_mapping, block_tables, seq_lens, query_starts, block_size,
                                 sinks, window, token_slots, tree_masks, threads);
  }
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const at::Tensor kNone;  // o, gate_up and down have no bias (models/decode_stack.py checks)
  for (size_t base = 0, layer = 0; base < tensors_.size(); base += kTensorsPerLayer, ++layer) {
    const at::Tensor* t = tensors_.data() + base;
    // the layer's adapters after projection p (0 qkv, 1 o, 2 gate_up, 3 down), where the step has any
    const auto add_lora = [&](int p, const at::Tensor& input, at::Tensor& output) {
      if (!token_slots) return;
      const at::Tensor* l = lora_.data() + layer * kLoraTensorsPerLayer + 4 * p;
      lora_delta(input, output, l[0], l[1], *token_slots, l[2], l[3]);
    };
    const auto& [input_norm, qkv_weight, qkv_scales, qkv_bias, o_weight, o_scales, post_norm, gate_up_weight,
                 gate_up_scales, down_weight, down_scales, key_cache, value_cache] =
        std::tie(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11], t[12]);
    const auto& [qkv_onednn, o_onednn, gate_up_onednn, down_onednn] = std::tie(t[13], t[14], t[15], t[16]);
    const auto& [q_norm, k_norm] = std::tie(t[17], t[18]);
    const auto& [router, router_scales, router_onednn, moe_params] = std::tie(t[19], t[20], t[21], t[22]);
    const auto& [qkv_tail, qkv_tail_scales, qkv_head_rows] = std::tie(t[23], t[24], t[25]);
    // attention block
    const auto qkv_input = rms_norm(hidden, input_norm, eps_);
    at::Tensor qkv;
    if (qkv_tail.numel()) {  // shards of two formats (a Q4_K_M's Q4_K q/k, Q6_K v): each on its kernel
      const int64_t head_rows = qkv_head_rows.data_ptr<int64_t>()[0];
      qkv = at::cat({small_batch_linear_packed(qkv_input, qkv_weight, qkv_scales, head_rows),
                     small_batch_linear_packed(qkv_input, qkv_tail, qkv_tail_scales, qkv_size - head_rows)},
                    1);
      if (qkv_bias.defined() && qkv_bias.numel()) qkv = qkv + qkv_bias;
    } else {
      qkv = stack_linear(qkv_input, qkv_weight, qkv_scales, qkv_onednn, qkv_bias, qkv_size, amx_max_rows_,
                         kernel_max_rows_);
    }
    add_lora(0, qkv_input, qkv);
    auto query = qkv.narrow(1, 0, q_size), key = qkv.narrow(1, q_size, kv_size);
    auto value = qkv.narrow(1, q_size + kv_size, kv_size);
    if (q_norm.numel()) {  // each head's RMSNorm: fresh contiguous rows, as QKNormAttention makes them
      query = rms_norm(query.reshape({-1, head_dim_}), q_norm, eps_).view({tokens, q_size});
      key = rms_norm(key.reshape({-1, head_dim_}), k_norm, eps_).view({tokens, kv_size});
    }
    rotary_embedding(positions, query, key, cos_, sin_, head_dim_);
    const auto key_rows = key.view({tokens, num_kv_heads_, head_dim_});
    const auto value_rows = value.view({tokens, num_kv_heads_, head_dim_});
    write_cache_rows(key_cache, slot_mapping, key_rows, kv_format_);
    write_cache_rows(value_cache, slot_mapping, value_rows, kv_format_);
    auto attention = paged_attention(query.view({tokens, num_heads_, head_dim_}).contiguous(), key_cache,
                                     value_cache, block_tables, seq_lens, query_starts, block_size, scale_,
                                     kv_format_, sinks, window, tree_masks);
    const auto o_input = attention.view({tokens, q_size});
    auto attention_out =
        stack_linear(o_input, o_weight, o_scales, o_onednn, kNone, hidden_size_, amx_max_rows_, kernel_max_rows_);
    add_lora(1, o_input, attention_out);
    if (all_reduce_) all_reduce_(attention_out);
    // attention_out becomes the residual stream; its norm feeds the MLP
    auto normed = add_rms_norm(attention_out, hidden, post_norm, eps_);
    at::Tensor mlp_out;
    if (moe_params.numel()) {  // experts: routed as SparseMoE.route, run as QuantizedMoEExperts runs them
      const int64_t* moe = moe_params.data_ptr<int64_t>();
      const int64_t first_expert = moe[0], router_experts = moe[1], top_k = moe[2], intermediate = moe[4];
      const auto logits = stack_linear(normed, router, router_scales, router_onednn, kNone, router_experts,
                                       amx_max_rows_, kernel_max_rows_);
      auto [weights, experts] = logits.to(at::kFloat).softmax(-1).topk(top_k, -1);
      if (moe[3]) weights = weights / weights.sum(-1, /*keepdim=*/true);
      mlp_out = moe_experts(normed, weights.contiguous(), experts.contiguous(), gate_up_weight, gate_up_scales,
                            down_weight, down_scales, intermediate, hidden_size_, first_expert, router_experts);
    } else {
      auto gate_up = stack_linear(normed, gate_up_weight, gate_up_scales, gate_up_onednn, kNone,
                                  2 * intermediate_size_, amx_max_rows_, kernel_max_rows_);
      add_lora(2, normed, gate_up);
      const auto down_input = silu_and_mul(gate_up);
      mlp_out = stack_linear(down_input, down_weight, down_scales, down_onednn, kNone, hidden_size_, amx_max_rows_,
                             kernel_max_rows_);
      add_lora(3, down_input, mlp_out);
    }
    if (all_reduce_) all_reduce_(mlp_out);
    hidden = attention_out + mlp_out;
  }
  return rms_norm(hidden, final_norm_, eps_);
}

at::Tensor DecodeStack::forward_in_one_region(const at::Tensor& hidden, const at::Tensor& positions,
                                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                              const at::Tensor& seq_lens, const at::Tensor& query_starts,
                                              int64_t block_size, int64_t sinks, int64_t window,
                                              const std::optional<at::Tensor>& token_slots,
                                              const std::optional<at::Tensor>& tree_masks, int64_t threads) const {
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const at::Tensor kNone;  // o, gate_up and down have no bias
  // what the threads write their parts of, and read whole after the barrier that follows
  const auto options = hidden.options();
  auto qkv = at::empty({tokens, qkv_size}, options);
  // a q/k/v layer of two formats: each part's output, joined by every thread after the barrier
  const auto head_part = two_part_qkv_ ? at::empty({tokens * qkv_size}, options) : at::Tensor();
  const auto tail_part = two_part_qkv_ ? at::empty({tokens * qkv_size}, options) : at::Tensor();
  auto attention = at::empty({tokens, num_heads_, head_dim_}, options);
  const auto o_input = attention.view({tokens, q_size});
  auto attention_out = at::empty({tokens, hidden_size_}, options);
  auto gate_up = at::empty({tokens, 2 * intermediate_size_}, options);
  auto mlp_out = at::empty({tokens, hidden_size_}, options);
  at::Tensor result;
  std::exception_ptr error;
  std::mutex error_mutex;
  std::vector<at::Tensor> queries(threads), keys(threads);  // each thread's rotated rows
  for (int64_t thread = 0; thread < threads; ++thread) {
    queries[thread] = at::empty({tokens, num_heads_, head_dim_}, options);
    keys[thread] = at::empty({tokens, kv_size}, options);
  }
  std::atomic<bool> failed{false};
  LoraExchange lora_exchange;  // the adapters' shrinks, shared between the threads
  lora_exchange.failed = &failed;
  if (token_slots) {
    TORCH_CHECK(tokens <= LoraExchange::kMaxRows, "DecodeStack: a region's step with adapters has at most ",
                LoraExchange::kMaxRows, " rows");
    TORCH_CHECK(lora_[0].scalar_type() == hidden.scalar_type(), "DecodeStack: adapters of another dtype");
    for (size_t i = 0; i < lora_.size(); i += 4)
      lora_check_step(lora_[i], lora_[i + 2], lora_[i + 3].size(0) - 1, *token_slots, tokens);
  }
  const at::ThreadLocalState state;  // the caller's inference mode and dispatch state, for every thread
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const at::ThreadLocalStateGuard state_guard(state);
    const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
    const ThreadShareGuard share(thread, team);
    // Runs one phase on this thread unless a thread has failed; every thread still meets every barrier,
    // so a failure ends the region instead of leaving the others waiting.
    const auto phase = [&](auto&& work) {
      if (failed.load(std::memory_order_relaxed)) return;
      try {
        work();
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
      }
    };
    int64_t lora_call = 0;  // this thread's count of the region's adapter calls (the same on every thread)
    // x W^T into out, this thread's blocks, then its rows' bias (as `out + bias` rounds it) and (adapters)
    // their deltas, in the modules' order; the adapters' shrink before the linear part, their expand after
    const auto linear = [&](int64_t layer, int p, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& scales, const at::Tensor& bias, int64_t out_features,
                            at::Tensor& out) {
      const at::Tensor* l = token_slots ? lora_.data() + layer * kLoraTensorsPerLayer + 4 * p : nullptr;
      if (l) lora_shrink_part(x, l[0], *token_slots, l[2], lora_call, lora_exchange);
      if (weight.scalar_type() == at::kBFloat16)
        small_batch_linear_into(x, weight, out_features, out);
      else
        small_batch_linear_quantized_into(x, weight, scales, out_features, out);
      const ThreadShare& rows = thread_share();
      if (bias.defined() && bias.numel() && rows.rows_end > rows.rows_begin)
        out.narrow(1, rows.rows_begin, rows.rows_end - rows.rows_begin)
            .add_(bias.narrow(0, rows.rows_begin, rows.rows_end - rows.rows_begin));
      if (l) lora_expand_part(out, l[1], *token_slots, l[2], l[3], lora_call++, lora_exchange);
    };
    at::Tensor residual = hidden;  // this thread's copy of the residual stream (the same bits on every thread)
    at::Tensor query, after_attention;
    for (int64_t layer = 0; layer < static_cast<int64_t>(tensors_.size()) / kTensorsPerLayer; ++layer) {
      const at::Tensor* t = tensors_.data() + layer * kTensorsPerLayer;
      const auto& [input_norm, qkv_weight, qkv_scales, qkv_bias, o_weight, o_scales, post_norm, gate_up_weight,
                   gate_up_scales, down_weight, down_scales, key_cache, value_cache] =
          std::tie(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11], t[12]);
      const auto& [q_norm, k_norm] = std::tie(t[17], t[18]);
      const auto& [qkv_tail, qkv_tail_scales, qkv_head_rows] = std::tie(t[23], t[24], t[25]);
      const int64_t head_rows = qkv_tail.numel() ? qkv_head_rows.data_ptr<int64_t>()[0] : qkv_size;
      at::Tensor head, tail;  // the two parts' outputs, [tokens, head_rows] and [tokens, qkv_size - head_rows]
      if (qkv_tail.numel()) {
        head = head_part.narrow(0, 0, tokens * head_rows).view({tokens, head_rows});
        tail = tail_part.narrow(0, 0, tokens * (qkv_size - head_rows)).view({tokens, qkv_size - head_rows});
      }
      phase([&] {
        const auto x = rms_norm(residual, input_norm, eps_);
        if (!qkv_tail.numel()) {
          linear(layer, 0, x, qkv_weight, qkv_scales, qkv_bias, qkv_size, qkv);
          return;
        }
        const bool bias = qkv_bias.defined() && qkv_bias.numel();
        linear(layer, 0, x, qkv_weight, qkv_scales, bias ? qkv_bias.narrow(0, 0, head_rows) : kNone, head_rows, head);
        linear(layer, 0, x, qkv_tail, qkv_tail_scales, bias ? qkv_bias.narrow(0, head_rows, qkv_size - head_rows) : kNone,
               qkv_size - head_rows, tail);
      });
#pragma omp barrier
      phase([&] {  // rope on this thread's copy of the queries and keys; the cache rows written by two threads
        at::Tensor key, value;
        if (q_norm.numel() || qkv_tail.numel()) {
          const auto rows = qkv_tail.numel() ? at::cat({head, tail}, 1) : qkv.clone();
          query = rows.narrow(1, 0, q_size);
          key = rows.narrow(1, q_size, kv_size);
          value = rows.narrow(1, q_size + kv_size, kv_size);
          if (q_norm.numel()) {
            query = rms_norm(query.reshape({-1, head_dim_}), q_norm, eps_).view({tokens, q_size});
            key = rms_norm(key.reshape({-1, head_dim_}), k_norm, eps_).view({tokens, kv_size});
          }
          rotary_embedding(positions, query, key, cos_, sin_, head_dim_);
          query = query.view({tokens, num_heads_, head_dim_}).contiguous();
        } else {  // the rows copied into this thread's buffers, rotated there
          query = queries[thread];
          key = keys[thread];
          const int64_t bytes = qkv.element_size();
          const char* source = static_cast<const char*>(qkv.data_ptr());
          char* query_rows = static_cast<char*>(query.data_ptr());
          char* key_rows = static_cast<char*>(key.data_ptr());
          for (int64_t token = 0; token < tokens; ++token) {
            std::memcpy(query_rows + token * q_size * bytes, source + token * qkv_size * bytes, q_size * bytes);
            std::memcpy(key_rows + token * kv_size * bytes, source + (token * qkv_size + q_size) * bytes, kv_size * bytes);
          }
          value = qkv.narrow(1, q_size + kv_size, kv_size);
          rotary_embedding(positions, query.view({tokens, q_size}), key, cos_, sin_, head_dim_);
        }
        // the keys by the first thread, the values by the last (one thread: both)
        const std::vector<int64_t> heads{tokens, num_kv_heads_, head_dim_};
        if (thread == 0) write_cache_rows(key_cache, slot_mapping, key.view(heads), kv_format_);
        if (thread == team - 1) write_cache_rows(value_cache, slot_mapping, value.view(heads), kv_format_);
      });
#pragma omp barrier
      phase([&] {
        paged_attention_into(query, key_cache, value_cache, block_tables, seq_lens, query_starts, block_size, scale_,
                             kv_format_, sinks, window, tree_masks, attention);
      });
#pragma omp barrier
      phase([&] { linear(layer, 1, o_input, o_weight, o_scales, kNone, hidden_size_, attention_out); });
#pragma omp barrier
      phase([&] {
        after_attention = attention_out.clone();  // becomes this thread's residual stream
        linear(layer, 2, add_rms_norm(after_attention, residual, post_norm, eps_), gate_up_weight, gate_up_scales,
               kNone, 2 * intermediate_size_, gate_up);
      });
#pragma omp barrier
      phase([&] {
        linear(layer, 3, silu_and_mul(gate_up), down_weight, down_scales, kNone, hidden_size_, mlp_out);
      });
#pragma omp barrier
      phase([&] { residual = after_attention + mlp_out; });
    }
    if (thread == 0) phase([&] { result = rms_norm(residual, final_norm_, eps_); });
  }
  if (error) std::rethrow_exception(error);
  return result;
}
