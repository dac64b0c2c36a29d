"""Random PEFT LoRA adapters over the tiny test Llama (tests/helpers.py), saved by PEFT itself."""

from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
import peft
import torch
import transformers
from safetensors.torch import load_file

from tests.helpers import make_tiny_llama_dir

# name -> LoraConfig arguments: different ranks and targets, one with rsLoRA
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp": dict(
        r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "down_proj"], layers_to_transform=[1]
    ),
}


def load_base(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_adapter(base_dir: str, out_dir: str, seed: int, **lora_args) -> None:
    """A random PEFT adapter (B non-zero) scaled up so it changes the greedy tokens, saved by PEFT."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0, **lora_args)
    model = peft.get_peft_model(load_base(base_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(out_dir)


def make_model_dirs(root) -> dict[str, str]:
    """The tiny base model's directory and one PEFT directory per adapter of ADAPTERS, by name."""
    dirs = {"base": make_tiny_llama_dir(str(root / "base"))}
    for seed, (name, args) in enumerate(ADAPTERS.items()):
        dirs[name] = str(root / name)
        make_adapter(dirs["base"], dirs[name], seed + 1, **args)
    return dirs


_GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def llama_cpp_rope_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's two halves interleaved pairwise."""
    split = rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


def write_gguf_lora(adapter_dir: str, path: str, num_heads: int, num_kv_heads: int) -> str:
    """A PEFT Llama adapter as llama.cpp's convert_lora_to_gguf.py writes it: general.type adapter,
    adapter.lora.alpha, `blk.N.<tensor>.weight.lora_a/lora_b`, q and k's lora_b rows permuted."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as file:
        config = json.load(file)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
    for key, tensor in load_file(os.path.join(adapter_dir, "adapter_model.safetensors")).items():
        layer, module, half = re.search(r"layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight", key).groups()
        rows = tensor.float().numpy()
        if half == "B" and module in heads:
            rows = llama_cpp_rope_permute(rows, heads[module])
        name = f"blk.{layer}.{_GGUF_NAMES[module]}.weight.lora_{half.lower()}"
        writer.add_tensor(name, np.ascontiguousarray(rows))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
