"""Each tensor-parallel rank's quantized shard and each pipeline stage's, built in this process (no
process group needed to build and quantize a shard), against the whole model's quantization cut by
hand.

The oracle cuts the dequantized whole-model weights with plain arithmetic on the rank's heads,
units and vocabulary block (not the code under test): the rows of q/k/v and gate/up, the columns of
o_proj and down_proj, the vocabulary rows of the lm_head plus zero padding. The tiny model
(conftest.py) has 6 query / 3 KV heads of 16 and 128 MLP units: 2 ranks hold 64 + 32 input columns
of o_proj and 64 + 64 of down_proj; 3 ranks hold 32 each and 43 / 43 / 42 (which cut groups of 32).
"""

from __future__ import annotations

import pytest
import torch

from llmserve.config import EngineArgs, ModelConfig
from llmserve.distributed.group import TensorParallelGroup
from llmserve.distributed.pipeline import PipelineStage
from llmserve.distributed.shard import ShardLayout
from llmserve.model_loader import load_arch_config, load_tokenizer, load_weights
from llmserve.models.registry import build_model
from llmserve.quantization import checkpoint
from llmserve.quantization.formats import Int8Weight, quantize_int8, shard_columns
from llmserve.quantization.kernels import QuantizedLinear
from llmserve.quantization.methods import decoder_linears, quantize_model
from llmserve.quantization.sharding import quantize_shard
from tests.distributed.conftest import UNEVEN_HEADS
from tests.helpers import make_tiny_llama_dir

ROW_PARALLEL = ("o_proj", "down_proj")
METHODS = ("int8-rtn", "int4", "int8", "awq", "gguf-like")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def _config(path: str, quantization: str | None, tp: int = 2) -> ModelConfig:
    args = EngineArgs(
        model=path,
        dtype="float32",
        kv_cache_memory="4MiB",
        tensor_parallel_size=tp,
        quantization=quantization,
    )
    return args.create_config(load_arch_config(path), path).model


def _build(config: ModelConfig, rank: int = 0, tp: int = 1):
    group = TensorParallelGroup(rank, tp) if tp > 1 else None
    return build_model(config, load_weights(config.path, config.dtype), group)


def _shards(config: ModelConfig, tokenizer, tp: int = 2) -> list:
    shards = []
    for rank in range(tp):
        shard = _build(config, rank, tp)
        quantize_shard(shard, config, tokenizer, lambda: _build(config))
        shards.append(shard)
    return shards


def _dequantized(model) -> dict[str, torch.Tensor]:
    return {
        name: module.kernel.dequantize(torch.float32)
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
    }


def _cut(name: str, weight: torch.Tensor, shard: ShardLayout, config: ModelConfig) -> torch.Tensor:
    """The rank's part of a whole-model weight of module `name`, by hand."""
    arch = config.arch
    heads = lambda units: slice(units.start * arch.head_dim, units.stop * arch.head_dim)  # noqa: E731
    units = slice(shard.intermediate.start, shard.intermediate.stop)
    if name.endswith("qkv_proj"):
        kv = arch.num_key_value_heads * arch.head_dim
        q, k, v = weight.split([arch.num_attention_heads * arch.head_dim, kv, kv])
        return torch.cat([q[heads(shard.q_heads)], k[heads(shard.kv_heads)], v[heads(shard.kv_heads)]])
    if name.endswith("gate_up_proj"):
        gate, up = weight.chunk(2)
        return torch.cat([gate[units], up[units]])
    if name.endswith("o_proj"):
        return weight[:, heads(shard.q_heads)]
    if name.endswith("down_proj"):
        return weight[:, units]
    assert name == "lm_head"
    rows = weight[shard.vocab.start : shard.vocab.stop]
    return torch.cat([rows, rows.new_zeros(shard.vocab_rows - len(rows), rows.shape[1])])


@pytest.mark.parametrize("method", ["int4", "int8", "gptq", "awq", "checkpoint"])
def test_each_rank_holds_its_part_of_the_whole_models_quantization(
    method, tiny_llama_dir, tokenizer, gguf_like_checkpoint
):
    """int4 quantizes each shard (its groups of 32 fall on the ranks' cuts, so per shard is per
    model); int8, gptq and awq calibrate the whole model on every rank and cut it; a checkpoint is
    cut. Every rank's weights are the whole model's, exactly; AWQ's folded norms are every rank's."""
    config = _config(tiny_llama_dir, gguf_like_checkpoint if method == "checkpoint" else method)
    whole = _build(config)
    quantize_model(whole, config, tokenizer)
    want = _dequantized(whole)
    assert len(want) == 2 * 4 + 1
    for shard in _shards(config, tokenizer):
        got = _dequantized(shard)
        assert got.keys() == want.keys()
        for name, weight in want.items():
            assert torch.equal(got[name], _cut(name, weight, shard.shard, config)), (shard.shard.rank, name)
        for layer, whole_layer in zip(shard.model.layers, whole.model.layers, strict=True):
            assert torch.equal(layer.input_layernorm.weight, whole_layer.input_layernorm.weight)
            assert torch.equal(
                layer.post_attention_layernorm.weight, whole_layer.post_attention_layernorm.weight
            )
    if method == "awq":  # the folding changed them: the check above is not vacuous
        float_model = _build(_config(tiny_llama_dir, None, tp=1))
        norm = float_model.model.layers[0].input_layernorm.weight
        assert not torch.equal(whole.model.layers[0].input_layernorm.weight, norm)


@pytest.mark.parametrize(
    ("method", "tp"),
    # int8-rtn's row-parallel scales differ per rank by design (the test below);
    # awq at 2 ranks: test_each_rank_holds_its_part_of_the_whole_models_quantization
    [(method, 1) for method in METHODS] + [(method, 2) for method in ("int4", "int8", "gguf-like")],
)
def test_each_pipeline_stage_holds_its_layers_of_the_whole_models_quantization(
    method, tp, tiny_llama_dir, tokenizer, gguf_like_checkpoint
):
    """Two stages of the two-layer model: stage 0 holds layer 0's quantized weights, stage 1 layer
    1's and the lm_head, each exactly the whole model's (cut per tensor-parallel rank); AWQ's folded
    norms follow their layers."""
    quantization = gguf_like_checkpoint if method == "gguf-like" else method
    config = _config(tiny_llama_dir, quantization, tp=tp)
    whole = _build(config)
    quantize_model(whole, config, tokenizer)
    want = _dequantized(whole)
    for index in range(2):
        stage = PipelineStage.of(config.arch.num_hidden_layers, 2, index)
        for rank in range(tp):
            group = TensorParallelGroup(rank, tp) if tp > 1 else None
            part = build_model(config, load_weights(config.path, config.dtype), group, stage)
            quantize_shard(part, config, tokenizer, lambda: _build(config))
            got = _dequantized(part)
            owned = [name for name in want if name.startswith(f"model.layers.{index}.")]
            assert sorted(got) == sorted(owned + (["lm_head"] if index == 1 else []))
            for name, weight in got.items():
                assert torch.equal(weight, _cut(name, want[name], part.shard, config)), (index, rank, name)
            layer, whole_layer = part.model.layers[index], whole.model.layers[index]
            assert torch.equal(layer.input_layernorm.weight, whole_layer.input_layernorm.weight)


def test_int8_rtn_scales_each_shards_rows(tiny_llama_dir, tokenizer):
    """One scale per output row of the rank's shard: the whole model's rows where a rank holds whole
    rows (q/k/v, gate/up, the lm_head), its own columns' maximum in o_proj and down_proj."""
    config = _config(tiny_llama_dir, "int8-rtn")
    float_model = _build(config)
    floats = {name: linear.weight for name, linear in decoder_linears(float_model).items()}
    whole = _build(config)
    quantize_model(whole, config, tokenizer)
    want = _dequantized(whole)
    row_parallel_differs = False
    for shard in _shards(config, tokenizer):
        for name, weight in _dequantized(shard).items():
            if name.endswith(ROW_PARALLEL):
                expected = quantize_int8(_cut(name, floats[name], shard.shard, config)).dequantize()
                row_parallel_differs |= not torch.equal(expected, _cut(name, want[name], shard.shard, config))
            else:
                expected = _cut(name, want[name], shard.shard, config)
            assert torch.equal(weight, expected), (shard.shard.rank, name)
    assert row_parallel_differs  # per shard is not per model there: the oracle above tells them apart


def test_a_cut_through_a_group_is_a_one_line_error(tiny_llama_dir, gguf_like_checkpoint):
    config = _config(tiny_llama_dir, gguf_like_checkpoint, tp=3)
    shard = _build(config, rank=2, tp=3)  # it names rank 0: every rank checks every rank's cuts
    with pytest.raises(ValueError) as error:
        quantize_shard(shard, config, None, lambda: _build(config))
    message = str(error.value)
    assert message == (
        "quantized layer model.layers.0.mlp.down_proj cannot be split over tensor_parallel_size 3: "
        "rank 0's input columns 0..43 cut its groups of 32 columns"
    )


def test_per_channel_int8_splits_anywhere():
    weight = quantize_int8(torch.randn(4, 96))
    part = shard_columns(weight, 43, 86)
    assert isinstance(part, Int8Weight) and part.group_size == 43
    assert torch.equal(part.dequantize(), weight.dequantize()[:, 43:86])
    grouped = quantize_int8(torch.randn(4, 96), 32)
    assert torch.equal(shard_columns(grouped, 32, 96).dequantize(), grouped.dequantize()[:, 32:])
    with pytest.raises(ValueError, match="input columns 0..43 cut its groups of 32 columns"):
        shard_columns(grouped, 0, 43)


def test_the_last_vocabulary_block_is_padded_with_zero_rows(tmp_path):
    """49,153 rows over 2 ranks: 24,577 each, the last block padded with one zero row, whether the
    rank quantizes its block (int8-rtn) or cuts the whole model's (a checkpoint with Q8_0's groups)."""
    path = make_tiny_llama_dir(str(tmp_path / "model"), vocab_size=49153, **UNEVEN_HEADS)
    head = quantize_int8(_build(_config(path, None, tp=1)).lm_head.weight, 32)
    saved = str(tmp_path / "checkpoint")
    checkpoint.save_quantized(saved, {"lm_head": head}, {"source_id": checkpoint.source_id(path)})
    for quantization in ("int8-rtn", saved):
        config = _config(path, quantization)
        whole = _build(config)
        quantize_model(whole, config)
        want = whole.lm_head.kernel.dequantize(torch.float32)
        heads = [shard.lm_head.kernel.dequantize(torch.float32) for shard in _shards(config, None)]
        assert [len(rows) for rows in heads] == [24577, 24577]
        assert torch.equal(heads[0], want[:24577]) and torch.equal(heads[1][:-1], want[24577:])
        assert not heads[1][-1].any() and heads[1][:-1].abs().sum(-1).min() > 0
