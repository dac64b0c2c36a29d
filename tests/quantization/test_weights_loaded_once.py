"""A quantization read from files is planned on the model's structure, so the float weights of the
layers it replaces are never loaded (worker/model_loading.py): the model it gives equals the one
built the old way (every float weight loaded, then replaced), tensor for tensor."""

import gguf
import pytest
import torch

from llmserve.config import EngineArgs
from llmserve.kernels.small_batch_linear import use_small_batch_linear
from llmserve.model_loader import load_arch_config, load_weights
from llmserve.models.registry import build_model, check_materialized
from llmserve.quantization.sharding import quantize_shard
from llmserve.worker import model_loading
from tests.quantization.test_quantized_embedding import write_tied_gguf

Q = gguf.GGMLQuantizationType
FLOAT_V = "blk.0.attn_v.weight"  # layer 0's v in float: its fused q/k/v cannot take the blocks


def _config(path: str, dtype: str):
    args = EngineArgs(model=path, quantization="gguf", dtype=dtype, max_model_len=128, kv_cache_memory="8MiB")
    return args.create_config(load_arch_config(path), path).model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_blocks_load_without_the_float_weights_they_replace(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tied.gguf")
    write_tied_gguf(path, Q.Q8_0, Q.Q4_0, types={FLOAT_V: None})
    config = _config(path, dtype)
    loaded: list[set[str]] = []

    def recording_load(*args, **kwargs):
        weights = load_weights(*args, **kwargs)
        loaded.append(set(weights))
        return weights

    monkeypatch.setattr(model_loading, "load_weights", recording_load)
    model = model_loading.load_model(config)

    (names,) = loaded
    assert "model.layers.1.self_attn.q_proj.weight" not in names  # layer 1: all blocks
    assert "model.layers.1.mlp.down_proj.weight" not in names
    assert {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"} <= names  # fused with the float v
    assert "model.embed_tokens.weight" in names  # tied: the head's blocks give its rows only if exact
    assert not hasattr(model.model.layers[0].self_attn.qkv_proj, "kernel")

    reference = build_model(config, load_weights(path, config.dtype))
    quantize_shard(reference, config, None, lambda: None)
    use_small_batch_linear(reference)
    ours, theirs = _state(model), _state(reference)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_a_left_out_weight_nothing_replaces_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tied.gguf")
    write_tied_gguf(path, Q.Q8_0)
    config = _config(path, "float32")
    left_out = frozenset({"model.layers.1.self_attn.o_proj.weight"})
    model = build_model(config, load_weights(path, config.dtype, left_out), left_out=left_out)
    assert model.model.layers[1].self_attn.o_proj.weight.is_meta
    with pytest.raises(RuntimeError, match=r"layers\.1\.self_attn\.o_proj\.weight"):
        check_materialized(model)
    half = frozenset({"model.layers.1.self_attn.q_proj.weight"})  # of the fused q/k/v
    with pytest.raises(ValueError, match="qkv_proj.weight: only"):
        build_model(config, load_weights(path, config.dtype, half), left_out=half)
