// A draft head's greedy drafting chain, all its steps in one call (draft_head.cpp).
#pragma once

#include "aten.h"

#include <tuple>

class DraftHeadChain {
 public:
  // The head's tensors (spec_decode/proposers/draft_head.py): the target's input embedding [V, H],
  // token_norm [H], fc_in [I, 2H] and fc_out [H, I] packed for the small-batch kernel of the
  // activations' dtype (small_batch_pack_f32 for float32, small_batch_pack for bf16) with their
  // biases, out_norm [H], the lm_head rows of the vocabulary subset packed the same way, and the
  // subset's token ids [S] (int64).
  DraftHeadChain(at::Tensor embed_weight, at::Tensor token_norm, at::Tensor fc_in, at::Tensor fc_in_bias,
                 at::Tensor fc_out, at::Tensor fc_out_bias, at::Tensor out_norm, at::Tensor subset_head,
                 at::Tensor vocab_ids, int64_t intermediate_size, double eps);

  // feature [B, H] (B <= 8): the target's final hidden states; tokens [B] int64: the tokens sampled
  // from them. Up to max_steps greedy drafts per row, stopping after the step where no row's chained
  // confidence (the product of its top probabilities) reaches min_confidence; returns the drafts
  // [B, steps] (int64 token ids) and whether each row's chain still held there [B, steps] (bool).
  std::tuple<at::Tensor, at::Tensor> greedy(at::Tensor feature, at::Tensor tokens, int64_t max_steps,
                                            double min_confidence) const;

 private:
  at::Tensor embed_weight_, token_norm_, fc_in_, fc_in_bias_, fc_out_, fc_out_bias_, out_norm_, subset_head_,
      vocab_ids_;
  int64_t intermediate_size_, hidden_size_, subset_size_;
  double eps_;
};
