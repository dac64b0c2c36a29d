"""Test fixtures shared across test folders: a tiny random Llama with the real tokenizer, and a
deadline poll for tests that wait on something (they never wait with a fixed sleep)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import transformers

from llmserve.model_loader import default_model_path, load_tokenizer

__all__ = [
    "TINY_LLAMA_CONFIG",
    "default_model_path",
    "is_alive",
    "make_tiny_llama_dir",
    "round_inputs_as_the_small_batch_kernels",
    "wait_until",
]

T = TypeVar("T")

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


def wait_until(
    condition: Callable[[], T],
    timeout: float = 60.0,
    what: str | Callable[[], str] = "the condition",
    interval: float = 0.05,
) -> T:
    """Call `condition` every `interval` seconds until it returns something truthy, and return that;
    past `timeout` seconds fail naming `what` (a function: called then, to say what was seen)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            waited_for = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g} s waiting for {waited_for}")
        time.sleep(interval)
    return value


def round_inputs_as_the_small_batch_kernels(reference: torch.nn.Module, quantized: torch.nn.Module) -> int:
    """Make a float model of a quantized model's weights round its linear layers' inputs where the
    quantized layers' compiled kernels round theirs (quantization/kernels.py: RoundedInputKernel, at
    every row count): to 8 bits per 32 columns, a step of max|x| / 127 per block. The reference must
    run its modules (no fused decode stack, which calls no hooks). Returns how many layers round;
    none where the quantized layers dequantize instead."""
    from llmserve.quantization.embedding import lookup_blocks
    from llmserve.quantization.kernels import RoundedInputKernel

    hooked = 0
    lookups = lookup_blocks(quantized)  # an untied embedding's blocks: looked up, never multiplied
    for name, module in quantized.named_modules():
        kernel = getattr(module, "kernel", None)
        if not isinstance(kernel, RoundedInputKernel) or id(module) in lookups:
            continue
        float_layer = reference.get_submodule(name)
        if kernel.takes(float_layer.weight.dtype):
            float_layer.register_forward_pre_hook(rounding_hook())
            hooked += 1
    return hooked


def rounding_hook():
    """A forward pre-hook rounding a layer's input as the compiled int8/int4 kernels round it."""

    def hook(_module, args):
        (x,) = args
        blocks = x.reshape(-1, x.shape[-1] // 32, 32)
        largest = blocks.abs().amax(dim=-1, keepdim=True)
        scale = largest / 127
        inverse = torch.where(largest >= 1e-30, 1 / scale, torch.zeros_like(scale))
        return (torch.round(blocks * inverse) * scale).view_as(x)

    return hook


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps): "hg" where it is advised
    into huge pages."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
