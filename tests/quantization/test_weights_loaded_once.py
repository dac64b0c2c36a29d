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
from llmserve.quantization.embedding import embed_from_packed_head
from llmserve.quantization.sharding import quantize_shard
from llmserve.worker import model_loading
from tests.quantization.test_quantized_embedding import write_tied_gguf

Q = gguf.GGMLQuantizationType
FLOAT_V = "blk.0.attn_v.weight"  # layer 0's v in float: its fused q/k/v cannot take the blocks


def _config(path: str, dtype: str):
    args = EngineArgs(model=path, quantization="gguf", dtype=dtype, max_model_len=128, kv_cache_memory="8MiB")
    return args.create_config(load_arch_config(path), path).model


def load_recording_names(monkeypatch, config) -> tuple[torch.nn.Module, set[str]]:
    """`load_model(config)`, and the names of the float weights it loaded (one load)."""
    loaded: list[set[str]] = []

    def recording_load(*args, **kwargs):
        weights = load_weights(*args, **kwargs)
        loaded.append(set(weights))
        return weights

    monkeypatch.setattr(model_loading, "load_weights", recording_load)
    model = model_loading.load_model(config)
    (names,) = loaded
    return model, names


def assert_equals_the_old_path(model: torch.nn.Module, config, path: str) -> None:
    """`model` holds the very tensors of the model built the old way: every float weight loaded,
    then the quantization applied over them."""
    reference = build_model(config, load_weights(path, config.dtype))
    quantize_shard(reference, config, None, lambda: None)
    use_small_batch_linear(reference)
    embed_from_packed_head(reference)
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    theirs = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_blocks_load_without_the_float_weights_they_replace(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tied.gguf")
    write_tied_gguf(path, Q.Q8_0, Q.Q4_0, types={FLOAT_V: None})
    config = _config(path, dtype)
    model, names = load_recording_names(monkeypatch, config)
    assert "model.layers.1.self_attn.q_proj.weight" not in names  # layer 1: all blocks
    assert "model.layers.1.mlp.down_proj.weight" not in names
    assert {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"} <= names  # fused with the float v
    assert "model.embed_tokens.weight" in names  # tied: the head's blocks give its rows only if exact
    assert not hasattr(model.model.layers[0].self_attn.qkv_proj, "kernel")
    assert_equals_the_old_path(model, config, path)


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


def test_the_float_cache_holds_only_what_starts_asked_for_and_grows(tmp_path, monkeypatch):
    """A start that serves the blocks never dequantizes their tensors, not even into the weights
    cache; a later start that needs them (`--quantization none`) adds them to the entry."""
    from llmserve.model_loader import gguf_loader, weights_cache

    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tied.gguf")
    write_tied_gguf(path, Q.Q8_0)
    left_out = frozenset({"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"})
    blocks = load_weights(path, torch.float32, left_out)
    assert not left_out & weights_cache.load_weights(path).keys()
    full = load_weights(path, torch.float32)
    assert left_out <= weights_cache.load_weights(path).keys()

    def no_parsing(_path):
        raise AssertionError("the cache entry holds every tensor: no GGUF parsing")

    monkeypatch.setattr(gguf_loader, "open_gguf", no_parsing)
    again = load_weights(path, torch.float32, left_out)
    assert again.keys() == blocks.keys() == full.keys() - left_out
    for name, tensor in again.items():
        assert torch.equal(tensor, blocks[name]) and torch.equal(tensor, full[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_moe_gguf_experts_load_in_their_blocks_only(tmp_path, monkeypatch, arch):
    """A MoE GGUF's experts are never dequantized, stacked or allocated in float: their stacked
    tensors are left out, and the model equals the one built the old way."""
    from tests.models.moe_gguf import write_moe_gguf

    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / f"{arch}.gguf")
    write_moe_gguf(path, arch, Q.Q8_0)
    config = _config(path, "float32")
    model, names = load_recording_names(monkeypatch, config)
    assert not any(".experts." in name for name in names)
    assert "model.layers.0.mlp.gate.weight" in names  # the router stays in float
    assert_equals_the_old_path(model, config, path)
