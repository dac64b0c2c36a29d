"""Quantization methods by name, and applying one to a loaded model (a module swap).

A method maps the float model (and, for calibrated methods, a tokenizer) to the quantized weight of
each linear layer it covers, plus any float parameters it changed (AWQ's folded norm weights).
`apply_quantization` then replaces those `nn.Linear` modules by `QuantizedLinear`s; the model file
knows nothing of it. The lm_head (tied to the embedding in small models) is int8 per channel for
every int4 method: it is the largest single matmul, and 8 bits keep its error small.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from torch import nn

from llmserve.config import ModelConfig
from llmserve.config.quantization import CHECKPOINT, PREQUANTIZED
from llmserve.quantization import awq, calibration, checkpoint, gguf_native, moe, prequantized
from llmserve.quantization.embedding import embed_from_blocks, embed_from_head
from llmserve.quantization.formats import (
    DeferredWeight,
    Int4Weight,
    QuantizedWeight,
    StackedRows,
    materialize,
    quantize_int4,
    quantize_int8,
    stack_rows,
)
from llmserve.quantization.gptq import HessianAccumulator, gptq_quantize
from llmserve.quantization.kernels import LinearKernel, QuantizedLinear

logger = logging.getLogger("llmserve")

LM_HEAD = "lm_head"
EMBEDDING = "model.embed_tokens"  # an untied GGUF token_embd kept in its blocks (quantization/embedding.py)


@dataclass
class QuantizationResult:
    weights: dict[str, QuantizedWeight | StackedRows]  # module name (model.layers.0.mlp.down_proj) -> weight
    float_updates: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> new value
    # the lm_head's weight holds the tied embedding's own values (a GGUF's token_embd): the
    # embedding reads its rows from it and its float table is freed (quantization/embedding.py)
    embedding_in_head: bool = False


QuantizeMethod = Callable[[nn.Module, ModelConfig, object], QuantizationResult]
_METHODS: dict[str, QuantizeMethod] = {}


def register(name: str) -> Callable[[QuantizeMethod], QuantizeMethod]:
    def wrap(method: QuantizeMethod) -> QuantizeMethod:
        _METHODS[name] = method
        return method

    return wrap


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder layers' linears, less mixture-of-experts routers (kept in float)."""
    routers = moe.router_names(model)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("model.layers.") and name not in routers
    }


def compute_quantization(model: nn.Module, config: ModelConfig, tokenizer=None) -> QuantizationResult:
    """The quantized weights `config.quantization` asks for (the model is not changed, except by
    AWQ's scale folding, which leaves its float outputs the same)."""
    return _METHODS[config.quantization.method](model, config, tokenizer)


def apply_quantization(
    model: nn.Module, result: QuantizationResult, config: ModelConfig, release: bool = False
) -> None:
    """Swap `result`'s layers into `model`. `release`: take each weight out of `result` once its layer
    is built, so that a layer's format (int4 codes one a byte, float32 scales) is freed as its packed
    copy is made, not held beside every layer's until the end."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in result.float_updates.items():
            params[name].copy_(value)
    experts = {name: materialize(w) for name, w in result.weights.items() if moe.parse_expert_key(name)}
    moe.apply_experts(model, experts, config.dtype, config.device)
    for name in [name for name in result.weights if name not in experts]:
        weight = materialize(result.weights[name])
        if release:
            del result.weights[name]
        else:
            result.weights[name] = weight  # built, for the caller (`llmserve quantize` saves them)
        if name == EMBEDDING:
            embed_from_blocks(model, weight, config.dtype, config.device)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        head = name == LM_HEAD
        setattr(
            parent,
            child,
            QuantizedLinear(weight, linear.bias, config.dtype, config.device, float_logits=head),
        )


def quantize_model(
    model: nn.Module,
    config: ModelConfig,
    tokenizer=None,
    compute: QuantizeMethod = compute_quantization,
    release: bool = False,
) -> QuantizationResult:
    """Quantize `model` in place with what `compute` returns (by default, what `config.quantization`
    says for this model); returns that (`release`: without the weights it applied, as
    `apply_quantization` says)."""
    start = time.monotonic()
    result = compute(model, config, tokenizer)
    float_bytes = sum(_float_bytes(weight.shape, config.dtype) for weight in result.weights.values())
    names = list(dict.fromkeys(map(moe.owner, result.weights)))
    apply_quantization(model, result, config, release)
    if result.embedding_in_head:
        embed_from_head(model, config.dtype)
    layers = [model.get_submodule(name) for name in names]
    quant_bytes = sum(_buffer_bytes(layer) for layer in layers)
    kernels = {type(m).__name__ for layer in layers for m in layer.modules() if isinstance(m, LinearKernel)}
    logger.info(
        "quantization %s: %d layers, %.1f -> %.1f MiB (kernels %s) in %.1f s",
        config.quantization.method,
        len(layers),
        float_bytes / 2**20,
        quant_bytes / 2**20,
        ", ".join(sorted(kernels)),
        time.monotonic() - start,
    )
    return result


def _float_bytes(shape: tuple[int, int], dtype: torch.dtype) -> int:
    return shape[0] * shape[1] * torch.tensor([], dtype=dtype).element_size()


def _buffer_bytes(module: nn.Module) -> int:
    return sum(buffer.numel() * buffer.element_size() for buffer in module.buffers())


def _lm_head_int8(model: nn.Module) -> dict[str, QuantizedWeight]:
    if model.lm_head is None:  # a pipeline stage before the last
        return {}
    return {LM_HEAD: quantize_int8(model.lm_head.weight)}


# -- round to nearest ------------------------------------------------------------------------------


@register("int8-rtn")
def _int8_rtn(model: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    weights = {name: quantize_int8(linear.weight) for name, linear in decoder_linears(model).items()}
    experts = moe.quantize_experts(model, quantize_int8)
    return QuantizationResult({**weights, **experts, **_lm_head_int8(model)})


@register("int4")
def _int4(model: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    group = config.quantization.group_size
    weights = {name: quantize_int4(linear.weight, group) for name, linear in decoder_linears(model).items()}
    experts = moe.quantize_experts(model, lambda weight: quantize_int4(weight, group))
    return QuantizationResult({**weights, **experts, **_lm_head_int8(model)})


# -- calibrated ------------------------------------------------------------------------------------


def _calibration_batches(model: nn.Module, config: ModelConfig, tokenizer) -> list[torch.Tensor]:
    if tokenizer is None:
        raise ValueError(f"quantization {config.quantization.method} needs a tokenizer for calibration text")
    spec = calibration.CalibrationSpec()
    if config.max_model_len < spec.sequence_len:  # the rotary table holds max_model_len positions
        raise ValueError(
            f"quantization {config.quantization.method} calibrates on windows of {spec.sequence_len} "
            f"tokens: max_model_len must be >= {spec.sequence_len}, got {config.max_model_len}"
        )
    return calibration.calibration_batches(tokenizer, spec, config.device)


def _layer_inputs(layer: nn.Module, linears: dict[str, nn.Module], hiddens, positions, sink) -> None:
    with calibration.capture_inputs(linears, sink):
        for pos, hidden in zip(positions, hiddens, strict=True):
            layer(pos, hidden)


@register("gptq")
def _gptq(model: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    weights = _gptq_weights(model, config, tokenizer, "int4", config.quantization.group_size)
    return QuantizationResult({**weights, **_lm_head_int8(model)})


@register("int8")
def _int8(model: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    """GPTQ at 8 bits, one scale per output channel: the single packed int8 call per layer of RTN,
    at a fraction of its perplexity cost (docs/quantization.md)."""
    dtype = str(config.dtype).removeprefix("torch.")  # GPTQ starts from the weights in this dtype
    weights = _cached(
        config,
        f"{_INT8_GPTQ_CACHE_ENTRY}-{dtype}",
        lambda: _gptq_weights(model, config, tokenizer, "int8", None),
    )
    return QuantizationResult({**weights, **_lm_head_int8(model)})


_INT8_GPTQ_CACHE_ENTRY = "int8-gptq-v1"  # bump when the calibration or the algorithm changes


def _gptq_weights(
    model: nn.Module, config: ModelConfig, tokenizer, kind: str, group: int | None
) -> dict[str, QuantizedWeight]:
    """Every decoder linear by GPTQ, layer by layer (later layers see earlier layers' rounding)."""
    weights: dict[str, QuantizedWeight] = {}

    def visit(index: int, layer: nn.Module, hiddens, positions) -> None:
        linears = calibration.layer_linears(layer)
        hessians = {name: HessianAccumulator(m.in_features, m.weight.device) for name, m in linears.items()}
        _layer_inputs(layer, linears, hiddens, positions, lambda name, x: hessians[name].add(x))
        for name, linear in linears.items():
            weight = gptq_quantize(linear.weight, hessians[name].hessian(), group, kind=kind)
            weights[f"model.layers.{index}.{name}"] = weight
            linear.weight.copy_(weight.dequantize(linear.weight.dtype))  # later layers see this layer's error

    run = calibration.run_layerwise
    originals = {name: linear.weight.clone() for name, linear in decoder_linears(model).items()}
    try:
        with calibration.one_thread():
            run(model, _calibration_batches(model, config, tokenizer), visit)
    finally:
        with torch.no_grad():
            for name, linear in decoder_linears(model).items():
                linear.weight.copy_(originals[name])
    return weights


@register("awq")
def _awq(model: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    group = config.quantization.group_size
    intermediate = config.arch.intermediate_size

    def visit(index: int, layer: nn.Module, hiddens, positions) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        linears = {"qkv": attention.qkv_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        inputs: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
        _layer_inputs(layer, linears, hiddens, positions, lambda name, x: inputs[name].append(x))
        x = {name: torch.cat(chunks) for name, chunks in inputs.items()}
        folds = [
            ("qkv", layer.input_layernorm.weight),
            ("gate_up", layer.post_attention_layernorm.weight),
            ("down", mlp.gate_up_proj.weight[intermediate:]),  # up_proj's rows feed down_proj
        ]
        for name, previous in folds:
            scales = awq.search_scales(linears[name].weight, x[name], group)
            awq.apply_scales([linears[name].weight], previous, scales)

    run = calibration.run_layerwise
    run(model, _calibration_batches(model, config, tokenizer), visit)
    weights = {name: quantize_int4(linear.weight, group) for name, linear in decoder_linears(model).items()}
    norms = {
        name: param.detach().clone()
        for name, param in model.named_parameters()
        if name.endswith("layernorm.weight")
    }
    return QuantizationResult({**weights, **_lm_head_int8(model)}, norms)


# -- GGUF's own blocks, saved checkpoints ----------------------------------------------------------


@register("gguf")
def _gguf(model: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    from llmserve.model_loader.default_model import is_gguf

    if not is_gguf(config.path):
        raise ValueError(f"quantization gguf needs a GGUF model, not {config.path}")
    tensors = _gguf_tensors(config)
    weights: dict[str, QuantizedWeight] = {}
    for name in decoder_linears(model):
        parent, _, child = name.rpartition(".")
        keys = [f"{parent}.{shard}.weight" for shard in model.packed_modules.get(child, (child,))]
        if all(key in tensors for key in keys):  # shards whose formats do not join stay stacked
            # fused as the layer is built: one layer's fused copy at a time, not the model's
            parts = [tensors.pop(key) for key in keys]
            shape = (sum(part.shape[0] for part in parts), parts[0].shape[1])
            weights[name] = DeferredWeight(shape, functools.partial(stack_rows, parts))
    head = "model.embed_tokens.weight" if config.arch.tie_word_embeddings else "lm_head.weight"
    if head in tensors:  # 5-bit codes as the int8 codes they equal: int8 has a float32-logits kernel
        weights[LM_HEAD] = _as_int8_if_five_bit(tensors[head])
    kept = len(decoder_linears(model)) + 1 - len(weights)
    embedding = tensors.get("model.embed_tokens.weight")
    if not config.arch.tie_word_embeddings and embedding is not None and model.model.embed_tokens is not None:
        weights[EMBEDDING] = embedding  # looked up row by row from its blocks, never a float table
    experts = moe.gguf_expert_weights(model, tensors)
    weights.update(experts)
    kept += len(moe.experts_modules(model)) - len({moe.owner(name) for name in experts})
    if kept:
        types = "/".join(gguf_native.SUPPORTED_TYPES)
        logger.info("quantization gguf: %d layers have no %s tensor and stay in float", kept, types)
    tied = config.arch.tie_word_embeddings and LM_HEAD in weights  # the head is token_embd's blocks
    return QuantizationResult(weights, embedding_in_head=tied)


def _as_int8_if_five_bit(weight: QuantizedWeight) -> QuantizedWeight:
    five_bit = isinstance(weight, Int4Weight) and weight.bits == 5
    return (weight.as_int8() or weight) if five_bit else weight


def _gguf_tensors(config: ModelConfig) -> dict[str, QuantizedWeight]:
    """Read once (parsing a GGUF takes seconds), written to the weights cache in our own format as it
    is read, then mapped from there (its tensors read where touched: as each layer is packed)."""
    return _cached(
        config, _GGUF_CACHE_ENTRY, lambda: gguf_native.iter_quantized_tensors(config.path, config.arch)
    )


# v2: Q4_K, Q5_0; v3: Q5_0 as 5-bit codes; v4: Q5_K; v5: Q3_K; v6: written as read, in several files
_GGUF_CACHE_ENTRY = "gguf-native-v6"
_DAMAGED = (ValueError, OSError, KeyError, SafetensorError)  # what a damaged cache entry raises


def _cached(
    config: ModelConfig,
    entry: str,
    compute: Callable[[], dict[str, QuantizedWeight] | Iterable[tuple[str, QuantizedWeight]]],
) -> dict[str, QuantizedWeight]:
    """`compute()` (a dict, or (name, weight) pairs as they are made), kept in the weights cache of a
    GGUF source (keyed by its SHA-256) under `entry` and reloaded from there at the next start; an HF
    directory is computed every time. Pairs are written as they come and then read back from the
    entry, so that a model's weights are never all made in memory at once."""
    from llmserve.model_loader import weights_cache
    from llmserve.model_loader.default_model import is_gguf

    def made(values) -> dict[str, QuantizedWeight]:
        return values if isinstance(values, dict) else dict(values)

    if not is_gguf(config.path):
        return made(compute())
    cached = weights_cache.cached_dir(config.path, entry)
    if cached is not None:
        try:
            return checkpoint.load_quantized(str(cached))[0]
        except _DAMAGED as error:
            logger.warning("ignoring a damaged cache entry %s (%s)", cached, error)
            weights_cache.discard_dir(config.path, entry)
    info = {"method": entry, "source": config.path, "source_id": checkpoint.source_id(config.path)}
    values = compute()
    if isinstance(values, dict):
        weights_cache.save_dir(config.path, entry, lambda d: checkpoint.save_quantized(d, values, info))
        return values
    failed: list[Exception] = []

    def watched():  # the source's own errors (a bad tensor) are raised, not taken for the cache's
        try:
            yield from values
        except Exception as error:
            failed.append(error)
            raise

    weights_cache.save_dir(config.path, entry, lambda d: checkpoint.save_quantized_stream(d, watched(), info))
    if failed:
        raise failed[0]
    values = None  # the spent generator and the file reader it holds
    cached = weights_cache.cached_dir(config.path, entry)
    if cached is not None:
        with contextlib.suppress(*_DAMAGED):
            return checkpoint.load_quantized(str(cached))[0]
    return made(compute())  # the cache cannot be written here: made in memory


@register(PREQUANTIZED)
def _prequantized(model: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    """A checkpoint published quantized: its own codes, where a kernel format holds them exactly
    (quantization/prequantized.py); the other layers keep the float weights the loader decoded."""
    layers, dequantized = prequantized.checkpoint_layers(config.path)
    weights: dict[str, QuantizedWeight] = {}
    used: set[str] = set()
    for name in decoder_linears(model):
        parent, _, child = name.rpartition(".")
        names = [f"{parent}.{shard}" for shard in model.packed_modules.get(child, (child,))]
        parts = [layers.get(part) for part in names]
        fused = layers.get(name)  # a checkpoint that stores the fused layer itself (Phi-3)
        if fused is None and all(part is not None for part in parts):
            fused = stack_rows(parts)  # parts of different formats stay stacked
        if fused is not None:
            weights[name] = fused
            used.update([name, *names])
        elif any(part is not None for part in parts):
            dequantized[name] = "some of its fused parts are float"
            used.update(names)
    experts, expert_names = moe.checkpoint_expert_weights(model, layers)
    weights.update(experts)
    used.update(expert_names)
    for name in sorted(layers.keys() - used):  # the lm_head, experts some expert of which stays float
        if name.startswith("model.layers.") and int(name.split(".")[2]) not in model.stage.layers:
            continue  # another pipeline stage's
        dequantized[name] = "not a quantizable linear of this model"
    kept = len({moe.owner(name) for name in weights})
    prequantized.log_dequantized(config.arch.checkpoint_quantization, kept, dequantized, config.dtype)
    return QuantizationResult(weights)


@register(CHECKPOINT)
def _checkpoint(model: nn.Module, config: ModelConfig, tokenizer) -> QuantizationResult:
    weights, floats, info = checkpoint.load_quantized(config.quantization.path)
    source = checkpoint.source_id(config.path)
    if info.get("source_id") != source:
        raise ValueError(
            f"{config.quantization.path} was quantized from {info.get('source')}, not from {config.path} "
            "(pass that model with --model)"
        )
    return QuantizationResult(weights, floats)
