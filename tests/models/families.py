"""Tiny random checkpoints of each supported family, built with transformers' own classes."""

from __future__ import annotations

import os

import torch
import transformers

from llmserve.model_loader import default_model_path, load_tokenizer

VOCAB = 49152  # the default model's, so its tokenizer and chat template serve the tiny models
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=None,  # greedy runs the full length on both sides
    pad_token_id=0,
)


def _factors(count: int, top: float) -> list[float]:
    """LongRoPE's per-frequency divisors: 1 for the highest frequency up to `top` for the lowest."""
    return torch.linspace(1.0, top, count).tolist()


# case -> (config class, model class, non-default values the case exercises)
CASES: dict[str, tuple[type, type, dict]] = {
    "qwen3-qk-norm": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(rope_theta=50000.0, tie_word_embeddings=False),
    ),
    "qwen3-tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(tie_word_embeddings=True)),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral-sliding-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=16, rope_theta=20000.0),
    ),
    "phi3-partial-rotary": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(partial_rotary_factor=0.5, rope_theta=30000.0),
    ),
    "phi3-longrope-short": (  # max_model_len (128) within the original context: the short factors
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            partial_rotary_factor=0.75,
            original_max_position_embeddings=256,
            max_position_embeddings=1024,
            rope_scaling=dict(
                rope_type="longrope", short_factor=_factors(6, 1.5), long_factor=_factors(6, 9.0)
            ),
        ),
    ),
    "phi3-longrope-long": (  # prompts longer than the original context (8): the long factors
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            original_max_position_embeddings=8,
            max_position_embeddings=512,
            rope_scaling=dict(
                rope_type="longrope", short_factor=_factors(8, 1.5), long_factor=_factors(8, 9.0)
            ),
        ),
    ),
    "gemma2-softcap-interleaved-window": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            rope_theta=20000.0,
        ),
    ),
    "gemma3-qk-norm-local-rope": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=32,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
            },
        ),
    ),
    "mixtral-top2-of-4": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, rope_theta=40000.0),
    ),
    "qwen3-moe-dense-layer": (  # layer 1 dense, experts' weights not renormalized
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1]),
    ),
}


def make_family_dir(path: str, case: str, seed: int = 0) -> transformers.PreTrainedModel:
    """Save the case's tiny random model (and the default tokenizer) to `path`; return the HF model.

    Weights are drawn larger than HF's initialization so that logits are peaked (no near-ties for
    numerical noise to flip); norm weights and biases get noise so that a missed one shows."""
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
            else:
                param.add_(torch.randn_like(param) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)
    return model
