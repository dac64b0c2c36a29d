"""A Llama-shaped GGUF of random, valid K-quant blocks, each tensor of the type llama.cpp's `llama-quantize`
gives it in a Q4_K_M (Q5_K_M) file: what llmserve holds of a file of real size, measured where no such
file can be downloaded (docs/models.md). Only memory and speed mean anything on it: the weights are
random, so the model's words are not.

    python -m benchmarks.tools.k_quant_gguf OUT.gguf [--layers 4] [--hidden 4096] [--intermediate 14336]
        [--heads 32 --kv-heads 8] [--vocab 32000] [--type Q4_K_M]

The types (llama.cpp's `llama_tensor_get_type` for these files): the output projection Q6_K, the
embedding and every other projection Q4_K (Q5_K), the v and down projections Q6_K in the layers where
`use_more_bits` holds (the first and last eighth and every third between: half of them). Blocks are as
the quantizer writes them: each super-block's largest 6-bit scale and minimum code 63 (Q4_K, Q5_K) and
its largest-magnitude Q6_K scale -128.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


def use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def blocks(rng: np.random.Generator, qtype, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks [rows, cols / 256 * block bytes] of `qtype`, under float16 factors of a
    trained model's order."""
    out = rng.integers(0, 256, (rows, cols // 256, _BYTES[qtype]), dtype=np.uint8)
    supers = (rows, cols // 256)
    if qtype == Q.Q6_K:
        out[..., 192] = 0x80  # scale 0 of each super-block: -128
        out[..., 208:210] = rng.uniform(5e-5, 2e-4, supers).astype(np.float16)[..., None].view(np.uint8)
        return out.reshape(rows, -1)
    out[..., 0:2] = rng.uniform(1e-4, 1e-3, supers).astype(np.float16)[..., None].view(np.uint8)  # d
    out[..., 2:4] = rng.uniform(1e-4, 1e-3, supers).astype(np.float16)[..., None].view(np.uint8)  # dmin
    out[..., 4] |= 63  # sub-block 0's scale code: 63
    out[..., 8] |= 63  # and its minimum's
    return out.reshape(rows, -1)


def write(path: str, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    main = Q.Q5_K if args.type == "Q5_K_M" else Q.Q4_K
    writer = gguf.GGUFWriter(path, "llama")
    head_dim = args.hidden // args.heads
    for add, value in [
        (writer.add_block_count, args.layers),
        (writer.add_context_length, 4096),
        (writer.add_embedding_length, args.hidden),
        (writer.add_feed_forward_length, args.intermediate),
        (writer.add_head_count, args.heads),
        (writer.add_head_count_kv, args.kv_heads),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_rope_freq_base, 500000.0),
        (writer.add_vocab_size, args.vocab),
    ]:
        add(value)
    tokens = ["<unk>", "<s>", "</s>", *(f"<t{i}>" for i in range(args.vocab - 3))]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * args.vocab)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (args.vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, qtype, rows: int, cols: int) -> None:
        writer.add_tensor(name, blocks(rng, qtype, rows, cols), raw_dtype=qtype)

    add("token_embd.weight", main, args.vocab, args.hidden)
    add("output.weight", Q.Q6_K, args.vocab, args.hidden)
    writer.add_tensor("output_norm.weight", np.ones(args.hidden, dtype=np.float32))
    kv = args.kv_heads * head_dim
    for layer in range(args.layers):
        more = Q.Q6_K if use_more_bits(layer, args.layers) else main
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(args.hidden, dtype=np.float32))
        for name, qtype, rows, cols in [
            ("attn_q", main, args.hidden, args.hidden),
            ("attn_k", main, kv, args.hidden),
            ("attn_v", more, kv, args.hidden),
            ("attn_output", main, args.hidden, args.hidden),
            ("ffn_gate", main, args.intermediate, args.hidden),
            ("ffn_up", main, args.intermediate, args.hidden),
            ("ffn_down", more, args.hidden, args.intermediate),
        ]:
            add(f"blk.{layer}.{name}.weight", qtype, rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--type", choices=["Q4_K_M", "Q5_K_M"], default="Q4_K_M")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    write(args.out, args)


if __name__ == "__main__":
    main()
