"""Calibration for AWQ and GPTQ: real text, and the model run one decoder layer at a time.

The text is the benchmark corpus (the Python language reference and stdlib docstrings shipped with
the interpreter, `llmserve.corpus.corpus_text`), cut into fixed windows; `llmserve eval ppl`
scores a different text (the interpreter's LICENSE), so calibration never sees the evaluation text.

Calibration runs outside the engine: each layer's attention is temporarily swapped for plain causal
attention over one sequence, so no KV pool, scheduler or forward context is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

CALIBRATION_CHARS = 120_000  # of the corpus's start: tokenizing all of it would take seconds


@dataclass(frozen=True)
class CalibrationSpec:
    num_sequences: int = 8
    sequence_len: int = 512


def calibration_batches(tokenizer, spec: CalibrationSpec, device: torch.device) -> list[torch.Tensor]:
    """`num_sequences` windows of `sequence_len` token ids, spread evenly over the corpus's start."""
    from llmserve.corpus import corpus_text

    ids = tokenizer.encode(corpus_text()[:CALIBRATION_CHARS])
    needed = spec.num_sequences * spec.sequence_len
    if len(ids) < needed:
        raise ValueError(f"calibration needs {needed} tokens, the corpus gives {len(ids)}")
    stride = (len(ids) - spec.sequence_len) // max(spec.num_sequences - 1, 1)
    starts = [index * stride for index in range(spec.num_sequences)]
    return [torch.tensor(ids[s : s + spec.sequence_len], device=device) for s in starts]


class CausalSelfAttention(nn.Module):
    """Stand-in for the engine's paged `Attention` during calibration: one sequence, causal."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        tokens = query.shape[0]
        q = query.view(tokens, self.num_heads, self.head_dim).transpose(0, 1)
        k = key.view(tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = value.view(tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).reshape(tokens, -1)


@contextmanager
def causal_attention(model: nn.Module) -> Iterator[None]:
    attentions = [layer.self_attn for layer in model.model.layers]
    originals = [attention.attn for attention in attentions]
    for attention, original in zip(attentions, originals, strict=True):
        attention.attn = CausalSelfAttention(original.num_heads, original.num_kv_heads, original.head_dim)
    try:
        yield
    finally:
        for attention, original in zip(attentions, originals, strict=True):
            attention.attn = original


LayerVisitor = Callable[[int, nn.Module, list[torch.Tensor], list[torch.Tensor]], None]


@torch.inference_mode()
def run_layerwise(model: nn.Module, batches: list[torch.Tensor], visit: LayerVisitor) -> None:
    """Call `visit(index, layer, hiddens, positions)` before each decoder layer runs on the batches;
    the visitor may change the layer's weights, and the next layer sees the changed layer's output."""
    positions = [torch.arange(len(ids), device=ids.device) for ids in batches]
    with causal_attention(model):
        hiddens = [model.model.embed_tokens(ids) for ids in batches]
        for index, layer in enumerate(model.model.layers):
            visit(index, layer, hiddens, positions)
            hiddens = [layer(pos, hidden) for pos, hidden in zip(positions, hiddens, strict=True)]


@contextmanager
def capture_inputs(
    modules: dict[str, nn.Module], sink: Callable[[str, torch.Tensor], None]
) -> Iterator[None]:
    """Pass every input a module sees to `sink(name, x [tokens, in])` while the context is open."""
    handles = [
        module.register_forward_pre_hook(
            lambda _m, args, name=name: sink(name, args[0].reshape(-1, args[0].shape[-1]))
        )
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def one_thread() -> Iterator[None]:
    """Run calibration and GPTQ on one intra-op thread. Their ops are small (GPTQ's column loop is
    thousands of ops on vectors of `out` floats; layer forwards over 512-token windows of a small
    model), so extra threads mostly add synchronization, which is ruinous when another process holds
    a core: with the other core busy, two threads made GPTQ several times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def layer_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The decoder layer's linear modules under their names relative to the layer."""
    return {name: module for name, module in layer.named_modules() if isinstance(module, nn.Linear)}
