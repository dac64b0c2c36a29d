// The compiled kernels' entry points: bound to Python in module.cpp, called directly by decode_stack.cpp,
// and included by the file that defines each, so a signature that drifts fails to compile.
#pragma once

#include "aten.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

// threads.cpp: a thread's part of a kernel's work inside a caller's OpenMP region (decode_stack.cpp's
// one region per step). With `threads` > 0 the bf16, int8 and int4 small-batch linear kernels and
// paged_attention run only this thread's part of their work, on the calling thread, and lora_delta adds
// the deltas of the output rows this thread's last linear kernel wrote; the caller synchronizes. Each
// part is computed as in a call of its own, so the outputs are the same bits.
struct ThreadShare {
  int64_t thread = 0, threads = 0;
  // the output rows [rows_begin, rows_end) of the last linear kernel this thread ran its part of:
  // lora_delta adds its deltas to those rows, which no other thread writes
  int64_t rows_begin = 0, rows_end = 0;
};
ThreadShare& thread_share();  // the calling thread's
class ThreadShareGuard {
 public:
  ThreadShareGuard(int64_t thread, int64_t threads) : saved_(thread_share()) {
    thread_share() = {thread, threads, 0, 0};
  }
  ~ThreadShareGuard() { thread_share() = saved_; }
  ThreadShareGuard(const ThreadShareGuard&) = delete;
  ThreadShareGuard& operator=(const ThreadShareGuard&) = delete;

 private:
  ThreadShare saved_;
};

// Inside a caller's region: runs this thread's contiguous part of `items` 32-row blocks of an
// n_rows-row output as run(first, end) and records its rows; returns false (nothing run) outside one.
template <typename Run>
bool run_thread_part(int64_t items, int64_t n_rows, const Run& run) {
  ThreadShare& share = thread_share();
  if (share.threads <= 0) return false;
  const int64_t chunk = (items + share.threads - 1) / share.threads;
  const int64_t first = std::min(items, share.thread * chunk), last = std::min(items, (share.thread + 1) * chunk);
  run(first, last);
  share.rows_begin = std::min(n_rows, first * 32);
  share.rows_end = std::min(n_rows, last * 32);
  return true;
}

// paged_attention.cpp, prefill_attention.cpp, prefill_attention_fma.cpp
at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_starts,
                           int64_t block_size, double scale, int64_t kv_format, int64_t sinks, int64_t window,
                           const std::optional<at::Tensor>& tree_masks = std::nullopt);
// the same into out [T, H, D] (query's dtype, contiguous)
void paged_attention_into(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                          int64_t block_size, double scale, int64_t kv_format, int64_t sinks, int64_t window,
                          const std::optional<at::Tensor>& tree_masks, at::Tensor& out);
std::string paged_attention_path(at::ScalarType dtype, int64_t kv_format, int64_t head_dim);
// paged_attention_low_bit.cpp: one query per sequence over an int4/int2 cache, its windows and sinks
at::Tensor paged_attention_low_bit(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor window_keys, at::Tensor window_values, at::Tensor sink_keys,
                                   at::Tensor sink_values, at::Tensor block_tables, at::Tensor seq_lens,
                                   at::Tensor window_slots, at::Tensor sink_entries, int64_t block_size,
                                   int64_t window_blocks, int64_t sink_tokens, double scale, int64_t bits);
bool paged_attention_low_bit_supported(at::ScalarType dtype, int64_t head_dim);
std::vector<at::Tensor> quantize_low_bit_blocks(at::Tensor keys, at::Tensor values, int64_t bits);
at::Tensor prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                             at::Tensor context_slots, double scale, bool use_amx);
bool prefill_attention_supported(at::ScalarType dtype);
std::string prefill_attention_path(at::ScalarType dtype);
bool prefill_attention_amx_supported();
bool prefill_attention_fma_supported();
// the body of prefill_attention in float32 arithmetic (float32 or bf16 tensors), after its checks:
// out [Q, H, D] is filled
void prefill_attention_fma(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const int64_t* slots, int64_t context, double scale,
                           at::Tensor& out);

// linear.cpp, linear_quantized.cpp
at::Tensor small_batch_pack(at::Tensor weight);
at::Tensor small_batch_linear(at::Tensor x, at::Tensor packed, int64_t out_features);
// the same into out [M, out_features] (bf16, contiguous)
void small_batch_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, at::Tensor& out);
at::Tensor small_batch_linear_float_out(at::Tensor x, at::Tensor packed, int64_t out_features);
bool small_batch_linear_supported();
// linear_amx.cpp: the same packed bf16 weight, any row count, on AMX's tile products
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, const std::optional<at::Tensor>& bias,
                      int64_t out_features, bool float_out);
bool amx_linear_supported();

// linear_f32.cpp
at::Tensor small_batch_pack_f32(at::Tensor weight);
at::Tensor small_batch_linear_f32(at::Tensor x, at::Tensor packed, int64_t out_features);
bool small_batch_linear_f32_supported();
at::Tensor small_batch_pack_int8(at::Tensor qweight);
at::Tensor small_batch_pack_int8_group_scales(at::Tensor scales);
at::Tensor small_batch_linear_int8(at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t out_features);
at::Tensor small_batch_linear_int8_float_out(at::Tensor x, at::Tensor packed, at::Tensor scales,
                                             int64_t out_features);
bool small_batch_linear_int8_supported(at::ScalarType input = at::kBFloat16);  // for inputs of this dtype
std::vector<at::Tensor> small_batch_pack_int4(at::Tensor codes, at::Tensor scales, at::Tensor offsets,
                                              int64_t bits = 4);  // 5: codes 0..31, a plane of fifth bits
at::Tensor small_batch_linear_int4(at::Tensor x, at::Tensor packed, at::Tensor params, int64_t out_features);
// A mixture-of-experts projection: x's rows [ends[e - 1], ends[e]) against expert e's packed weights.
at::Tensor grouped_linear_int8(at::Tensor x, at::Tensor ends, at::Tensor packed, at::Tensor scales,
                               int64_t out_features);
at::Tensor grouped_linear_int4(at::Tensor x, at::Tensor ends, at::Tensor packed, at::Tensor params,
                               int64_t out_features);

// moe.cpp: a mixture-of-experts layer's quantized experts in one call, and its combine step.
at::Tensor moe_combine(at::Tensor rows, at::Tensor weights, at::Tensor order);
at::Tensor moe_experts(at::Tensor hidden, at::Tensor weights, at::Tensor experts,
                       at::Tensor gate_up_packed, at::Tensor gate_up_scales, at::Tensor down_packed,
                       at::Tensor down_scales, int64_t intermediate_size, int64_t out_features,
                       int64_t first_expert, int64_t num_experts);
at::Tensor small_batch_dequantize_int4(at::Tensor packed, at::Tensor params, int64_t out_features,
                                       int64_t bits = 4, const std::optional<at::Tensor>& rows = std::nullopt);
at::Tensor small_batch_dequantize_int8(at::Tensor packed, at::Tensor scales, int64_t out_features,
                                       const std::optional<at::Tensor>& rows = std::nullopt);

// decode_stack.cpp: x W^T through the small-batch kernel for W's packed format and x's dtype: uint8 W ->
// small_batch_linear_int8 (scales [N] or [blocks, groups, 32]) or small_batch_linear_int4 (4-D params; 4- or
// 5-bit codes, told apart by the packed width), for
// bf16 x or, at the AVX2 level, float32 x; otherwise float32 x -> small_batch_linear_f32 (W packed float32,
// or bf16 for a draft head), bf16 x -> small_batch_linear (bf16 W). What SmallBatchLinear, PackedLinear and
// the quantized kernels run from Python, for the compiled compositions of them (DecodeStack, DraftHeadChain).
at::Tensor small_batch_linear_packed(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& scales, int64_t out_features);
// x W^T for int8 (2-D scales or group scales) or int4 (4-D params) weights as small_batch_linear_packed
// computes it, into out [M, out_features] (x's dtype, contiguous)
void small_batch_linear_quantized_into(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                                       int64_t out_features, at::Tensor& out);

// elementwise.cpp, kv_write.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor cos,
                      at::Tensor sin, int64_t head_dim);
at::Tensor silu_and_mul(at::Tensor gate_up);
void write_kv_rows(at::Tensor cache, at::Tensor slots, at::Tensor rows);

// greedy.cpp
at::Tensor greedy_sample(at::Tensor logits);
// threads.cpp
bool set_omp_thread_cpus(const std::vector<std::vector<int64_t>>& cpus_per_thread);

// lora.cpp
bool lora_delta_supported();
void lora_delta(const at::Tensor& x, at::Tensor out, const at::Tensor& a, const at::Tensor& bt,
                const at::Tensor& token_slots, const at::Tensor& widths, const at::Tensor& shard_starts);
// lora_delta's checks of a layer's stacks (once, where a caller binds them) and of a step's slots and the
// stacks' widths (once a step; an adapter loaded between steps rewrites its slot's widths)
void lora_check_stacks(const at::Tensor& a, const at::Tensor& bt, const at::Tensor& widths,
                       const at::Tensor& shard_starts, int64_t in_features, int64_t out_features);
void lora_check_step(const at::Tensor& a, const at::Tensor& widths, int64_t shards, const at::Tensor& token_slots,
                     int64_t rows);
// Inside a caller's region (ThreadShare), lora_delta in two halves around a linear kernel's part: each
// thread shrinks its share of the columns into the exchange before its part of the linear, then expands
// all of them into the output rows it wrote, once every thread has arrived (no barrier: the linear part
// between the two has long covered the wait). `call` counts the region's calls, the same on every
// thread. Arguments as lora_delta's, checked beforehand (lora_check_stacks, lora_check_step); at most
// kMaxRows rows.
struct LoraExchange {
  // a step's rows; rank times shards (lora/weights.py keeps wider stacks off the kernel)
  static constexpr int64_t kMaxRows = 8, kMaxWidth = 512;
  std::atomic<int64_t> arrived{0};
  const std::atomic<bool>* failed = nullptr;  // a thread that failed may never arrive: the others give up
  // by the call's parity: the stack's barrier after each phase keeps a call's values until every thread
  // has expanded them; two calls of one phase (no barrier between) write different buffers
  float hidden[2][kMaxRows][kMaxWidth];
};
void lora_shrink_part(const at::Tensor& x, const at::Tensor& a, const at::Tensor& token_slots,
                      const at::Tensor& widths, int64_t call, LoraExchange& exchange);
void lora_expand_part(at::Tensor& out, const at::Tensor& bt, const at::Tensor& token_slots,
                      const at::Tensor& widths, const at::Tensor& shard_starts, int64_t call,
                      LoraExchange& exchange);
