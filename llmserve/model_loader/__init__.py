"""Loading a model: its path, architecture, weights (HF names, requested dtype) and tokenizer."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import torch

from llmserve.config import ModelArchConfig
from llmserve.model_loader import cache, gguf_loader, hf_loader
from llmserve.model_loader.default_model import default_model_path, resolve_model_path
from llmserve.model_loader.errors import ModelLoadError
from llmserve.model_loader.tokenizer import Tokenizer
from llmserve.model_loader.tokenizer import load_tokenizer as _load_tokenizer

__all__ = [
    "ModelLoadError",
    "Tokenizer",
    "default_model_path",
    "load_arch_config",
    "load_tokenizer",
    "load_weights",
    "resolve_model_path",
]

logger = logging.getLogger("llmserve")


def load_arch_config(path: str) -> ModelArchConfig:
    if os.path.isdir(path):
        return hf_loader.arch_config(path)
    # Parsing a GGUF's metadata reads its whole vocabulary (seconds), so the result is cached.
    entry = cache.entry_path(path, "arch.json")
    if entry.is_file():
        fields = json.loads(entry.read_text())
        return ModelArchConfig(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})
    arch = gguf_loader.arch_config(gguf_loader.open_gguf(path), path)
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = entry.with_name(f".{entry.name}.{os.getpid()}")
    staging.write_text(json.dumps(dataclasses.asdict(arch)))
    os.replace(staging, entry)
    return arch


def load_weights(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights under HF names in `dtype`; a GGUF is dequantized once and cached as safetensors."""
    weights = hf_loader.load_weights(path) if os.path.isdir(path) else _cached_gguf_weights(path)
    return {name: tensor.to(dtype) for name, tensor in weights.items()}


def _cached_gguf_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    entry = cache.entry_path(path, "weights.safetensors")
    if entry.is_file():
        return load_file(entry)
    reader = gguf_loader.open_gguf(path)
    weights = gguf_loader.load_weights(reader, gguf_loader.arch_config(reader, path), path)
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = entry.with_name(f".{entry.name}.{os.getpid()}")
    save_file(weights, staging)
    os.replace(staging, entry)
    logger.info("cached the dequantized weights of %s at %s", path, entry)
    return weights


def load_tokenizer(path: str, eos_token_ids: tuple[int, ...] | None = None) -> Tokenizer:
    """The tokenizer; a GGUF's EOS ids come from its metadata (pass them if already known)."""
    if eos_token_ids is None:
        eos_token_ids = () if os.path.isdir(path) else load_arch_config(path).eos_token_ids
    return _load_tokenizer(path, eos_token_ids)
