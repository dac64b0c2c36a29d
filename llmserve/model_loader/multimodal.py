"""Image-and-text checkpoints served for text: their language model's config and weights only.

`Gemma3ForConditionalGeneration` (Gemma 3 from 4B up) nests its language model's config under
`text_config`, which transformers saves as a diff from Gemma3TextConfig's defaults (the 4B's lacks the
head counts and the vocabulary size), and stores the language model's weights under
`language_model.model.*` (`model.language_model.*` from some transformers versions on) beside the
SigLIP `vision_tower` and the `multi_modal_projector`, which are never read.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

CONDITIONAL_GENERATION = frozenset({"Gemma3ForConditionalGeneration"})
# transformers' Gemma3TextConfig defaults, in config.json's older spelling (the current one's
# rope_parameters, where present, wins over rope_theta and rope_local_base_freq)
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "attention_bias": False,
    "tie_word_embeddings": True,
}
# the outer config's, where the inner one does not set them
_TOP_LEVEL = ("bos_token_id", "eos_token_id", "tie_word_embeddings", "quantization_config")
_LANGUAGE_MODEL = re.compile(r"(?:language_model\.model\.|model\.language_model\.)(.+)")
_LANGUAGE_MODEL_HEAD = "language_model.lm_head."
_VISION = re.compile(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\.")
_PROCESSOR_CHAT_TEMPLATE = "chat_template.json"


def is_conditional_generation(config: dict[str, Any]) -> bool:
    return any(name in CONDITIONAL_GENERATION for name in config.get("architectures") or ())


def language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as the text-only model's: `text_config` over the family's defaults, keeping the
    outer `architectures` and what only the outer config sets (token ids, tying, quantization)."""
    if not is_conditional_generation(config):
        return config
    text = config.get("text_config") or {}
    outer = {key: config[key] for key in _TOP_LEVEL if config.get(key) is not None and key not in text}
    return {**_GEMMA3_TEXT_DEFAULTS, **text, **outer, "architectures": config["architectures"]}


def language_model_weight_name(name: str) -> str | None:
    """The text model's name of a checkpoint tensor (`model.layers.0...`, `lm_head.weight`); None for
    the vision tower's and the projector's, which are skipped."""
    if _VISION.match(name):
        return None
    match = _LANGUAGE_MODEL.fullmatch(name)
    if match:
        return f"model.{match[1]}"
    if name.startswith(_LANGUAGE_MODEL_HEAD):
        return "lm_head." + name.removeprefix(_LANGUAGE_MODEL_HEAD)
    return name


def processor_chat_template(path: str) -> str | None:
    """The chat template a multimodal model keeps beside its processor (chat_template.json), if any."""
    file = os.path.join(path, _PROCESSOR_CHAT_TEMPLATE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as handle:
            template = json.load(handle).get("chat_template")
    except (OSError, ValueError, AttributeError):  # unreadable: the model is served without one
        return None
    return template if isinstance(template, str) else None
