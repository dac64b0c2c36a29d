"""Test fixtures shared across test folders: a tiny random Llama with the real tokenizer."""

from __future__ import annotations

import os

import torch
import transformers

from llmserve.model_loader import default_model_path, load_tokenizer


def make_tiny_llama_dir(path: str, seed: int = 0, **config_overrides) -> str:
    """Write a tiny random HF Llama directory (safetensors) with the default model's tokenizer and
    chat template, so tests get realistic text handling at a fraction of the cost."""
    os.makedirs(path, exist_ok=True)
    tokenizer = load_tokenizer(default_model_path())
    config = dict(
        vocab_size=tokenizer.vocab_size,
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
    config.update(config_overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    with torch.no_grad():  # larger weights than HF's init make logits peaked, so greedy is stable
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.hf.save_pretrained(path)
    return path
