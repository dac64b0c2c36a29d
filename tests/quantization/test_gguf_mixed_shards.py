"""A fused layer whose GGUF shards are of types that do not join (a Q4_K_M file's Q4_K q/k beside its
Q6_K v on some layers) keeps every shard in its file's codes (`StackedRows`, `StackedKernel`): the
weights equal the file's, tensor-parallel rows cut from each part, and the fused decode stack runs the
two-part q/k/v bit-identically to the modules."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmserve import LLM
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.quantization.formats import (
    Int4Weight,
    Int8Weight,
    StackedRows,
    quantize_int4,
    quantize_int8,
    shard_rows,
    stack_rows,
)
from llmserve.quantization.kernels import StackedKernel
from tests.models.moe_gguf import _tokenizer
from tests.models.test_decode_stack import _assert_three_decodes_bit_identical

Q = gguf.GGMLQuantizationType
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
VOCAB = 4200  # the decode-stack tests' prompts' ids
HEAD_DIM = HIDDEN // HEADS
ENGINE = dict(max_model_len=128, kv_cache_memory="8MiB", enforce_eager=True)


def _k_quant_blocks(rng: np.random.Generator, qtype, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks [rows, cols * block bytes / 256] under small float16 factors (the model's
    activations stay finite): Q4_K's d and dmin, Q6_K's d."""
    size = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for start in (0, 2) if qtype == Q.Q4_K else (208,):
        factors = rng.uniform(1e-5, 1e-4, (rows, cols // 256)).astype(np.float16)
        blocks[..., start : start + 2] = factors[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> str:
    """A 2-layer Llama as a Q4_K_M file lays one out: Q4_K projections, Q6_K down and, in layer 0 only,
    a Q6_K v (so its q/k/v does not join); float embedding, tied."""
    return write_q4_k_m(str(tmp_path_factory.mktemp("mixed") / "q4_k_m.gguf"))


def write_q4_k_m(path: str, untied: bool = False, arch: str = "llama") -> str:
    """`mixed_gguf`'s file at `path`; `untied`: a Q4_K embedding and a Q6_K output projection of its own,
    as llama.cpp writes an untied model's Q4_K_M; arch "qwen2": with float q/k/v biases, as Qwen2's."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    for add, value in [
        (writer.add_block_count, LAYERS),
        (writer.add_context_length, 256),
        (writer.add_embedding_length, HIDDEN),
        (writer.add_feed_forward_length, INTERMEDIATE),
        (writer.add_head_count, HEADS),
        (writer.add_head_count_kv, KV_HEADS),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_vocab_size, VOCAB),
    ]:
        add(value)
    _tokenizer(writer, VOCAB)
    if untied:
        writer.add_tensor("token_embd.weight", _k_quant_blocks(rng, Q.Q4_K, VOCAB, HIDDEN), raw_dtype=Q.Q4_K)
        writer.add_tensor("output.weight", _k_quant_blocks(rng, Q.Q6_K, VOCAB, HIDDEN), raw_dtype=Q.Q6_K)
    else:
        writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }
    for layer in range(LAYERS):
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{name}.weight", np.ones(HIDDEN, dtype=np.float32))
        for short in ("attn_q", "attn_k", "attn_v") if arch == "qwen2" else ():
            bias = rng.uniform(-0.5, 0.5, shapes[short][0]).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{short}.bias", bias)
        for short, (rows, cols) in shapes.items():
            six = short == "ffn_down" or (short == "attn_v" and layer == 0)
            qtype = Q.Q6_K if six else Q.Q4_K
            writer.add_tensor(
                f"blk.{layer}.{short}.weight", _k_quant_blocks(rng, qtype, rows, cols), raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_mixed_layer_keeps_each_shard_in_its_codes(mixed_gguf, tmp_path, monkeypatch):
    """Layer 0's q/k/v is two parts (q and k joined as int4, v as int8 groups of 16), layer 1's one
    int4 weight; the stacked weights equal the file's dequantized to float32 (`--quantization none`)."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    quantized = LLM(mixed_gguf, dtype="float32", quantization="gguf", **ENGINE)
    layers = quantized.engine.model_runner.model.model.layers
    kernel = layers[0].self_attn.qkv_proj.kernel
    assert isinstance(kernel, StackedKernel) and len(kernel.parts) == 2
    assert [part.kind for part in kernel.parts] == ["int4", "int8"]
    rows = [part.dequantize(torch.float32).shape[0] for part in kernel.parts]
    assert rows == [(HEADS + KV_HEADS) * HEAD_DIM, KV_HEADS * HEAD_DIM]  # q and k joined, then v
    assert not isinstance(layers[1].self_attn.qkv_proj.kernel, StackedKernel)
    weights = [layer.self_attn.qkv_proj.kernel.dequantize(torch.float32) for layer in layers]
    quantized.shutdown()
    plain = LLM(mixed_gguf, dtype="float32", quantization="none", **ENGINE)
    float_layers = plain.engine.model_runner.model.model.layers
    for weight, layer in zip(weights, float_layers, strict=True):
        assert torch.equal(weight, layer.self_attn.qkv_proj.weight.float())
    plain.shutdown()


@pytest.mark.cpu_kernels("avx2")
def test_the_decode_stack_runs_the_two_part_layer_as_the_modules(mixed_gguf, tmp_path, monkeypatch):
    """bf16 where this build's int kernels take it, else float32 (the AVX2 level's int kernels take
    float32): the stack is built over the two-part q/k/v and gives the modules' tokens and
    log-probabilities bit for bit, in its one parallel region (each part's rows split among the
    threads, the parts joined after the barrier)."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    ops = load_cpu_ops()
    dtype = "bfloat16" if ops.small_batch_linear_int8_supported(torch.bfloat16) else "float32"
    if not ops.small_batch_linear_int8_supported(getattr(torch, dtype)):
        pytest.skip("this build's int8/int4 kernels take neither bfloat16 nor float32 inputs")
    stack = _assert_three_decodes_bit_identical(mixed_gguf, dtype=dtype, quantization="gguf")
    assert (stack.one_region_calls > 0) == (torch.get_num_threads() > 1)


@pytest.mark.cpu_kernels("avx2")
def test_a_two_part_layer_with_a_bias_in_the_stack(tmp_path, monkeypatch):
    """A Qwen2 Q4_K_M's two-part q/k/v with its bias: each part's rows get their slice of the bias (the
    tail's from its first row), as the modules add the bias to the joined output."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_q4_k_m(str(tmp_path / "qwen2-q4_k_m.gguf"), arch="qwen2")
    ops = load_cpu_ops()
    dtype = "bfloat16" if ops.small_batch_linear_int8_supported(torch.bfloat16) else "float32"
    llm = LLM(path, dtype=dtype, quantization="gguf", **ENGINE)
    layers = llm.engine.model_runner.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj.kernel, StackedKernel)
    assert layers[0].self_attn.qkv_proj.bias is not None
    llm.shutdown()
    stack = _assert_three_decodes_bit_identical(path, dtype=dtype, quantization="gguf")
    assert (stack.one_region_calls > 0) == (torch.get_num_threads() > 1)


def test_stack_rows_joins_runs_and_cuts_rank_rows_from_each_part():
    """int4 q and k join; the int8 v is a part of its own. A tensor-parallel rank's rows (its q and k
    heads, its v heads: ascending) come from each part; a part with none of them drops out."""
    gen = torch.Generator().manual_seed(0)
    q, k = (quantize_int4(torch.randn(rows, 64, generator=gen), 32) for rows in (8, 4))
    v = quantize_int8(torch.randn(4, 64, generator=gen), 16)
    stacked = stack_rows([q, k, v])
    assert isinstance(stacked, StackedRows) and stacked.shape == (16, 64)
    assert [type(p) for p in stacked.parts] == [Int4Weight, Int8Weight] and stacked.parts[0].shape == (12, 64)
    whole = stacked.dequantize()
    index = torch.tensor([0, 1, 2, 3, 8, 9, 12, 13])  # rank 0 of 2: half of q's, k's and v's rows
    mine = shard_rows(stacked, index, len(index))
    assert torch.equal(mine.dequantize(), whole[index])
    only_q = shard_rows(stacked, torch.tensor([4, 5]), 2)
    assert len(only_q.parts) == 1 and torch.equal(only_q.dequantize(), whole[4:6])
    with pytest.raises(ValueError, match="ascending"):
        stacked.rows(torch.tensor([9, 0]))
    assert not isinstance(stack_rows([q, k]), StackedRows)  # formats that join stay one weight


@pytest.mark.cpu_kernels("avx2")
def test_a_stacked_layer_is_batch_invariant_where_its_parts_are():
    """worker/batch_invariance.py reads `batch_invariant` off a layer's kernel: a stacked layer's is its
    parts' (the compiled kernels' for inputs they take; not where a part rebuilds its float weight)."""
    from llmserve.quantization.kernels import select_kernel

    gen = torch.Generator().manual_seed(1)
    stacked = stack_rows(
        [
            quantize_int4(torch.randn(64, 64, generator=gen), 32),
            quantize_int8(torch.randn(32, 64, generator=gen), 16),
        ]
    )
    ops = load_cpu_ops()
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        kernel = select_kernel(stacked, dtype, torch.device("cpu"))
        assert isinstance(kernel, StackedKernel)
        assert kernel.batch_invariant == ops.small_batch_linear_int8_supported(dtype)
