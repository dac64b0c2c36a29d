"""Loading: GGUF weights equal transformers' own GGUF loading; HF dirs; the cache; clear errors."""

import json
import os
import shutil

import pytest
import torch

from llmserve.model_loader import (
    ModelLoadError,
    default_model_path,
    load_arch_config,
    load_tokenizer,
    load_weights,
    resolve_model_path,
)

from ..helpers import make_tiny_llama_dir


@pytest.fixture(scope="module")
def hf_reference():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.state_dict()


@pytest.mark.slow
def test_gguf_weights_equal_transformers_gguf_loading(hf_reference):
    ours = load_weights(default_model_path(), torch.float32)
    expected_names = {n for n in hf_reference if n != "lm_head.weight"}  # tied to the embedding
    assert set(ours) == expected_names
    for name in expected_names:
        assert torch.equal(ours[name], hf_reference[name]), name


def test_default_model_architecture():
    arch = load_arch_config(default_model_path())
    assert (arch.architecture, arch.num_hidden_layers, arch.hidden_size) == ("llama", 30, 576)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert arch.tie_word_embeddings and arch.vocab_size == 49152 and arch.eos_token_ids == (2,)
    assert arch.rope_theta == 100000.0


def test_tokenizer_matches_transformers_and_has_a_chat_template():
    from transformers import AutoTokenizer

    path = default_model_path()
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ["Hello world", "naïve café 東京 🚀", "  leading spaces\nand\ttabs"]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    chat = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>" in ours.decode(chat, skip_special_tokens=False)
    assert ours.eos_token_ids == (2,)


def test_hf_directory_round_trip(tmp_path):
    import transformers

    path = make_tiny_llama_dir(str(tmp_path / "tiny"))
    reference = transformers.LlamaForCausalLM.from_pretrained(path).state_dict()
    ours = load_weights(path, torch.float32)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    arch = load_arch_config(path)
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_key_value_heads) == (64, 2, 2)
    assert load_weights(path, torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16


def test_the_second_load_of_a_gguf_comes_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first = load_weights(default_model_path(), torch.float32)
    entries = list((tmp_path / "cache").glob("*/weights.safetensors"))
    assert len(entries) == 1
    second = load_weights(default_model_path(), torch.float32)
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_arch_config(str(garbage))
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as source:
        truncated.write_bytes(source.read(1 << 20))
    with pytest.raises(ModelLoadError):
        load_arch_config(str(truncated))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_arch_config(str(gpt2))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(make_tiny_llama_dir(str(tmp_path / "tiny")), no_weights)
    for file in no_weights.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_weights(str(no_weights), torch.float32)
