"""A rank's model from its checkpoint, in the form it serves: read once, quantized as configured.

Where the quantization comes from files (a GGUF's own blocks, a saved or a published checkpoint:
`FROM_FILES`), it is planned on the model's structure first (a meta-device model), so the float
weights of the layers it replaces are never converted, allocated or copied: the model holds only the
quantized copy from the start. Other quantizations read the float weights, which load as usual.
"""

from __future__ import annotations

from torch import nn

from llmserve.config import ModelConfig
from llmserve.distributed.group import TensorParallelGroup
from llmserve.distributed.pipeline import PipelineStage
from llmserve.kernels.small_batch_linear import current_packs, note_moved_weights, use_small_batch_linear
from llmserve.model_loader import load_weights
from llmserve.models.registry import build_model, check_materialized, meta_model
from llmserve.quantization.embedding import embed_from_packed_head
from llmserve.worker.weight_arena import gather_weights


def load_model(
    config: ModelConfig,
    tokenizer=None,
    group: TensorParallelGroup | None = None,
    stage: PipelineStage | None = None,
) -> nn.Module:
    """This rank's shard (all of it with one rank) of the model at `config.path`, quantized as
    `config.quantization` says, its linear layers in the CPU kernels' packed layouts, its CPU weights
    in huge pages (worker/weight_arena.py). `tokenizer`: for calibrated quantization (None: loaded
    where needed)."""
    method = None if config.quantization is None else config.quantization.method
    if method is not None:  # quantization's modules load only where a model is quantized
        from llmserve.quantization import sharding

    def whole_model() -> nn.Module:  # one process's float model, for calibration under parallelism
        return build_model(config, load_weights(config.path, config.dtype))

    planned, left_out = None, frozenset()
    if method is not None and method in sharding.FROM_FILES:
        skeleton = meta_model(config, group, stage)
        planned = sharding.plan_shard(skeleton, config, tokenizer, whole_model)
        left_out = sharding.float_weights_replaced(skeleton, planned)
    model = build_model(config, load_weights(config.path, config.dtype, left_out), group, stage, left_out)
    if method is not None:  # a transform of the loaded model (module swap)
        sharding.quantize_shard(model, config, tokenizer, whole_model, planned)
    elif config.arch.checkpoint_quantization is not None:  # a pre-quantized checkpoint served in float
        from llmserve.quantization.prequantized import log_served_float

        log_served_float(config.arch.checkpoint_quantization, config.dtype, config.device)
    check_materialized(model)
    use_small_batch_linear(model)  # CPU: packed weight layouts (bf16: the small-batch kernel)
    embed_from_packed_head(model)  # a tied bf16 embedding: its rows from the head's packed copy
    current = current_packs(model)  # before the move, which changes their weights' addresses
    if gather_weights(model):  # CPU: into huge pages, as they will be read
        note_moved_weights(current)
    return model
