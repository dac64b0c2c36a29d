"""Model classes by architecture name, and building one with its weights loaded."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.distributed.group import TensorParallelGroup
from llmserve.distributed.pipeline import PipelineStage
from llmserve.models.gemma import GemmaForCausalLM
from llmserve.models.layers.custom_op import bind_kernels
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.mixtral import MixtralForCausalLM
from llmserve.models.phi3 import Phi3ForCausalLM
from llmserve.models.qwen3 import Qwen3ForCausalLM
from llmserve.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tp: TensorParallelGroup | None = None,
    stage: PipelineStage | None = None,
    left_out: frozenset[str] = frozenset(),
) -> nn.Module:
    """Construct on the meta device (no wasted init), materialize, then copy the weights in; with a
    tensor-parallel group, this rank's shard of the model and of the weights, and with a pipeline
    stage only that stage's part. `left_out`: checkpoint tensors not in `weights` because a
    quantization replaces their modules; their parameters stay on the meta device (never allocated)
    until it does (`check_materialized`)."""
    model = meta_model(config, tp, stage).to(config.dtype)
    unallocated = model.parameters_left_out(left_out)
    model = _materialize(model, config.device, unallocated)  # allocated once, in the serving dtype
    model.load_weights(weights, left_out)
    bind_kernels(model, config.device)
    return model.eval().requires_grad_(False)


def meta_model(
    config: ModelConfig, tp: TensorParallelGroup | None = None, stage: PipelineStage | None = None
) -> nn.Module:
    """The model's modules with every parameter on the meta device: its structure, no memory."""
    model_cls = _MODELS.get(config.arch.architecture)
    if model_cls is None:
        raise ValueError(
            f"unsupported architecture {config.arch.architecture!r}; supported: {supported_architectures()}"
        )
    with torch.device("meta"):
        return model_cls(config.arch, config.max_model_len, config.device, tp, stage)


def check_materialized(model: nn.Module) -> None:
    """Raise if a parameter left out of the loading was not replaced (a quantization that did not
    cover what it promised)."""
    left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} parameters were never loaded, e.g. {left[:3]}")


def _materialize(model: nn.Module, device: torch.device, unallocated: set[str]) -> nn.Module:
    """`model.to_empty(device)` without its cost (`empty_like` of a meta tensor runs a Python
    reference implementation that imports sympy, on the start-up's critical path), leaving the
    parameters named in `unallocated` on the meta device."""
    keep = {id(param) for name, param in model.named_parameters() if name in unallocated}
    return model._apply(lambda t: t if id(t) in keep else torch.empty(t.shape, dtype=t.dtype, device=device))
