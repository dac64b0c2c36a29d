"""GGUF blocks read natively equal the gguf package's dequantization exactly (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmserve.model_loader import default_model_path, load_arch_config
from llmserve.model_loader.gguf_loader import _to_hf_layout, open_gguf
from llmserve.quantization import gguf_native
from llmserve.quantization.formats import Int4Weight, Int8Weight


@pytest.mark.parametrize(
    ("type_name", "kind"), [("Q4_0", Int4Weight), ("Q4_1", Int4Weight), ("Q8_0", Int8Weight)]
)
def test_block_readers_equal_gguf_dequantize(type_name, kind):
    qtype = GGMLQuantizationType[type_name]
    values = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = quantize(values, qtype)  # [rows, bytes per row]
    weight = gguf_native._READERS[type_name](raw.reshape(6, 3, -1))
    assert isinstance(weight, kind) and weight.group_size == 32
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


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
        from llmserve.model_loader.gguf_loader import hf_name

        name = hf_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        reference = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        reference = torch.from_numpy(np.ascontiguousarray(_to_hf_layout(name, reference, arch, path)))
        assert torch.equal(weights[name].dequantize(), reference), name
