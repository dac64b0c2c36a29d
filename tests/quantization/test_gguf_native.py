"""GGUF blocks read natively equal the gguf package's dequantization exactly (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from llmserve.model_loader import default_model_path, load_arch_config
from llmserve.model_loader.gguf_loader import _to_hf_layout, hf_name, open_gguf
from llmserve.quantization import gguf_native
from llmserve.quantization.formats import Int4Weight, Int8Weight


@pytest.mark.parametrize(
    ("type_name", "kind"),
    [
        ("Q4_0", Int4Weight),
        ("Q4_1", Int4Weight),
        ("Q5_0", Int4Weight),
        ("Q5_1", Int4Weight),
        ("Q8_0", Int8Weight),
    ],
)
def test_block_readers_equal_gguf_dequantize(type_name, kind):
    qtype = GGMLQuantizationType[type_name]
    values = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = quantize(values, qtype)  # [rows, bytes per row]
    weight = gguf_native._READERS[type_name](raw.reshape(6, 3, -1))
    assert isinstance(weight, kind) and weight.group_size == 32
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


def test_q5_0_blocks_are_5_bit_codes_equal_to_gguf_dequantize():
    """Q5_0 blocks of random bytes (every pattern of fifth bits) under float16 d: codes 0..31 (bits 5),
    scale d and offset -16 d, equal to the gguf package's dequantization bit for bit; and as int8
    codes q - 16 (how they fuse beside Q8_0 shards) the same weights."""
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (9, 4, 22), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(1e-4, 3e-3, (9, 4, 1)).astype(np.float16).view(np.uint8)
    weight = gguf_native._READERS["Q5_0"](blocks)
    assert isinstance(weight, Int4Weight) and (weight.bits, weight.group_size) == (5, 32)
    assert weight.qweight.dtype == torch.uint8 and int(weight.qweight.max()) == 31
    assert torch.equal(weight.offsets, -16 * weight.scales)
    reference = torch.from_numpy(dequantize(blocks.reshape(9, -1), GGMLQuantizationType.Q5_0))
    assert torch.equal(weight.dequantize(), reference)
    assert torch.equal(weight.as_int8().dequantize(), reference)


def _random_q4_k_blocks(rng: np.random.Generator, rows: int, supers: int) -> np.ndarray:
    """Valid Q4_K super-blocks [rows, supers, 144]: random 6-bit scales, minimums and nibbles under
    float16 factors of a real model's size."""
    blocks = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    for start in (0, 2):  # d, dmin
        factors = rng.uniform(1e-4, 3e-3, (rows, supers)).astype(np.float16)
        blocks[..., start : start + 2] = factors[..., None].view(np.uint8)
    return blocks


def test_q4_k_super_blocks_equal_gguf_dequantize():
    """Q4_K: eight sub-blocks of 32 per super-block become int4 groups of 32 (scale d * sc, offset
    -dmin * m), equal to the gguf package's dequantization bit for bit."""
    blocks = _random_q4_k_blocks(np.random.default_rng(1), 7, 3)
    weight = gguf_native._READERS["Q4_K"](blocks)
    assert isinstance(weight, Int4Weight) and weight.group_size == 32 and weight.shape == (7, 768)
    reference = dequantize(blocks.reshape(7, -1), GGMLQuantizationType.Q4_K)
    assert torch.equal(weight.dequantize(), torch.from_numpy(reference))


def test_q5_k_super_blocks_are_5_bit_codes_equal_to_gguf_dequantize():
    """Q5_K: Q4_K's sub-blocks with a fifth bit per weight (every pattern: random bytes) become 5-bit
    int4 groups of 32 (scale d * sc, offset -dmin * m), equal to the gguf package's dequantization
    bit for bit."""
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (7, 3, 176), dtype=np.uint8)
    blocks[..., :4] = _random_q4_k_blocks(rng, 7, 3)[..., :4]  # d, dmin
    weight = gguf_native._READERS["Q5_K"](blocks)
    assert isinstance(weight, Int4Weight) and (weight.bits, weight.group_size) == (5, 32)
    assert weight.shape == (7, 768) and int(weight.qweight.max()) == 31
    reference = dequantize(blocks.reshape(7, -1), GGMLQuantizationType.Q5_K)
    assert torch.equal(weight.dequantize(), torch.from_numpy(reference))


def test_q6_k_super_blocks_equal_gguf_dequantize():
    """Q6_K: sixteen sub-blocks of 16 per super-block become int8 codes q - 32 in groups of 16 (scale
    d * sc), equal to the gguf package's dequantization bit for bit."""
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (7, 3, 210), dtype=np.uint8)
    blocks[..., 208:210] = rng.uniform(1e-4, 2e-3, (7, 3, 1)).astype(np.float16).view(np.uint8)
    weight = gguf_native._READERS["Q6_K"](blocks)
    assert isinstance(weight, Int8Weight) and weight.group_size == 16 and weight.shape == (7, 768)
    reference = dequantize(blocks.reshape(7, -1), GGMLQuantizationType.Q6_K)
    assert torch.equal(weight.dequantize(), torch.from_numpy(reference))


def test_q3_k_super_blocks_equal_gguf_dequantize():
    """Q3_K: sixteen sub-blocks of 16 per super-block (random bytes: every pattern of high bits and
    signed 6-bit scales) become int8 codes in -4..3 in groups of 16 (scale d * (sc - 32)), equal to
    the gguf package's dequantization bit for bit."""
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, (7, 3, 110), dtype=np.uint8)
    blocks[..., 108:110] = rng.uniform(1e-4, 2e-3, (7, 3, 1)).astype(np.float16).view(np.uint8)
    weight = gguf_native._READERS["Q3_K"](blocks)
    assert isinstance(weight, Int8Weight) and weight.group_size == 16 and weight.shape == (7, 768)
    assert (int(weight.qweight.min()), int(weight.qweight.max())) == (-4, 3)
    assert bool((weight.scales < 0).any()) and bool((weight.scales > 0).any())
    reference = dequantize(blocks.reshape(7, -1), GGMLQuantizationType.Q3_K)
    assert torch.equal(weight.dequantize(), torch.from_numpy(reference))


@pytest.mark.parametrize("main_type", ["Q4_K", "Q5_K", "Q3_K"])
def test_a_k_m_style_file_reads_in_hf_layout(tmp_path, main_type):
    """A GGUF mixing types as a Q4_K_M (Q5_K_M, Q3_K_M) file does (Q4_K (Q5_K, Q3_K), with Q6_K for the
    v and down projections; q/k rows permuted as llama.cpp writes them): each tensor is read natively,
    equal to the gguf package's dequantization of the file's tensor, rows put back in HF order."""
    hidden, intermediate, heads, kv_heads = 256, 512, 4, 2
    path = tmp_path / "q4_k_m.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(97)
    rng = np.random.default_rng(2)
    head_dim = hidden // heads
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (intermediate, hidden),
        "ffn_up": (intermediate, hidden),
        "ffn_down": (hidden, intermediate),
    }
    written = {}
    for short, (rows, cols) in shapes.items():
        if short in ("attn_v", "ffn_down"):
            qtype, blocks = (
                GGMLQuantizationType.Q6_K,
                rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8),
            )
            blocks[..., 208:210] = (
                rng.uniform(1e-4, 2e-3, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
            )
        elif main_type == "Q4_K":
            qtype, blocks = GGMLQuantizationType.Q4_K, _random_q4_k_blocks(rng, rows, cols // 256)
        elif main_type == "Q3_K":  # random bytes under a float16 d of a real model's size
            qtype, blocks = (
                GGMLQuantizationType.Q3_K,
                rng.integers(0, 256, (rows, cols // 256, 110), dtype=np.uint8),
            )
            blocks[..., 108:110] = (
                rng.uniform(1e-4, 2e-3, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
            )
        else:  # Q5_K: random bytes (every pattern of fifth bits) under Q4_K-sized factors
            qtype, blocks = (
                GGMLQuantizationType.Q5_K,
                rng.integers(0, 256, (rows, cols // 256, 176), dtype=np.uint8),
            )
            blocks[..., :4] = _random_q4_k_blocks(rng, rows, cols // 256)[..., :4]
        written[f"blk.0.{short}.weight"] = (qtype, blocks)
        writer.add_tensor(f"blk.0.{short}.weight", blocks.reshape(rows, -1), raw_dtype=qtype)
    writer.add_tensor("token_embd.weight", rng.standard_normal((97, hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch = load_arch_config(str(path))
    weights = gguf_native.read_quantized_tensors(str(path), arch)
    assert len(weights) == len(shapes)
    for gguf_name, (qtype, blocks) in written.items():
        name = hf_name(gguf_name)
        rows = blocks.shape[0]
        reference = dequantize(blocks.reshape(rows, -1), qtype)
        reference = np.ascontiguousarray(_to_hf_layout(name, reference, arch, str(path)))
        sixteen = (GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q3_K)
        kind = (Int8Weight, 16) if qtype in sixteen else (Int4Weight, 32)
        assert (type(weights[name]), weights[name].group_size) == kind, name
        assert torch.equal(weights[name].dequantize(), torch.from_numpy(reference)), name
    q_name = hf_name("blk.0.attn_q.weight")
    assert not torch.equal(  # the q rows really moved (so the layout check above can fail)
        weights[q_name].dequantize(),
        torch.from_numpy(
            dequantize(
                written["blk.0.attn_q.weight"][1].reshape(hidden, -1), written["blk.0.attn_q.weight"][0]
            )
        ),
    )


def test_default_model_tensors_equal_gguf_dequantize_in_hf_layout():
    """The real Q4_1 file: q/k rows un-permuted like the float loader, the Q8_0 embedding too."""
    path = default_model_path()
    arch = load_arch_config(path)
    weights = gguf_native.read_quantized_tensors(path, arch)
    reader = open_gguf(path)
    checked = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight", "token_embd.weight"}
    tensors = [t for t in reader.tensors if t.name in checked]
    assert len(tensors) == len(checked)
    for tensor in tensors:
        name = hf_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        reference = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        reference = torch.from_numpy(np.ascontiguousarray(_to_hf_layout(name, reference, arch, path)))
        assert torch.equal(weights[name].dequantize(), reference), name
