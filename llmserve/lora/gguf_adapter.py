"""A LoRA adapter from a GGUF file, as llama.cpp's convert_lora_to_gguf.py writes it.

The file says `general.type = adapter` and `adapter.type = lora`; each targeted weight has two
tensors, `blk.N.attn_q.weight.lora_a` ([rank, in]) and `.lora_b` ([out, rank]), and the scale is
`adapter.lora.alpha / rank` (llama.cpp's: 1 where no alpha is given). For the "llama" architecture
the converter permuted q and k's output rows for llama.cpp's rope; the rows of lora_b are put back
in HF's order here, as the base model's loader does for its weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmserve.config import ModelArchConfig
from llmserve.lora.adapter import TARGET_MODULES, LoRAAdapter
from llmserve.model_loader.gguf_loader import hf_name, open_gguf, unpermute_rope_rows

_ROPE_PERMUTED = {"llama": {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}}


def load_gguf_adapter(
    name: str, path: str, max_rank: int, dtype: torch.dtype, arch: ModelArchConfig
) -> LoRAAdapter:
    """The adapter in GGUF file `path` over a base model of `arch`, its weights in `dtype`."""
    reader = open_gguf(path)
    if _field(reader, "general.type") != "adapter" or _field(reader, "adapter.type") != "lora":
        raise ValueError(f"{path} is not a GGUF LoRA adapter (general.type adapter, adapter.type lora)")
    if _field(reader, "adapter.alora.invocation_tokens") is not None:
        raise ValueError("activated LoRA adapters (adapter.alora.invocation_tokens) are not supported")
    architecture = _field(reader, "general.architecture")
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        base, _, half = tensor.name.rpartition(".")
        target = hf_name(base, architecture) if half in ("lora_a", "lora_b") else None
        module = None if target is None else target.split(".")[-2]
        if module not in TARGET_MODULES:
            raise ValueError(
                f"GGUF adapter tensor {tensor.name!r} is not a LoRA weight of a supported module"
            )
        halves.setdefault((int(target.split(".")[2]), module), {})[half] = _dequantize(tensor)
    weights = {key: _pair(key, pair, architecture, arch, dtype) for key, pair in halves.items()}
    ranks = {a.shape[0] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"GGUF adapter {name!r} has several ranks {sorted(ranks)}; one is supported")
    rank = ranks.pop()
    if rank > max_rank:
        raise ValueError(f"adapter rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = float(_field(reader, "adapter.lora.alpha") or 0.0)
    return LoRAAdapter(name, path, rank, alpha / rank if alpha else 1.0, weights)


def _pair(key, pair: dict[str, np.ndarray], architecture: str, arch: ModelArchConfig, dtype: torch.dtype):
    """(A, B) of one module, B's rows in HF's order."""
    if set(pair) != {"lora_a", "lora_b"}:
        raise ValueError(f"GGUF adapter lacks lora_a or lora_b of layer {key[0]}'s {key[1]}")
    a, b = pair["lora_a"], pair["lora_b"]
    heads = _ROPE_PERMUTED.get(architecture, {}).get(key[1])
    if heads is not None:
        b = unpermute_rope_rows(b, getattr(arch, heads))
    return torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)  # copies: the file is mapped read-only


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _dequantize(tensor) -> np.ndarray:
    """float32 in numpy's order (GGUF lists dimensions fastest first)."""
    from gguf.quants import dequantize

    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)
