"""Quantization under tensor and pipeline parallelism: each rank ends with its shard's part of the
quantization, for the layers of its pipeline stage.

    int8-rtn, int4       a function of each weight alone: every rank quantizes its own shard
    gguf, checkpoint     the whole model's quantized weights come from a file: every rank reads
                         them and cuts out its part
    int8, gptq, awq      calibration runs the whole model: every rank builds the whole float model,
                         calibrates it (the same text, weights, ops and thread count: the same
                         result on every rank) and cuts out its part, so the shards are the very
                         weights one process would quantize (and int8's weights-cache entry is one)

Cutting follows `LlamaForCausalLM._rank_part` for float tensors (`tensor_parallel_splits`,
`packed_modules`): column-parallel layers (q/k/v, gate/up) keep their heads' or units' output rows,
row-parallel ones (o_proj, down_proj) their input columns, the lm_head its vocabulary block, padded
with zero rows as the float lm_head is; a mixture-of-experts layer's experts as its layout splits
them (`moe.rank_experts`: whole experts, or every expert's units). A column cut must fall on group
boundaries (or the weight must have one scale per row); every rank checks every rank's cuts, so
rank 0 reports a misaligned split of any rank in one line. A pipeline stage keeps the weights of
the modules it builds (its decoder layers; the lm_head on the last stage) and the float updates of
its own parameters.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.config.quantization import CHECKPOINT, PREQUANTIZED
from llmserve.distributed.shard import ShardLayout
from llmserve.quantization import moe
from llmserve.quantization.formats import (
    QuantizedWeight,
    column_groups,
    materialize,
    shard_columns,
    shard_rows,
)
from llmserve.quantization.methods import LM_HEAD, QuantizationResult, compute_quantization, quantize_model

PER_SHARD = ("int8-rtn", "int4")  # methods that are a function of each weight alone
CALIBRATED = ("int8", "gptq", "awq")  # methods that run the whole model on calibration text
# methods whose weights come from files, chosen by the model's structure alone (never its values)
FROM_FILES = ("gguf", CHECKPOINT, PREQUANTIZED)


def quantize_shard(
    model: nn.Module,
    config: ModelConfig,
    tokenizer,
    whole_model: Callable[[], nn.Module],
    planned: QuantizationResult | None = None,
) -> QuantizationResult:
    """Quantize this rank's `model` in place as `config.quantization` says (all of it with one rank).
    `whole_model()` builds one process's float model, which calibrated methods need under tensor or
    pipeline parallelism (the caller builds it: `models/` imports this package); `tokenizer` None:
    loaded where calibration needs one. `planned`: what `plan_shard` computed on the model's
    structure, applied as it is. Each weight leaves the result as its layer is built (the formats
    are freed as the packed copies are made); the result returned holds the rest."""
    compute = _shard_method(model, config, whole_model) if planned is None else (lambda *_: planned)
    return quantize_model(model, config, tokenizer, compute=compute, release=True)


def plan_shard(
    model: nn.Module, config: ModelConfig, tokenizer, whole_model: Callable[[], nn.Module]
) -> QuantizationResult:
    """What `quantize_shard` would apply to `model`, computed without changing it. For the methods
    of `FROM_FILES` the model's structure is enough: `model` may be on the meta device."""
    return _shard_method(model, config, whole_model)(model, config, tokenizer)


def float_weights_replaced(model: nn.Module, result: QuantizationResult) -> frozenset[str]:
    """The checkpoint tensors (HF names) whose float values applying `result` to `model` never reads:
    the weights of the linear layers it replaces, and the stacked expert tensors of the experts
    modules it replaces (`moe.apply_experts` reads their shapes only). Not a tied head's (the
    embedding, which gives its rows up only where the head's kernel reproduces them), nor any
    parameter it updates."""
    tied = model.arch.tie_word_embeddings
    names = set()
    for key in result.weights:
        expert = moe.parse_expert_key(key)
        if expert is not None:
            names.add(f"{expert[0]}.{expert[1]}")  # model.layers.N.mlp.experts.gate_up_proj
        elif not (key == LM_HEAD and tied):
            names.update(model.checkpoint_names(f"{key}.weight"))
    return frozenset(names - result.float_updates.keys())


def _shard_method(model: nn.Module, config: ModelConfig, whole_model: Callable[[], nn.Module]):
    """The QuantizeMethod that gives this rank's part of the quantization."""
    if model.tp.world_size == 1 and model.stage.num_stages == 1:
        return compute_quantization
    if config.quantization.method in PER_SHARD:
        return _per_shard

    def compute(shard: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
        whole = on_this_stage(_whole_model_result(shard, config, tokenizer, whole_model), shard)
        whole.weights = {name: materialize(weight) for name, weight in whole.weights.items()}  # to cut them
        for rank in range(shard.tp.world_size):  # every rank's cuts, so that rank 0 names any bad one
            _check_columns(whole.weights, shard, ShardLayout.of(shard.arch, shard.tp.world_size, rank))
        moe.check_expert_cuts(_expert_weights(whole.weights), shard)
        return shard_result(whole, shard)

    return compute


def _per_shard(shard: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    return on_this_stage(compute_quantization(shard, config, tokenizer), shard)


def on_this_stage(result: QuantizationResult, model: nn.Module) -> QuantizationResult:
    """The part of `result` for the modules and parameters `model` (one pipeline stage) builds."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    weights = {name: weight for name, weight in result.weights.items() if moe.owner(name) in modules}
    updates = {name: value for name, value in result.float_updates.items() if name in params}
    return dataclasses.replace(result, weights=weights, float_updates=updates)


def _whole_model_result(
    shard: nn.Module, config: ModelConfig, tokenizer, whole_model: Callable[[], nn.Module]
) -> QuantizationResult:
    if config.quantization.method not in CALIBRATED:  # read from files, by module name
        return compute_quantization(shard, config, tokenizer)
    if tokenizer is None:  # a worker: rank 0 has the engine's
        from llmserve.model_loader import load_tokenizer

        tokenizer = load_tokenizer(
            config.path, None if os.path.isdir(config.path) else config.arch.eos_token_ids
        )
    return compute_quantization(whole_model(), config, tokenizer)


def shard_result(whole: QuantizationResult, model: nn.Module) -> QuantizationResult:
    """The part of the whole model's quantization that `model` (one rank's shard) holds."""
    experts = _expert_weights(whole.weights)
    weights = {
        name: _rank_weight(name, weight, model)
        for name, weight in whole.weights.items()
        if name not in experts
    }
    weights.update(moe.rank_experts(experts, model))
    params = dict(model.named_parameters())
    for name, value in whole.float_updates.items():
        if params[name].shape != value.shape:
            raise ValueError(
                f"{name} is split under tensor parallelism; a quantization may change replicated "
                "float parameters (norms) only"
            )
    return dataclasses.replace(whole, weights=weights, float_updates=dict(whole.float_updates))


def _expert_weights(weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    return {name: weight for name, weight in weights.items() if moe.parse_expert_key(name)}


def _rank_weight(name: str, weight: QuantizedWeight, model: nn.Module) -> QuantizedWeight:
    split = _split(model, model.shard, name)
    if split is None:
        return weight
    dim, ranges = split
    if dim == 1:
        return _columns(name, weight, ranges[0], model.shard)
    index = torch.cat([torch.arange(part.start, part.stop) for part in ranges])
    module = model.get_submodule(name)  # a linear layer, or the embedding (its vocabulary block's rows)
    return shard_rows(weight, index, getattr(module, "out_features", None) or module.num_embeddings)


def _check_columns(weights: dict[str, QuantizedWeight], model: nn.Module, layout: ShardLayout) -> None:
    for name, weight in weights.items():
        split = _split(model, layout, name)
        if split is not None and split[0] == 1:
            _columns(name, weight, split[1][0], layout, column_groups)


def _columns(
    name: str, weight: QuantizedWeight, part: range, layout: ShardLayout, cut: Callable = shard_columns
):
    """`cut(weight, start, stop)` of the rank's input columns, its error naming the layer and split."""
    try:
        return cut(weight, part.start, part.stop)
    except ValueError as error:
        raise ValueError(
            f"quantized layer {name} cannot be split over tensor_parallel_size {layout.world_size}: "
            f"rank {layout.rank}'s {error}"
        ) from None


def _split(model: nn.Module, layout: ShardLayout, name: str) -> tuple[int, list[range]] | None:
    """(the dimension a whole-model weight of module `name` splits along, the ranges of it that
    `layout`'s rank holds, in the order its fused parameter stacks them); None: replicated."""
    arch = model.arch
    whole = ShardLayout.of(arch)
    child = name.rpartition(".")[2]
    dims, ranges, offset = set(), [], 0
    for part in model.packed_modules.get(child, (child,)):
        split = model.tensor_parallel_splits.get(part)
        if split is None:
            return None
        dim, field, unit = split
        scale = arch.head_dim if unit == "head" else 1
        mine = getattr(layout, field)
        ranges.append(range(offset + mine.start * scale, offset + mine.stop * scale))
        offset += len(getattr(whole, field)) * scale
        dims.add(dim)
    (dim,) = dims  # the parts of a fused layer split alike
    return dim, ranges
