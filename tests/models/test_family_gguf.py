"""GGUF files of the newer families, written as llama.cpp's converter lays them out, read back by our
loader exactly as transformers' own GGUF loading reads them (an independent reader): every tensor
equal, and the architecture fields that decide the forward pass equal to transformers' config."""

import numpy as np
import pytest
import torch
import transformers

from llmserve.model_loader import load_arch_config, load_weights

gguf = pytest.importorskip("gguf")

# transformers' GGUF reader takes head_dim only from Gemma's metadata and leaves query_pre_attn_scalar
# at its default (256), which llama.cpp's 1/sqrt(head_dim) equals at head_dim 256, as in real Gemmas
# (Phi-3: none read at all, so hidden / heads)
HEAD_DIM = {"qwen3": 128, "phi3": 16, "gemma2": 256, "gemma3": 256}
TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
CLASSES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_theta=50000.0)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(rope_theta=30000.0, pad_token_id=0)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(sliding_window=16)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(sliding_window=16)),
}
# llama.cpp's tensor names (its converter's tables, written out here independently of the loader's)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(name: str, arch: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**LAYER_NAMES, **(GEMMA_NORMS if arch.startswith("gemma") else LLAMA_NORMS)}
    return f"blk.{layer}.{names[module]}.{kind}"


def write_gguf(path, arch: str, metadata=None) -> None:
    """`metadata(writer)` adds keys of the caller's (a tokenizer) before the file is written."""
    config_cls, model_cls, extra = CLASSES[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, head_dim=HEAD_DIM[arch], **extra)).eval()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_key_length(HEAD_DIM[arch])
    writer.add_value_length(HEAD_DIM[arch])
    writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    writer.add_rope_freq_base(extra.get("rope_theta", model.config.rope_parameters.get("rope_theta", 1e6)))
    writer.add_vocab_size(TINY["vocab_size"])
    if "sliding_window" in extra:
        writer.add_sliding_window(extra["sliding_window"])
    if arch == "gemma2":  # llama.cpp's converter writes Gemma 2's caps (transformers' defaults here)
        writer.add_float32("gemma2.attn_logit_softcapping", model.config.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", model.config.final_logit_softcapping)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # Phi3Config defaults to 32000, outside this vocabulary
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        array = tensor.detach().clone().normal_(1.0 if tensor.dim() == 1 else 0.0, 0.2).numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp's converter stores Gemma's (1 + w)
        writer.add_tensor(_gguf_name(name, arch), np.ascontiguousarray(array))
    if metadata is not None:
        metadata(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _split_phi3(state):
    q_rows = TINY["num_attention_heads"] * HEAD_DIM["phi3"]
    kv_rows = TINY["num_key_value_heads"] * HEAD_DIM["phi3"]
    for name, tensor in state.items():
        if "qkv_proj" in name:
            yield name.replace("qkv_proj", "q_proj"), tensor[:q_rows]
            yield name.replace("qkv_proj", "k_proj"), tensor[q_rows : q_rows + kv_rows]
            yield name.replace("qkv_proj", "v_proj"), tensor[q_rows + kv_rows :]
        elif "gate_up_proj" in name:
            yield name.replace("gate_up_proj", "gate_proj"), tensor[: TINY["intermediate_size"]]
            yield name.replace("gate_up_proj", "up_proj"), tensor[TINY["intermediate_size"] :]
        else:
            yield name, tensor


@pytest.mark.parametrize("arch", list(CLASSES))
def test_gguf_reads_as_transformers_reads_it(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    assert type(reference).__name__ == CLASSES[arch][1].__name__
    expected = {
        n: t
        for n, t in reference.state_dict().items()
        if not (n == "lm_head.weight" and reference.config.tie_word_embeddings)
    }
    if arch == "phi3":  # our loader splits the fused tensors into Llama's names, as for HF checkpoints
        expected = dict(_split_phi3(expected))
    ours = load_weights(str(path), torch.float32)
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    config, ours_arch = reference.config, load_arch_config(str(path))
    assert ours_arch.architecture == arch
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (ours_arch.head_dim, ours_arch.num_key_value_heads) == (head_dim, config.num_key_value_heads)
    assert ours_arch.rope_theta == config.rope_parameters.get(
        "rope_theta", config.rope_parameters.get("full_attention", {}).get("rope_theta")
    )
    assert ours_arch.tie_word_embeddings == config.tie_word_embeddings
    assert ours_arch.qk_norm == (arch in ("qwen3", "gemma3"))
    if arch.startswith("gemma"):
        assert ours_arch.layer_types == tuple(config.layer_types)
        assert ours_arch.sliding_window == config.sliding_window
        assert ours_arch.query_pre_attn_scalar == config.query_pre_attn_scalar
        assert ours_arch.attn_logit_softcapping == config.attn_logit_softcapping
        assert ours_arch.final_logit_softcapping == config.final_logit_softcapping
    if arch == "gemma3":
        assert ours_arch.rope_local_theta == config.rope_parameters["sliding_attention"]["rope_theta"]
