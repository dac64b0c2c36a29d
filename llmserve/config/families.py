"""Which engine features each model family can use: a one-line error where one cannot.

Families whose layers are Llama's (linear layers of the same names, norms feeding the same
projections) take every feature. Gemma's extra norms and scaled embeddings are outside what
quantization's calibration and folding, the early-exit and draft-head proposers (which run the
target's embedding and layers themselves) and tensor parallelism were built and tested for. The
mixture-of-experts families split over tensor-parallel ranks (by expert units, or by experts with
--enable-expert-parallel); on one rank their experts are quantized by the methods that quantize each
weight alone (int8-rtn, int4, a GGUF's blocks, checkpoints of those: quantization/moe.py), not by
the calibrated ones, which run no expert layer yet. Over several ranks int8-rtn and int4 quantize
each rank's own experts or units, and a file's quantized experts (a GGUF's blocks, a checkpoint's
codes) are cut per rank (quantization/sharding.py): whole experts, or every expert's units, whose
down_proj columns must hold whole groups (checked here for a GGUF's blocks, at load for checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.config.parallel import expert_unit_range
from llmserve.config.quantization import GGUF_BLOCK_COLUMNS

if TYPE_CHECKING:
    from llmserve.config import ModelArchConfig

ROPE_SCALING_TYPES = ("default", "linear", "llama3", "longrope")  # models/layers/rotary.py computes these
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# every block type --quantization gguf reads has groups dividing 32 (Q6_K's 16): a unit cut on a
# multiple of it keeps down_proj's groups whole, whatever types the file mixes
GGUF_EXPERT_CUT = GGUF_BLOCK_COLUMNS
MOE_QUANTIZATION = ("int8-rtn", "int4", "gguf")  # methods that quantize expert layers (besides checkpoints)
# feature -> the families that have it (the others get the error)
_FEATURES = {
    "quantization": (*LLAMA_LIKE, "mixtral", "qwen3_moe"),
    "tensor parallelism": (*LLAMA_LIKE, "mixtral", "qwen3_moe"),
    "speculative method early_exit": (*LLAMA_LIKE, "mixtral", "qwen3_moe"),
    "speculative method draft_head": (*LLAMA_LIKE, "mixtral", "qwen3_moe"),
}


def check_family_features(
    arch: ModelArchConfig,
    quantization: str | None,
    tensor_parallel_size: int,
    speculative_method: str | None,
    expert_parallel: bool = False,
) -> None:
    """Raise ValueError naming the feature, the family and the families that have it."""
    wanted = []
    if quantization not in (None, "", "none"):
        wanted.append("quantization")
    if tensor_parallel_size > 1:
        wanted.append("tensor parallelism")
    if speculative_method in ("early_exit", "draft_head", "eagle"):  # eagle runs the draft head
        wanted.append(
            f"speculative method {'draft_head' if speculative_method == 'eagle' else speculative_method}"
        )
    if quantization == "gguf" and arch.num_experts and tensor_parallel_size > 1 and not expert_parallel:
        _check_gguf_expert_units(arch, tensor_parallel_size)
    if quantization in ("int8", "gptq", "awq") and arch.num_experts:  # calibration runs no expert layer
        raise ValueError(
            f"quantization {quantization} does not apply to mixture-of-experts models yet "
            f"(these do: {', '.join(MOE_QUANTIZATION)})"
        )
    if quantization == "gguf" and arch.architecture == "phi3":  # its fused GGUF blocks are not cut per part
        raise ValueError("quantization gguf does not apply to phi3 models yet (the other methods do)")
    for feature in wanted:
        families = _FEATURES[feature]
        if arch.architecture not in families:
            supported = ", ".join(families)
            raise ValueError(
                f"{feature} does not apply to {arch.architecture} models yet (it does to: {supported})"
            )


def _check_gguf_expert_units(arch: ModelArchConfig, tensor_parallel_size: int) -> None:
    """Each rank's units of every expert must start on a whole GGUF block of down_proj's input."""
    units = arch.moe_intermediate_size or arch.intermediate_size
    shares = [expert_unit_range(units, tensor_parallel_size, rank) for rank in range(tensor_parallel_size)]
    if any(share.start % GGUF_EXPERT_CUT for share in shares):
        raise ValueError(
            f"quantization gguf cannot split the experts' {units} units over {tensor_parallel_size} "
            f"tensor-parallel ranks ({' + '.join(str(len(share)) for share in shares)}) in whole blocks of "
            f"{GGUF_EXPERT_CUT} (--enable-expert-parallel keeps each expert whole; --quantization none "
            "serves them in float)"
        )


def rope_scaling_type(scaling: dict | None) -> str:
    """The rope_scaling dict's type ("su" is LongRoPE's old name); a one-line error if not implemented."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_SCALING_TYPES)})"
        )
    return kind
