"""Batch invariance (`--deterministic`): every reduction a row takes part in sums in an order that does
not depend on the other rows of its step, how many there are, the chunk its token came in or whether
its prefix came from the cache, so a request's greedy tokens and logprobs are bitwise the same alone,
in any batch, chunked, prefix-cached, preempted and resumed, or verified as speculative drafts.

Where the CPU path's reductions stand (tests/kernels/test_batch_invariance.py checks each):
- RMSNorm (with the residual add), rotary, SiLU-and-mul (elementwise.cpp): one row at a time, invariant.
- Linear layers: each compiled kernel (float32: linear_f32.cpp; bf16: linear.cpp) is one FMA chain per
  output over the inputs in order, whatever the rows; but by default a layer switches kernels with the
  row count (float32: the kernel up to 8 rows, oneDNN's GEMM above on CPUs with AVX-512; bf16: AMX above
  8 rows where the CPU has it; the kernel at every row count elsewhere), and two kernels round differently.
  Invariant: each layer keeps its dtype's kernel at every row count.
- Attention: `paged_attention.cpp` gives each query row of a span what a decode of it gives, but spans
  longer than 16 queries (prompt chunks) went to the prefill kernel, which sums in tiles with an online
  softmax. Invariant: every span goes to the paged kernel, in pieces of 16 queries
  (attention/backends/cpu_paged.py). Not with a sliding window: the kernel places a span's scores by
  where its window starts, which moves with the span's length.
- The output projection is a linear layer (above); the sampler's argmax (greedy.cpp) and torch's
  softmax and log-softmax reduce each row alone (checked at both instruction-set levels).
- LoRA deltas on the CPU: one compiled call, each row alone (lora/weights.py).
What stays outside: quantized layers whose kernel does not declare `batch_invariant`, LoRA deltas off
the CPU and mixture-of-experts matmuls (torch's GEMMs, blocked by row count), the reference attention
backend, and collectives between ranks; `reasons` names each, for /server_info.

Unset, the flag is on where it changes attention alone (`on_by_default`): a bf16 model whose linear
layers' kernels take every row count already, over a bf16 cache, on one rank, without speculation. There
its cost is the prompt spans' pieces in the paged kernel (docs/reliability.md: within the noise all at
once, decodes unchanged); where it would move linear layers off AMX or oneDNN, or float32 prompt spans
off the prefill kernel, it stays off unless asked for.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from llmserve.attention.backends.cpu_paged import CPUPagedBackend
from llmserve.config import EngineConfig
from llmserve.config.kv_cache_dtype import is_low_bit
from llmserve.kernels.small_batch_linear import LogitsLinear, PackedLinear, SmallBatchLinear
from llmserve.models.layers.moe import MoEExperts
from llmserve.quantization.embedding import lookup_blocks
from llmserve.quantization.kernels import QuantizedLinear


def make_batch_invariant(model: nn.Module, attention_backend) -> None:
    """Every linear layer on its dtype's compiled kernel at every row count (no AMX, no oneDNN), every
    attention span in the paged kernel. Before the fused decode stack is built: it takes the layers'
    choices as it finds them."""
    for module in model.modules():
        if type(module) is PackedLinear and module.small_batch_weight is not None:
            module.every_row_count = True
            module.packed_weight = None  # never read now: its memory back
        elif type(module) is SmallBatchLinear:
            module.amx, module.kernel_max_rows = False, sys.maxsize
        elif type(module) is LogitsLinear:
            module.amx = False
    if isinstance(attention_backend, CPUPagedBackend):
        attention_backend.serve_every_span()


def on_by_default(config: EngineConfig, model: nn.Module, attention_backend, lora=None) -> bool:
    """Whether an unset --deterministic is on: where the flag would make the configuration batch
    invariant by changing attention alone, in bf16 (module docstring). Before make_batch_invariant."""
    if config.model.dtype != torch.bfloat16 or config.cache.kv_cache_dtype != "auto":
        return False
    return not reasons(config, model, attention_backend, lora, deterministic=True)


def reasons(
    config: EngineConfig, model: nn.Module, attention_backend, lora=None, deterministic: bool | None = None
) -> tuple[str, ...]:
    """Why the running configuration is not batch invariant; () where it is. `lora`: the engine's
    LoRAManager, whose layers say whether the compiled delta adds every one of them. `deterministic`:
    whether the flag is on (by default config.model.deterministic, as the model runner resolved it)."""
    if deterministic is None:
        deterministic = config.model.deterministic
    if deterministic is None:
        raise ValueError("reasons() needs --deterministic resolved (ModelRunner decides an unset flag)")
    found = [] if deterministic else ["--deterministic is off"]
    found += _attention_reasons(config, attention_backend, deterministic)
    lookups_only = lookup_blocks(model)  # an untied embedding's blocks: rows rebuilt alone, whatever the step
    modules = [module for module in model.modules() if id(module) not in lookups_only]
    found += sorted({reason for module in modules if (reason := _module_reason(module))})
    if config.lora is not None and (lora is None or not lora.rows_computed_alone()):
        found.append("LoRA adapters: some deltas are torch matmuls, blocked by the step's row count")
    if config.parallel.world_size > 1:
        found.append("tensor or pipeline parallelism: the ranks' collectives are not checked for it")
    if config.speculative is not None:
        found.append(
            "speculative decoding: a seeded sampled request's random draws follow how many drafts it "
            "verified, which depends on the batch (greedy requests keep their tokens)"
        )
    return tuple(found)


def _attention_reasons(config: EngineConfig, backend, deterministic: bool) -> list[str]:
    if not isinstance(backend, CPUPagedBackend):
        return [f"the {backend.name} attention backend: prefills and decodes take different kernels"]
    found = []
    if is_low_bit(config.cache.kv_cache_dtype):
        found.append(
            f"an {config.cache.kv_cache_dtype} KV cache: prompt spans take the prefill kernel over "
            "dequantized rows, decodes the low-bit decode kernel"
        )
    elif not deterministic:  # the flag cuts every span into the paged kernel's pieces (serve_every_span)
        found.append(
            "attention: prompt spans longer than 16 tokens take the prefill kernel (or SDPA), shorter "
            "ones and decodes the paged kernel, which sums in another order"
        )
    if config.cache.sliding_window or config.cache.kv_groups:
        found.append("a sliding window: the paged kernel places a span's scores by where its window starts")
    return found


def _module_reason(module: nn.Module) -> str | None:
    """What makes this module's rows depend on the rest of the step, if anything."""
    if type(module) is PackedLinear:
        if module.small_batch_weight is None:
            return "float32 linear layers on oneDNN's GEMM alone (no compiled kernel in this build)"
        if module.packed_weight is not None and not module.every_row_count:
            return "float32 linear layers: the compiled kernel up to 8 rows, oneDNN's GEMM above"
    elif type(module) in (SmallBatchLinear, LogitsLinear):
        if module.amx:
            return "bf16 linear layers: the small-batch kernel up to 8 rows, AMX tiles above"
        if type(module) is SmallBatchLinear and not module.kernel_takes_every_row_count:
            rows = module.kernel_max_rows
            return f"bf16 linear layers: the small-batch kernel up to {rows} rows, oneDNN above"
    elif isinstance(module, QuantizedLinear):
        if not getattr(module.kernel, "batch_invariant", False):
            return (
                f"quantized linear layers ({type(module.kernel).__name__}): the kernel changes with the rows"
            )
    elif isinstance(module, nn.Linear):  # F.linear: torch's GEMM, blocked by the row count
        return f"linear layers on torch's GEMM ({type(module).__name__}, {module.weight.dtype})"
    elif isinstance(module, MoEExperts):
        return "mixture-of-experts layers: each expert's grouped matmul over the tokens routed to it"
    return None
