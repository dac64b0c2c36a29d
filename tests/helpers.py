"""Test fixtures shared across test folders: a tiny random Llama with the real tokenizer."""

from __future__ import annotations

import os

import torch
import transformers

from llmserve.model_loader import default_model_path, load_tokenizer

__all__ = ["TINY_LLAMA_CONFIG", "default_model_path", "is_alive", "make_tiny_llama_dir"]

# Small enough to build and run in milliseconds; the vocabulary is the default model's so that the
# real tokenizer and chat template work with it.
TINY_LLAMA_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    rope_theta=10000.0,
)


def make_tiny_llama_dir(path: str, seed: int = 0, **config_overrides) -> str:
    """Write a tiny random HF Llama directory (config.json, safetensors, the default tokenizer).

    Weights are drawn larger than HF's initialization so that logits are peaked and greedy decoding
    has no near-ties that numerical noise could flip between implementations.
    """
    os.makedirs(path, exist_ok=True)
    tokenizer = load_tokenizer(default_model_path())
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY_LLAMA_CONFIG, **config_overrides})
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.hf.save_pretrained(path)
    return path


def is_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
