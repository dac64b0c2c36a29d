// The decoder layers of a decode step at small batch, one call from Python instead of ~12 per layer.
//
// At batch 1 the kernels of a SmolLM2 step take about 8 ms, and calling them from Python (module
// calls, argument checks, views, pybind conversions: ~100 us per layer) added about 3 ms more. This
// runs the same kernels in the same order on the same tensors as LlamaDecoderLayer.forward does on
// the CPU (small_batch_linear, rms_norm, rotary_embedding, write_kv_rows, paged_attention,
// add_rms_norm, silu_and_mul, the residual add), so its output is bit-identical to the Python path
// (tested); only the dispatch goes. Linear layers may be bf16, per-channel int8 or group-wise int4,
// each through its small-batch kernel, or float32 in a float32 model (linear_f32.cpp). The model uses
// it when every sequence is a decode or a short span and the batch fits the small-batch linear kernel
// (models/decode_stack.py says when).
#include "decode_stack.h"
#include "kernels.h"

torch::Tensor small_batch_linear_packed(const torch::Tensor& x, const torch::Tensor& weight,
                                        const torch::Tensor& scales, int64_t out_features) {
  if (x.scalar_type() == torch::kFloat) return small_batch_linear_f32(x, weight, out_features);
  if (weight.scalar_type() == torch::kByte && scales.dim() == 4)
    return small_batch_linear_int4(x, weight, scales, out_features);
  if (weight.scalar_type() == torch::kByte) return small_batch_linear_int8(x, weight, scales, out_features);
  return small_batch_linear(x, weight, out_features);
}

DecodeStack::DecodeStack(std::vector<torch::Tensor> layer_tensors, torch::Tensor final_norm, torch::Tensor cos,
                         torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t intermediate_size, double eps, double scale)
    : tensors_(std::move(layer_tensors)),
      final_norm_(std::move(final_norm)),
      cos_(std::move(cos)),
      sin_(std::move(sin)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      intermediate_size_(intermediate_size),
      hidden_size_(final_norm_.numel()),
      eps_(eps),
      scale_(scale) {
  TORCH_CHECK(!tensors_.empty() && tensors_.size() % kTensorsPerLayer == 0,
              "DecodeStack takes 13 tensors per layer");
}

torch::Tensor DecodeStack::forward(torch::Tensor hidden, torch::Tensor positions, torch::Tensor slot_mapping,
                                   torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_starts,
                                   int64_t block_size, int64_t sinks, int64_t window) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size_, "hidden must be [tokens, hidden_size]");
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t qkv_size = q_size + 2 * kv_size;
  for (size_t base = 0; base < tensors_.size(); base += kTensorsPerLayer) {
    const torch::Tensor* t = tensors_.data() + base;
    const auto& [input_norm, qkv_weight, qkv_scales, qkv_bias, o_weight, o_scales, post_norm, gate_up_weight,
                 gate_up_scales, down_weight, down_scales, key_cache, value_cache] =
        std::tie(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11], t[12]);
    // attention block
    auto qkv = small_batch_linear_packed(rms_norm(hidden, input_norm, eps_), qkv_weight, qkv_scales, qkv_size);
    if (qkv_bias.defined() && qkv_bias.numel()) qkv = qkv + qkv_bias;
    auto query = qkv.narrow(1, 0, q_size), key = qkv.narrow(1, q_size, kv_size);
    auto value = qkv.narrow(1, q_size + kv_size, kv_size);
    rotary_embedding(positions, query, key, cos_, sin_, head_dim_);
    write_kv_rows(key_cache, slot_mapping, key.view({tokens, num_kv_heads_, head_dim_}));
    write_kv_rows(value_cache, slot_mapping, value.view({tokens, num_kv_heads_, head_dim_}));
    auto attention = paged_attention(query.view({tokens, num_heads_, head_dim_}).contiguous(), key_cache,
                                     value_cache, block_tables, seq_lens, query_starts, block_size, scale_,
                                     /*kv_format=*/0, sinks, window);
    auto attention_out = small_batch_linear_packed(attention.view({tokens, q_size}), o_weight, o_scales, hidden_size_);
    // attention_out becomes the residual stream; its norm feeds the MLP
    auto normed = add_rms_norm(attention_out, hidden, post_norm, eps_);
    auto gate_up = small_batch_linear_packed(normed, gate_up_weight, gate_up_scales, 2 * intermediate_size_);
    hidden = attention_out + small_batch_linear_packed(silu_and_mul(gate_up), down_weight, down_scales, hidden_size_);
  }
  return rms_norm(hidden, final_norm_, eps_);
}
