"""GGUF Q5_0 layers held as 5-bit codes (the int4 kernels' nibbles plus a plane of fifth bits) through
the engine: a tiny Llama written with Q5_0 projections gives the greedy tokens of the same file served
in float (`--quantization none`, inputs rounded where the kernels round theirs), the fused decode
stack takes its 5-bit layers bit for bit, and a Q5_0 shard fused beside a Q8_0 one joins it as int8."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM
from llmserve.quantization import checkpoint
from llmserve.quantization.formats import Int4Weight, Int8Weight, concat_rows
from llmserve.quantization.kernels import QuantizedLinear, RoundedInputKernel
from llmserve.worker.memory_report import weights_memory_bytes
from tests.quantization.moe_reference import (
    assert_greedy_equal_but_at_near_ties,
    dequantized_reference,
    greedy,
)
from tests.quantization.test_quantized_embedding import VOCAB, Q, write_tied_gguf

pytestmark = pytest.mark.cpu_kernels
ENGINE = dict(max_model_len=128, kv_cache_memory="8MiB", enforce_eager=True)
V_IN_Q8_0 = {"blk.0.attn_v.weight": Q.Q8_0}  # as a Q4_K_M file has some: layer 0's q/k/v fuse as int8


@pytest.fixture
def q5_0_file(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "q5_0.gguf")
    write_tied_gguf(path, Q.Q8_0, Q.Q5_0, V_IN_Q8_0)
    return path


def _prompts() -> list[list[int]]:
    tokens = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    return [tokens[:9], tokens[5:]]


def test_q5_0_layers_give_the_float_runs_tokens(q5_0_file):
    """float32 (the AVX2 level's kernels take it, rounding the inputs; elsewhere the layers multiply
    by the float weight rebuilt from the packed copy): each 5-bit layer holds 5 bits a weight plus
    its float16 scale and offset per 32, and multiplies by the very weights the float run loads."""
    quantized = LLM(q5_0_file, quantization="gguf", dtype="float32", **ENGINE)
    reference = LLM(q5_0_file, quantization="none", dtype="float32", **ENGINE)
    try:
        modules = dict(quantized.engine.model_runner.model.named_modules())
        float_modules = dict(reference.engine.model_runner.model.named_modules())
        five_bit = [n for n, m in modules.items() if isinstance(m, QuantizedLinear) and m.kernel.bits == 5]
        assert sorted(five_bit) == sorted(
            [
                f"model.layers.{i}.{name}"
                for i in (0, 1)
                for name in ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
            ]
            + ["model.layers.1.self_attn.qkv_proj"]
        )
        assert modules["model.layers.0.self_attn.qkv_proj"].kernel.kind == "int8"  # beside Q8_0 v
        for name in five_bit:
            kernel = modules[name].kernel
            assert isinstance(kernel, RoundedInputKernel)
            rows, cols = modules[name].out_features, modules[name].in_features
            packed_rows = -(-rows // 32) * 32
            assert (
                weights_memory_bytes(modules[name])
                == packed_rows * cols * 5 // 8 + packed_rows * cols // 32 * 4
            )
            assert torch.equal(kernel.dequantize(torch.float32), float_modules[name].weight)
        rounded = dequantized_reference(quantized, reference)
        if rounded:
            reference.engine.model_runner.decode_stack = None  # the rounding hooks are on the modules
        assert_greedy_equal_but_at_near_ties(quantized, reference, _prompts(), rounded)
    finally:
        quantized.shutdown()
        reference.shutdown()


def test_the_fused_decode_stack_runs_5_bit_layers_bit_identically(q5_0_file):
    """bf16 (the kernels' dtype at every level): the decode stack is built over the 5-bit layers and
    gives the module path's greedy tokens."""
    llm = LLM(q5_0_file, quantization="gguf", dtype="bfloat16", **ENGINE)
    try:
        runner = llm.engine.model_runner
        stack = runner.decode_stack
        assert stack is not None
        fused = greedy(llm, _prompts())
        assert stack.calls > 0
        runner.decode_stack = None
        assert greedy(llm, _prompts()) == fused
    finally:
        llm.shutdown()


def test_5_bit_shards_fuse_beside_int8_ones_as_int8_and_not_beside_int4_ones():
    gen = torch.Generator().manual_seed(0)
    scales = torch.rand(4, 2, generator=gen).half().float()
    five = Int4Weight(
        torch.randint(0, 32, (4, 64), generator=gen, dtype=torch.uint8), scales, -16 * scales, 32, 5
    )
    eight = Int8Weight(torch.randint(-127, 128, (4, 64), generator=gen, dtype=torch.int8), scales, 32)
    fused = concat_rows([five, five, eight])
    assert isinstance(fused, Int8Weight)
    assert torch.equal(
        fused.dequantize(), torch.cat([five.dequantize(), five.dequantize(), eight.dequantize()])
    )
    both = concat_rows([five, five])
    assert isinstance(both, Int4Weight) and both.bits == 5 and both.shape == (8, 64)
    four = Int4Weight(five.qweight & 15, scales, -8 * scales, 32)
    assert concat_rows([five, four]) is None
    assert Int4Weight(five.qweight, scales, -15 * scales, 32, 5).as_int8() is None  # not Q5_0's offsets


def test_the_weights_cache_keeps_5_bit_codes(tmp_path):
    """A GGUF's layers are cached in the checkpoint format: a 5-bit weight comes back 5-bit."""
    scales = torch.rand(4, 2, generator=torch.Generator().manual_seed(1)).half().float()
    five = Int4Weight(torch.arange(256, dtype=torch.uint8).view(4, 64) % 32, scales, -16 * scales, 32, 5)
    four = Int4Weight(five.qweight & 15, scales.clone(), -8 * scales, 32)  # safetensors: no shared storage
    checkpoint.save_quantized(str(tmp_path), {"five": five, "four": four}, {"method": "test"})
    weights, _, _ = checkpoint.load_quantized(str(tmp_path))
    assert (weights["five"].bits, weights["four"].bits) == (5, 4)
    assert torch.equal(weights["five"].dequantize(), five.dequantize())
    assert torch.equal(weights["four"].dequantize(), four.dequantize())


def test_a_q5_0_output_projection_runs_as_the_int8_codes_it_equals(tmp_path, monkeypatch):
    """int8 has the float32-logits kernel (4/5-bit heads would rebuild their weight each step in bf16):
    a Q5_0 token_embd (tied) becomes int8 codes q - 16, exactly the file's rows."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "q5_0-head.gguf")
    write_tied_gguf(path, Q.Q5_0, Q.Q8_0)
    quantized = LLM(path, quantization="gguf", dtype="bfloat16", **ENGINE)
    reference = LLM(path, quantization="none", dtype="float32", **ENGINE)
    try:
        head = quantized.engine.model_runner.model.lm_head
        assert head.kernel.kind == "int8" and head.kernel.group_size == 32
        table = reference.engine.model_runner.model.model.embed_tokens.weight
        assert torch.equal(head.kernel.dequantize(torch.float32), table)
    finally:
        quantized.shutdown()
        reference.shutdown()
