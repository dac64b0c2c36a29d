"""Tiny random Mixtral and Qwen3-MoE models written as GGUF files with gguf-py, as llama.cpp's converter
lays them out: merged `ffn_*_exps` experts, the `ffn_gate_inp` router, Mixtral (`llama` with experts)
with its q/k rows permuted."""

from __future__ import annotations

import gguf
import numpy as np
import torch
import transformers

from tests.lora.adapters import llama_cpp_rope_permute

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 97, 64, 4, 2, 16, 2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=20000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# gguf architecture -> (config class, model class, the experts' settings)
CASES = {
    "llama": (  # Mixtral
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen3moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    ),
}
# llama.cpp's names of the tensors these models have (written out here, independently of the loader's)
NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _tokenizer(writer, vocab: int = VOCAB) -> None:
    """A sentencepiece-style vocabulary of `vocab` pieces (the prompts are token ids)."""
    tokens = ["<pad>", "<s>", "</s>", *(f"<t{i}>" for i in range(vocab - 3))]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensors(model: transformers.PreTrainedModel, arch: str):
    """(llama.cpp name, float32 array) of every tensor, in the converter's layouts."""
    units = model.config.moe_intermediate_size if arch == "qwen3moe" else model.config.intermediate_size
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name in GLOBAL_NAMES or name == "lm_head.weight":
            yield GLOBAL_NAMES.get(name, "output.weight"), array
            continue
        layer, rest = name.split(".")[2], name.split(".", 3)[3]
        if rest == "mlp.experts.gate_up_proj":  # HF's [gate; up] rows: llama.cpp's two tensors
            yield f"blk.{layer}.ffn_gate_exps.weight", array[:, :units]
            yield f"blk.{layer}.ffn_up_exps.weight", array[:, units:]
            continue
        if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            array = llama_cpp_rope_permute(array, HEADS if "q_proj" in rest else KV_HEADS)
        yield f"blk.{layer}.{NAMES[rest]}", array


def write_moe_gguf(path, arch: str, qtype=None) -> transformers.PreTrainedModel:
    """The case's tiny random model as a GGUF; `qtype`: the 2-D and 3-D projections (router left
    out) quantized by gguf-py to that type. Returns the transformers model."""
    config_cls, model_cls, extra = CASES[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.2)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(COMMON["max_position_embeddings"])
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(COMMON["intermediate_size"])
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(COMMON["rms_norm_eps"])
    writer.add_rope_freq_base(COMMON["rope_theta"])
    writer.add_vocab_size(VOCAB)
    writer.add_expert_count(extra.get("num_local_experts") or extra["num_experts"])
    writer.add_expert_used_count(extra["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(extra["moe_intermediate_size"])
    _tokenizer(writer)
    for name, array in _tensors(model, arch):
        projection = array.ndim >= 2 and "ffn_gate_inp" not in name and "token_embd" not in name
        if qtype is not None and projection:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
