"""HF model directories: config.json (+ generation_config.json) and *.safetensors weights.

config.json is read directly rather than through transformers' AutoConfig so that both its current
layout (`rope_parameters` holding rope_theta) and the older one (top-level `rope_theta` and
`rope_scaling`) map onto the same ModelArchConfig without importing transformers.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from llmserve.config import ModelArchConfig
from llmserve.config.families import rope_scaling_type
from llmserve.model_loader import multimodal
from llmserve.model_loader.errors import ModelLoadError, describe
from llmserve.model_loader.prequantized import dequantized_weights, read_quantization

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model (model_loader/multimodal.py)
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_INDEX_FILE = "model.safetensors.index.json"
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def read_arch_config(path: str) -> ModelArchConfig:
    config = multimodal.language_model_config(_read_json(os.path.join(path, "config.json"), path))
    arch = _architecture(config, path)
    missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
    if missing:
        raise ModelLoadError(f"{path}: config.json lacks {', '.join(missing)}")
    heads = int(config["num_attention_heads"])
    theta, rope_scaling, local_theta = _rope(config, arch)
    try:
        rope_scaling_type(rope_scaling)
    except ValueError as error:
        raise ModelLoadError(f"{path}: {error}") from None
    quantization = read_quantization(config, path)
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        rope_scaling=rope_scaling,
        bos_token_id=config["bos_token_id"] if isinstance(config.get("bos_token_id"), int) else None,
        eos_token_ids=_eos_token_ids(path, config),
        sliding_window=_sliding_window(config),
        checkpoint_quantization=None if quantization is None else quantization.method,
        **_family_fields(config, arch, local_theta, path),
    )


def _family_fields(config: dict[str, Any], arch: str, local_theta: float | None, path: str) -> dict[str, Any]:
    """The ModelArchConfig fields only some families set (their defaults mean "as Llama")."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    fields: dict[str, Any] = {
        "qk_norm": arch in ("qwen3", "gemma3", "qwen3_moe"),
        "partial_rotary_factor": float(
            rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        ),
        "num_experts": int(config.get("num_local_experts") or config.get("num_experts") or 0),
        "num_experts_per_tok": int(config.get("num_experts_per_tok") or 0),
    }
    if arch == "qwen3_moe":
        fields.update(
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            dense_layers=_dense_layers(config),
        )
    if arch in ("gemma2", "gemma3"):
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"{path}: unsupported hidden_activation {act!r} (supported: {_ACTIVATIONS})")
        types = config.get("layer_types") or _gemma_layer_types(config)
        fields.update(
            hidden_act=act,
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or config["head_dim"]),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            layer_types=tuple(types),
            rope_local_theta=local_theta,
        )
    return fields


def _dense_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """Qwen3-MoE's layers with a dense MLP: those in mlp_only_layers or off the decoder_sparse_step."""
    step = int(config.get("decoder_sparse_step") or 1)
    only = set(config.get("mlp_only_layers") or ())
    layers = range(int(config["num_hidden_layers"]))
    return tuple(i for i in layers if i in only or (i + 1) % step)


def _gemma_layer_types(config: dict[str, Any]) -> list[str]:
    """Older config.json files: every `sliding_window_pattern`-th layer is global (Gemma 2: every 2nd)."""
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 2)
    return [
        "full_attention" if (index + 1) % pattern == 0 else "sliding_attention"
        for index in range(int(config["num_hidden_layers"]))
    ]


def _read_json(file: str, model_path: str) -> dict[str, Any]:
    name = os.path.basename(file)
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{model_path}: unreadable {name} ({describe(error)})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{model_path}: {name} is not a JSON object")
    return data


def _architecture(config: dict[str, Any], path: str) -> str:
    names = config.get("architectures") or []
    arch = next((ARCHITECTURES[name] for name in names if name in ARCHITECTURES), None)
    if arch is None:
        supported = ", ".join(ARCHITECTURES)
        raise ModelLoadError(f"{path}: unsupported architecture {names} (supported: {supported})")
    return arch


def _rope(config: dict[str, Any], arch: str) -> tuple[float, dict | None, float | None]:
    """(rope_theta, rope_scaling or None for plain rope, the sliding layers' own base or None), from
    either config.json layout; Gemma 3's current layout keeps one rope per layer type."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    local_theta = config.get("rope_local_base_freq")
    if "full_attention" in rope:
        local = rope.get("sliding_attention") or {}
        local_theta = local.get("rope_theta", local_theta)
        rope = dict(rope["full_attention"])
    theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope.pop("partial_rotary_factor", None)  # a field of its own (ModelArchConfig)
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind in ("longrope", "su") and "original_max_position_embeddings" not in rope:
        rope["original_max_position_embeddings"] = config.get("original_max_position_embeddings")
    if kind in ("longrope", "su"):
        rope.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
    scaling = None if kind == "default" else {"rope_type": kind, **rope}
    return theta, scaling, None if local_theta is None else float(local_theta)


def _eos_token_ids(path: str, config: dict[str, Any]) -> tuple[int, ...]:
    """generation_config.json decides when generation stops; config.json is the fallback."""
    generation_file = os.path.join(path, "generation_config.json")
    eos = None
    if os.path.isfile(generation_file):
        eos = _read_json(generation_file, path).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(i) for i in eos) if isinstance(eos, list) else (int(eos),)


def _sliding_window(config: dict[str, Any]) -> int | None:
    """Mistral sets sliding_window; Qwen2 also needs use_sliding_window, which is usually false."""
    if not config.get("use_sliding_window", True):
        return None
    window = config.get("sliding_window")
    return None if window is None else int(window)


def read_float_weights(
    path: str, dtype: torch.dtype, skipped: Callable[[str], bool] = lambda name: False
) -> dict[str, torch.Tensor]:
    """`read_weights`, the layers of a pre-quantized checkpoint dequantized to `dtype`
    (model_loader/prequantized.py; the `prequantized` quantization method keeps what kernels take),
    except those whose weight's name `skipped` is true of (their codes stay as they are)."""
    weights = read_weights(path)
    spec = read_quantization(read_config(path), path)
    return weights if spec is None else dequantized_weights(weights, spec, dtype, skipped)


def read_config(path: str) -> dict[str, Any]:
    """config.json of the HF directory `path`, as a dict."""
    return _read_json(os.path.join(path, "config.json"), path)


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, with its HF name and stored dtype; a multimodal checkpoint's
    language model under the text model's names, its vision tensors never read."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(file, "pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle is no dict)
                    target = multimodal.language_model_weight_name(name)
                    if target is not None:
                        weights[target] = handle.get_tensor(name)
        except Exception as error:  # a damaged shard: safetensors raises its own error type
            raise ModelLoadError(f"{file}: unreadable safetensors file ({describe(error)})") from None
    return weights


def _safetensors_files(path: str) -> list[str]:
    """The shards the index names (so stray files are ignored), else every *.safetensors file."""
    index_file = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index_file):
        weight_map = _read_json(index_file, path).get("weight_map") or {}
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            shards = ", ".join(missing)
            raise ModelLoadError(f"{path}: missing weight shards {shards} (named in {_INDEX_FILE})")
        if files:
            return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        others = [f for f in ("pytorch_model.bin", "model.pt") if os.path.isfile(os.path.join(path, f))]
        hint = f"; found {others[0]}, convert it to safetensors" if others else ""
        raise ModelLoadError(f"{path}: no *.safetensors weights{hint}")
    return files
