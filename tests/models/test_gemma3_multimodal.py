"""Gemma3ForConditionalGeneration served for text: a tiny random one built with transformers' own
classes (a tiny SigLIP tower too) gives transformers' greedy tokens and logits in float32; its vision
tensors are never read; its config.json as transformers saves a real one (a diff from the defaults)
reads as transformers reads it."""

from __future__ import annotations

import json
import os

import pytest
import safetensors
import safetensors.torch
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.model_loader import default_model_path, load_arch_config, load_tokenizer, load_weights
from llmserve.model_loader.hf_loader import read_arch_config
from tests.e2e.conftest import hf_greedy, teacher_forced_logits

from .families import CASES, COMMON, VOCAB

TEXT = dict(COMMON, **CASES["gemma3-qk-norm-local-rope"][2])  # the text family test's Gemma 3
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, patch_size=8)
# google/gemma-3-4b-it's config.json: transformers saved only what differs from Gemma3TextConfig's defaults
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
CHUNK = 12


def _tiny_model() -> transformers.Gemma3ForConditionalGeneration:
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**TEXT),
        vision_config=transformers.SiglipVisionConfig(image_size=32, **VISION),
        mm_tokens_per_image=4,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # peaked logits and noisy norms, as tests/models/families.py draws them
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
            elif not name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the HF model, its directory as transformers saved it)."""
    path = str(tmp_path_factory.mktemp("gemma3-mm"))
    model = _tiny_model()
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)  # VOCAB is the default model's
    return model, path


@pytest.fixture(scope="module")
def llm(tiny):
    llm = LLM(tiny[1], dtype="float32", max_model_len=128, max_num_batched_tokens=CHUNK, block_size=4)
    yield llm
    llm.shutdown()


def _prompt(seed: int, length: int = 40) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_checkpoint_holds_the_vision_tower(tiny):
    with safetensors.safe_open(os.path.join(tiny[1], "model.safetensors"), "pt") as handle:
        names = list(handle.keys())  # noqa: SIM118 (a safetensors handle is no dict)
    assert any(name.startswith("vision_tower.") for name in names)
    assert any(name.startswith("multi_modal_projector.") for name in names)


def test_greedy_tokens_equal_transformers(tiny, llm):
    hf, _ = tiny
    prompts = [_prompt(2), _prompt(3, 9), _prompt(4, 20)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 24)


def test_prefill_logits_equal_transformers(tiny, llm):
    hf, _ = tiny
    tokens = _prompt(1)
    ours = teacher_forced_logits(llm, tokens)
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_vision_tensors_are_never_read(tiny, monkeypatch):
    read: list[str] = []
    original = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.handle = original(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    weights = load_weights(tiny[1], torch.float32)
    assert read and not [name for name in read if "vision" in name or "multi_modal" in name]
    assert "model.layers.0.self_attn.q_norm.weight" in weights
    assert not [name for name in weights if not name.startswith("model.")]  # tied: no lm_head


def test_newer_transformers_layout_loads_the_same(tiny, tmp_path):
    """transformers 4.52+ names the language model's tensors model.language_model.* (and the tower's
    model.vision_tower.*)."""
    _, path = tiny
    tensors = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
    renamed = {
        name.replace("language_model.model.", "model.language_model.", 1)
        .replace("vision_tower.", "model.vision_tower.", 1)
        .replace("multi_modal_projector.", "model.multi_modal_projector.", 1): tensor
        for name, tensor in tensors.items()
    }
    safetensors.torch.save_file(renamed, str(tmp_path / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as config:
        (tmp_path / "config.json").write_text(config.read())
    expected, ours = load_weights(path, torch.float32), load_weights(str(tmp_path), torch.float32)
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[name], expected[name]) for name in expected)
    assert load_arch_config(str(tmp_path)) == load_arch_config(path)


def test_a_real_config_reads_as_transformers_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_CONFIG))
    ours = read_arch_config(str(tmp_path))
    text = transformers.AutoConfig.from_pretrained(str(tmp_path)).text_config
    assert ours.architecture == "gemma3"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
        assert getattr(ours, field) == getattr(text, field), field
    heads = (text.num_attention_heads, text.num_key_value_heads)
    assert (ours.num_attention_heads, ours.num_key_value_heads) == heads == (8, 4)
    assert ours.layer_types == tuple(text.layer_types)
    assert ours.sliding_window == text.sliding_window == 1024
    assert ours.query_pre_attn_scalar == text.query_pre_attn_scalar
    assert ours.rms_norm_eps == text.rms_norm_eps
    assert ours.rope_theta == text.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert ours.rope_local_theta == text.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.tie_word_embeddings == text.tie_word_embeddings
    assert ours.eos_token_ids == (1, 106)


def test_a_template_beside_the_processor_is_the_chat_template(tiny, tmp_path):
    """Multimodal repositories may keep their chat template in chat_template.json only."""
    template = "{% for m in messages %}<turn>{{ m['content'] }}</turn>{% endfor %}"
    hf = load_tokenizer(default_model_path()).hf
    hf.chat_template = None
    hf.save_pretrained(str(tmp_path))
    for name in os.listdir(tiny[1]):
        if name in ("config.json", "model.safetensors"):
            os.symlink(os.path.join(tiny[1], name), tmp_path / name)
    assert load_tokenizer(str(tmp_path)).chat_template_text() is None
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.chat_template_text() == template
    assert tokenizer.decode(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])) == (
        "<turn>hi</turn>"
    )
