"""A LoRA adapter read from a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`).

Each targeted linear layer W gets W + scale * B @ A, scale = lora_alpha / r (rsLoRA: lora_alpha /
sqrt(r)). Only what this math covers is read; any config field that would change it (DoRA, per-layer
ranks, a LoRA bias, extra trained modules, ...) is refused in one line rather than ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# The Llama-family projections an adapter may target (the HF checkpoint's module names; Phi-3's
# checkpoint has q/k/v and gate/up fused already)
TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)

# config field -> (value that keeps the plain LoRA math, the refusal's reason)
_REFUSED_FIELDS = {
    "use_dora": (False, "DoRA adapters are not supported"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern) are not supported"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern) are not supported"),
    "bias": ("none", "adapters that train biases are not supported"),
    "lora_bias": (False, "adapters with a LoRA bias are not supported"),
    "modules_to_save": (None, "adapters with fully trained modules (modules_to_save) are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out adapters (Conv1D bases) are not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
    "target_parameters": (None, "adapters on parameters (target_parameters) are not supported"),
    "trainable_token_indices": (None, "trainable_token_indices is not supported"),
    "use_qalora": (False, "QA-LoRA adapters are not supported"),
}

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# the text model's decoder layers under PEFT's wrapper: a CausalLM's `model.layers`, a bare model's
# `layers`, an image-and-text model's language model (model_loader/multimodal.py's two spellings);
# a vision tower's `...encoder.layers.N.self_attn` is not among them
_TEXT_PREFIX = re.compile(
    r"(?:base_model\.model\.)?(?:model\.|language_model\.model\.|model\.language_model\.)?"
)


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with rsLoRA
    # (layer index, module name such as "q_proj") -> (A [rank, in_features], B [out_features, rank])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def check_adapter_config(config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config; ValueError in one line for anything else."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"peft_type {peft_type!r} is not a LoRA adapter")
    for name, (plain, reason) in _REFUSED_FIELDS.items():
        value = config.get(name, plain)
        if value != plain and (value or plain):  # None, {}, [] and False all mean "off"
            raise ValueError(f"{reason} ({name}={value!r})")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", 8))
    if rank <= 0:
        raise ValueError(f"adapter rank r={rank} is not a LoRA rank (r must be >= 1)")
    if rank > max_rank:
        raise ValueError(f"adapter rank {rank} exceeds --max-lora-rank {max_rank}")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError("target_modules given as a regular expression is not supported; list the modules")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"target modules {unknown} are not supported (only {', '.join(TARGET_MODULES)})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale


def load_peft_adapter(name: str, path: str, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter in PEFT directory `path`, its weights in `dtype` on the host."""
    directory = Path(path)
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(
            f"{path} is not a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)"
        )
    rank, scale = check_adapter_config(json.loads(config_file.read_text()), max_rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise ValueError(f"adapter tensor {key!r} is not a LoRA weight of a supported module")
        prefix = key[: match.start()]  # what precedes ".layers.N" (its dot is the match's)
        if not _TEXT_PREFIX.fullmatch(prefix + "." if prefix else ""):
            raise ValueError(f"adapter tensor {key!r} is outside the language model's decoder layers")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        halves = pairs.setdefault((layer, module), {})
        if half in halves:
            raise ValueError(f"adapter {name!r} has lora_{half} of {module} in layer {layer} twice ({key!r})")
        halves[half] = tensor.to(dtype)
    weights = {}
    for target, halves in pairs.items():
        if set(halves) != {"A", "B"}:
            raise ValueError(f"adapter {name!r} lacks lora_{'AB'[('A' in halves)]} of layer {target}")
        a, b = halves["A"], halves["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"adapter {name!r} has rank {a.shape[0]} at layer {target}, its config says {rank}"
            )
        weights[target] = (a.contiguous(), b.contiguous())
    if not weights:
        raise ValueError(f"adapter {name!r} has no LoRA weights")
    return LoRAAdapter(name, str(path), rank, scale, weights)
