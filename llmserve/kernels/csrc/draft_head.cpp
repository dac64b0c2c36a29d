// A draft head's greedy drafts (spec_decode/proposers/draft_head.py), every step in one call.
//
// A head step is a dozen small ops on one to eight rows (embedding, two norms, two linears, SiLU, the
// subset logits, the argmax and the chained confidence); from Python their dispatch costs as much as
// their kernels. This runs the same kernels in the same order as
// DraftHead.forward and DraftHeadProposer.propose's greedy loop (rms_norm, small_batch_linear[_f32]
// plus the bias, silu, the residual add, greedy_sample, softmax and amax in float32), so its drafts
// and confidences are bit-identical to that loop (tested); only the dispatch goes.
#include "draft_head.h"

#include <vector>

#include "kernels.h"

namespace {

// x W^T + b (a head's linears have biases).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias,
                  int64_t out_features) {
  auto out = small_batch_linear_packed(x, packed, at::Tensor(), out_features);
  return bias.defined() ? out + bias : out;
}

// The subset logits in float32, as the head's LogitsLinear computes them (kernels/small_batch_linear.py).
at::Tensor subset_logits(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  if (x.scalar_type() == at::kBFloat16) return small_batch_linear_float_out(x, packed, out_features);
  return small_batch_linear_packed(x, packed, at::Tensor(), out_features);
}

}  // namespace

DraftHeadChain::DraftHeadChain(at::Tensor embed_weight, at::Tensor token_norm, at::Tensor fc_in,
                               at::Tensor fc_in_bias, at::Tensor fc_out, at::Tensor fc_out_bias,
                               at::Tensor out_norm, at::Tensor subset_head, at::Tensor vocab_ids,
                               int64_t intermediate_size, double eps)
    : embed_weight_(std::move(embed_weight)),
      token_norm_(std::move(token_norm)),
      fc_in_(std::move(fc_in)),
      fc_in_bias_(std::move(fc_in_bias)),
      fc_out_(std::move(fc_out)),
      fc_out_bias_(std::move(fc_out_bias)),
      out_norm_(std::move(out_norm)),
      subset_head_(std::move(subset_head)),
      vocab_ids_(std::move(vocab_ids)),
      intermediate_size_(intermediate_size),
      hidden_size_(out_norm_.numel()),
      subset_size_(vocab_ids_.numel()),
      eps_(eps) {
  TORCH_CHECK(embed_weight_.dim() == 2 && embed_weight_.size(1) == hidden_size_,
              "DraftHeadChain: the embedding must be [vocab, hidden_size]");
  TORCH_CHECK(vocab_ids_.scalar_type() == at::kLong, "DraftHeadChain: vocab_ids must be int64");
}

std::tuple<at::Tensor, at::Tensor> DraftHeadChain::greedy(at::Tensor feature, at::Tensor tokens,
                                                          int64_t max_steps, double min_confidence) const {
  TORCH_CHECK(feature.dim() == 2 && feature.size(1) == hidden_size_ && feature.size(0) >= 1 && feature.size(0) <= 8,
              "DraftHeadChain.greedy: feature must be [1-8, hidden_size]");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == feature.size(0) && tokens.scalar_type() == at::kLong,
              "DraftHeadChain.greedy: tokens must be [rows] int64");
  TORCH_CHECK(max_steps >= 1, "DraftHeadChain.greedy: max_steps must be >= 1");
  feature = feature.contiguous();
  std::vector<at::Tensor> drafts, confident;
  auto chained = at::ones({feature.size(0)}, feature.options().dtype(at::kFloat));
  for (int64_t step = 0; step < max_steps; ++step) {
    auto embedded = rms_norm(embed_weight_.index_select(0, tokens), token_norm_, eps_);
    auto hidden = at::silu(linear(at::cat({feature, embedded}, 1), fc_in_, fc_in_bias_, intermediate_size_));
    feature = rms_norm(feature + linear(hidden, fc_out_, fc_out_bias_, hidden_size_), out_norm_, eps_);
    auto logits = subset_logits(feature, subset_head_, subset_size_);
    tokens = vocab_ids_.index_select(0, greedy_sample(logits));
    chained = chained * at::softmax(logits.to(at::kFloat), -1).amax(-1);
    drafts.push_back(tokens);
    confident.push_back(chained >= min_confidence);
    if (!confident.back().any().item<bool>()) break;
  }
  return {at::stack(drafts, 1), at::stack(confident, 1)};
}
