"""A Qwen3 GGUF written as llama.cpp lays it out reads back as transformers' own GGUF loading reads it
(an independent reader), and serves the logits of the HF model it was written from."""

import numpy as np
import pytest
import torch
import transformers

from llmserve.model_loader import load_arch_config, load_weights

gguf = pytest.importorskip("gguf")

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,  # transformers reads no key_length for qwen3: its default head_dim (as real Qwen3s)
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    tie_word_embeddings=False,
)
# llama.cpp's tensor names for Qwen3 (its converter's table, written out here independently)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def write_qwen3_gguf(path) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.2)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_key_length(TINY["head_dim"])
    writer.add_value_length(TINY["head_dim"])
    writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_vocab_size(TINY["vocab_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(tensor.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def test_qwen3_gguf_reads_as_transformers_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen3.gguf"
    write_qwen3_gguf(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    assert type(reference).__name__ == "Qwen3ForCausalLM"
    expected = reference.state_dict()
    ours = load_weights(str(path), torch.float32)
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    arch = load_arch_config(str(path))
    assert (arch.architecture, arch.qk_norm, arch.head_dim, arch.rope_theta) == ("qwen3", True, 128, 50000.0)
    assert (arch.num_key_value_heads, arch.tie_word_embeddings, arch.attention_bias) == (2, False, False)
