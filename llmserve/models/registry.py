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
) -> nn.Module:
    """Construct on the meta device (no wasted init), materialize, then copy the weights in; with a
    tensor-parallel group, this rank's shard of the model and of the weights, and with a pipeline
    stage only that stage's part."""
    model_cls = _MODELS.get(config.arch.architecture)
    if model_cls is None:
        raise ValueError(
            f"unsupported architecture {config.arch.architecture!r}; supported: {supported_architectures()}"
        )
    with torch.device("meta"):
        model = model_cls(config.arch, config.max_model_len, config.device, tp, stage)
    model = _materialize(model.to(config.dtype), config.device)  # allocated once, in the serving dtype
    model.load_weights(weights)
    bind_kernels(model, config.device)
    return model.eval().requires_grad_(False)


def _materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device)` without its cost: `empty_like` of a meta tensor runs a Python
    reference implementation that imports sympy, on the start-up's critical path."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
