// The compiled kernels' entry points: bound to Python in module.cpp, called directly by decode_stack.cpp,
// and included by the file that defines each, so a signature that drifts fails to compile.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

// paged_attention.cpp, prefill_attention.cpp, prefill_attention_fma.cpp
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_starts,
                              int64_t block_size, double scale, int64_t kv_format, int64_t sinks, int64_t window);
std::string paged_attention_path(at::ScalarType dtype, int64_t kv_format, int64_t head_dim);
// paged_attention_low_bit.cpp: one query per sequence over an int4/int2 cache, its windows and sinks
torch::Tensor paged_attention_low_bit(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor window_keys, torch::Tensor window_values, torch::Tensor sink_keys,
                                      torch::Tensor sink_values, torch::Tensor block_tables, torch::Tensor seq_lens,
                                      torch::Tensor window_slots, torch::Tensor sink_entries, int64_t block_size,
                                      int64_t window_blocks, int64_t sink_tokens, double scale, int64_t bits);
bool paged_attention_low_bit_supported(at::ScalarType dtype, int64_t head_dim);
std::vector<torch::Tensor> quantize_low_bit_blocks(torch::Tensor keys, torch::Tensor values, int64_t bits);
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                torch::Tensor context_slots, double scale, bool use_amx);
bool prefill_attention_supported(at::ScalarType dtype);
std::string prefill_attention_path(at::ScalarType dtype);
bool prefill_attention_amx_supported();
bool prefill_attention_fma_supported();
// the body of prefill_attention in float32 arithmetic (float32 or bf16 tensors), after its checks:
// out [Q, H, D] is filled
void prefill_attention_fma(const torch::Tensor& query, const torch::Tensor& key_cache,
                           const torch::Tensor& value_cache, const int64_t* slots, int64_t context, double scale,
                           torch::Tensor& out);

// linear.cpp, linear_quantized.cpp
torch::Tensor small_batch_pack(torch::Tensor weight);
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features);
torch::Tensor small_batch_linear_float_out(torch::Tensor x, torch::Tensor packed, int64_t out_features);
bool small_batch_linear_supported();
// linear_amx.cpp: the same packed bf16 weight, any row count, on AMX's tile products
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, const std::optional<torch::Tensor>& bias,
                         int64_t out_features, bool float_out);
bool amx_linear_supported();

// linear_f32.cpp
torch::Tensor small_batch_pack_f32(torch::Tensor weight);
torch::Tensor small_batch_linear_f32(torch::Tensor x, torch::Tensor packed, int64_t out_features);
bool small_batch_linear_f32_supported();
torch::Tensor small_batch_pack_int8(torch::Tensor qweight);
torch::Tensor small_batch_pack_int8_group_scales(torch::Tensor scales);
torch::Tensor small_batch_linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t out_features);
torch::Tensor small_batch_linear_int8_float_out(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                                int64_t out_features);
bool small_batch_linear_int8_supported(at::ScalarType input = at::kBFloat16);  // for inputs of this dtype
std::vector<torch::Tensor> small_batch_pack_int4(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                                                 int64_t bits = 4);  // 5: codes 0..31, a plane of fifth bits
torch::Tensor small_batch_linear_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor params, int64_t out_features);
// A mixture-of-experts projection: x's rows [ends[e - 1], ends[e]) against expert e's packed weights.
torch::Tensor grouped_linear_int8(torch::Tensor x, torch::Tensor ends, torch::Tensor packed, torch::Tensor scales,
                                  int64_t out_features);
torch::Tensor grouped_linear_int4(torch::Tensor x, torch::Tensor ends, torch::Tensor packed, torch::Tensor params,
                                  int64_t out_features);

// moe.cpp: a mixture-of-experts layer's quantized experts in one call, and its combine step.
torch::Tensor moe_combine(torch::Tensor rows, torch::Tensor weights, torch::Tensor order);
torch::Tensor moe_experts(torch::Tensor hidden, torch::Tensor weights, torch::Tensor experts,
                          torch::Tensor gate_up_packed, torch::Tensor gate_up_scales, torch::Tensor down_packed,
                          torch::Tensor down_scales, int64_t intermediate_size, int64_t out_features,
                          int64_t first_expert, int64_t num_experts);
torch::Tensor small_batch_dequantize_int4(torch::Tensor packed, torch::Tensor params, int64_t out_features,
                                          int64_t bits = 4);
torch::Tensor small_batch_dequantize_int8(torch::Tensor packed, torch::Tensor scales, int64_t out_features);

// decode_stack.cpp: x W^T through the small-batch kernel for W's packed format and x's dtype: uint8 W ->
// small_batch_linear_int8 (scales [N] or [blocks, groups, 32]) or small_batch_linear_int4 (4-D params; 4- or
// 5-bit codes, told apart by the packed width), for
// bf16 x or, at the AVX2 level, float32 x; otherwise float32 x -> small_batch_linear_f32 (W packed float32,
// or bf16 for a draft head), bf16 x -> small_batch_linear (bf16 W). What SmallBatchLinear, PackedLinear and
// the quantized kernels run from Python, for the compiled compositions of them (DecodeStack, DraftHeadChain).
torch::Tensor small_batch_linear_packed(const torch::Tensor& x, const torch::Tensor& weight,
                                        const torch::Tensor& scales, int64_t out_features);

// elementwise.cpp, kv_write.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                      torch::Tensor sin, int64_t head_dim);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void write_kv_rows(torch::Tensor cache, torch::Tensor slots, torch::Tensor rows);

// greedy.cpp
torch::Tensor greedy_sample(torch::Tensor logits);
// threads.cpp
bool set_omp_thread_cpus(const std::vector<std::vector<int64_t>>& cpus_per_thread);

// lora.cpp
bool lora_delta_supported();
void lora_delta(const torch::Tensor& x, torch::Tensor out, const torch::Tensor& a, const torch::Tensor& bt,
                const torch::Tensor& token_slots, const torch::Tensor& widths, const torch::Tensor& shard_starts);
