"""Random PEFT LoRA adapters over the tiny test Llama (tests/helpers.py), saved by PEFT itself."""

from __future__ import annotations

import peft
import torch
import transformers

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
