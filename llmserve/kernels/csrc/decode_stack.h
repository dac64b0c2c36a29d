// A Llama-family model's decoder layers for a small decode batch, run in one call (decode_stack.cpp).
#pragma once

#include "aten.h"

#include <atomic>
#include <functional>
#include <optional>
#include <vector>

class DecodeStack {
 public:
  // Per layer, in this order: input_norm, qkv, qkv_scales, qkv_bias (or an empty tensor), o, o_scales,
  // post_norm, gate_up, gate_up_scales, down, down_scales, key_cache, value_cache, then the oneDNN-blocked
  // copies of the qkv, o, gate_up and down weights (or empty tensors), then q_norm and k_norm (Qwen3's
  // RMSNorm over each query and key head before rope, one weight of head_dim each; or empty tensors),
  // then router, router_scales, router_onednn and moe_params: a mixture-of-experts layer's router (a
  // linear layer as the others) and int64 [first_expert, router_experts, top_k, renormalize,
  // intermediate_size], its gate_up and down slots holding the held experts' int8/int4 weights stacked
  // as moe_experts takes them (softmax over the router's logits in float32, the top k, renormalized to
  // sum 1 where asked, as SparseMoE.route); a dense layer has four empty tensors there.
  // A linear's weight is packed by
  // small_batch_pack (bf16; its scales an empty tensor), small_batch_pack_f32 (float32, in a float32
  // model; scales empty), small_batch_pack_int8 (uint8, with float32 scales per output row) or
  // small_batch_pack_int4 (uint8, with its 4-D parameters); the oneDNN copies are those of
  // SmallBatchLinear.packed_weight (torch.ops.mkldnn._reorder_linear_weight). amx_max_rows: bf16
  // weights take amx_linear from 9 rows to this many (SmallBatchLinear.amx, AMX_MAX_ROWS), 0: never.
  // kernel_max_rows: bf16 weights take the small-batch kernel up to this many rows (at least 8;
  // SmallBatchLinear.kernel_max_rows), then AMX or oneDNN. kv_format: the caches' rows (kv_format.py's
  // kernel codes): 0 the model's dtype, 1 int8 or 2 fp8 codes with a float16 scale per row, each new
  // row quantized as QuantizedKVCacheFormat.quantize does, by the same ATen ops.
  DecodeStack(std::vector<at::Tensor> layer_tensors, at::Tensor final_norm, at::Tensor cos,
              at::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t intermediate_size, double eps, double scale, int64_t amx_max_rows,
              int64_t kernel_max_rows, int64_t kv_format);

  // hidden [T, D] in the model's dtype (the embedded tokens), every sequence a decode or a short span;
  // T <= 8, or more where every linear layer has its oneDNN copy (more than 8 rows take AMX, the
  // small-batch kernel or oneDNN's GEMM, as SmallBatchLinear.forward does); returns the final norm of
  // the last layer's output, like LlamaModel.forward.
  // Under tensor parallelism: the sum over the ranks, in place, of the o and down projections' partial
  // outputs (the layers are the rank's shards); without one the stack is the whole model's.
  void set_all_reduce(std::function<void(at::Tensor)> all_reduce) { all_reduce_ = std::move(all_reduce); }

  // LoRA adapters (lora/weights.py): per layer (a, bt, widths, shard_starts) of qkv, o, gate_up and down;
  // a forward given token_slots adds each row's delta after each of those projections (lora_delta; in the
  // one region lora_shrink_part and lora_expand_part), before the all-reduce of o and down, as the
  // modules' hooks do. The stacks' shapes are checked here (lora_check_stacks), a step's slots and the
  // stacks' widths once per forward.
  void set_lora(std::vector<at::Tensor> lora_tensors);

  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_starts,
                     int64_t block_size, int64_t sinks, int64_t window,
                     const std::optional<at::Tensor>& token_slots,
                     const std::optional<at::Tensor>& tree_masks = std::nullopt) const;

  // Steps forward ran in one parallel region (forward_in_one_region); tests check a configuration takes it.
  int64_t one_region_calls() const { return one_region_calls_; }

 private:
  // The same layers with the step's threads held in one OpenMP region from the first layer to the final
  // norm: each linear layer's blocks and attention's (sequence, head) items split among them, a barrier
  // after each, the small per-row operations repeated by every thread on its own copy of the row (a few
  // KiB) instead of handed off. At 1-8 rows a layer's kernels are short enough that starting and joining
  // the threads for each (five times a layer) was a large share of the step. Each kernel computes what
  // its own call computes, so the output is the same bits. Taken when every dense layer's projections
  // are int8, int4 or bf16 (a q/k/v layer of two formats as two parts, joined after the barrier; not with
  // adapters) and the step has at most 8 rows and one rank; adapters' deltas are added by the thread
  // that wrote each output row.
  at::Tensor forward_in_one_region(const at::Tensor& hidden, const at::Tensor& positions,
                                   const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const at::Tensor& query_starts, int64_t block_size,
                                   int64_t sinks, int64_t window, const std::optional<at::Tensor>& token_slots,
                                   const std::optional<at::Tensor>& tree_masks, int64_t threads) const;

  static constexpr int kTensorsPerLayer = 26;
  static constexpr int kLoraTensorsPerLayer = 16;
  std::vector<at::Tensor> tensors_;
  std::vector<at::Tensor> lora_;  // empty: no adapters bound
  at::Tensor final_norm_, cos_, sin_;
  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_size_, hidden_size_;
  int64_t amx_max_rows_, kernel_max_rows_, kv_format_;
  double eps_, scale_;
  std::function<void(at::Tensor)> all_reduce_;
  bool region_layers_ = false;  // every layer dense with int8/int4 or bf16 small-batch projections
  bool two_part_qkv_ = false;     // some layer's q/k/v in two formats (qkv_tail)
  mutable std::atomic<int64_t> one_region_calls_{0};
};
