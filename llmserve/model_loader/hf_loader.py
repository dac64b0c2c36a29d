"""HF model directories: config.json and *.safetensors (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os

import torch

from llmserve.config import ModelArchConfig
from llmserve.model_loader.errors import ModelLoadError

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def arch_config(path: str) -> ModelArchConfig:
    try:
        with open(os.path.join(path, "config.json")) as file:
            config = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: unreadable config.json ({error})") from None
    names = config.get("architectures") or []
    arch = next((_ARCHITECTURES[n] for n in names if n in _ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {names} (supported: {', '.join(_ARCHITECTURES)})"
        )
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    heads = config["num_attention_heads"]
    eos = config.get("eos_token_id")
    return ModelArchConfig(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window", True) else None,
    )


def load_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except Exception as error:  # noqa: BLE001 - a corrupt shard
            raise ModelLoadError(f"{file}: unreadable safetensors ({error})") from None
    return weights
