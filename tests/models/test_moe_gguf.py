"""Mixture-of-experts GGUF files (Mixtral filed as `llama` with experts, `qwen3moe`), written with gguf-py
as llama.cpp's converter lays them out (merged `ffn_*_exps` experts, `ffn_gate_inp` router, Mixtral's
q/k rows permuted): in float they give transformers' logits and greedy tokens; with
`--quantization gguf` the experts keep the file's blocks and give the float run of those blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model_loader import load_arch_config
from llmserve.model_loader.gguf_loader import hf_name
from llmserve.quantization import gguf_native
from llmserve.quantization.formats import Int4Weight, Int8Weight
from llmserve.quantization.moe import QuantizedMoEExperts
from llmserve.worker.memory_report import weights_memory_bytes
from tests.e2e.conftest import hf_greedy, teacher_forced_logits
from tests.models.moe_gguf import CASES, HIDDEN, LAYERS, VOCAB, write_moe_gguf
from tests.quantization.moe_reference import assert_greedy_equal_but_at_near_ties, dequantized_reference
from tests.quantization.test_gguf_native import _random_q4_k_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.cpu_kernels


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))


ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory="8MiB", enforce_eager=True)


def _prompt(seed: int, length: int = 24) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(CASES))
def test_moe_gguf_gives_transformers_logits_and_tokens(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    hf = write_moe_gguf(path, arch)
    config = load_arch_config(str(path))
    assert config.architecture == ("mixtral" if arch == "llama" else "qwen3_moe")
    extra = CASES[arch][2]
    experts = extra.get("num_local_experts") or extra["num_experts"]
    assert (config.num_experts, config.num_experts_per_tok) == (experts, extra["num_experts_per_tok"])
    llm = LLM(str(path), **ENGINE)
    try:
        tokens = _prompt(1)
        with torch.inference_mode():
            expected = hf(torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(teacher_forced_logits(llm, tokens), expected, atol=2e-4, rtol=1e-4)
        prompt = _prompt(2, 9)
        (output,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 16)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("llama", gguf.GGMLQuantizationType.Q8_0), ("qwen3moe", gguf.GGMLQuantizationType.Q4_0)],
)
def test_quantized_moe_gguf_keeps_its_blocks_and_their_float_run(tmp_path, arch, qtype):
    """`--quantization gguf`: every experts layer holds the file's codes (its resident bytes about the
    blocks' bytes), and the logits and greedy tokens equal a float run of the file (which dequantizes
    those blocks), inputs rounded where the kernels round theirs."""
    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    write_moe_gguf(path, arch, qtype)
    quantized, reference = (
        LLM(str(path), quantization="gguf", **ENGINE),
        LLM(str(path), quantization="none", **ENGINE),
    )
    try:
        modules = dict(quantized.engine.model_runner.model.named_modules())
        experts = [m for m in modules.values() if isinstance(m, QuantizedMoEExperts)]
        assert len(experts) == LAYERS
        block_bytes, block_weights = gguf.GGML_QUANT_SIZES[qtype][1], gguf.GGML_QUANT_SIZES[qtype][0]
        for layer in experts:
            units = layer.gate_up[0].out_features // 2
            count = sum(k.out_features * HIDDEN for k in layer.gate_up) + sum(
                k.out_features * units for k in layer.down
            )
            assert weights_memory_bytes(layer) <= 1.15 * count // block_weights * block_bytes
        rounded = dequantized_reference(quantized, reference)
        tokens = _prompt(3)
        ours, expected = teacher_forced_logits(quantized, tokens), teacher_forced_logits(reference, tokens)
        torch.testing.assert_close(ours, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)
        assert_greedy_equal_but_at_near_ties(quantized, reference, [tokens[:9], tokens[4:]], rounded)
    finally:
        quantized.shutdown()
        reference.shutdown()


def test_merged_k_quant_experts_read_natively_per_expert(tmp_path):
    """Q4_K gate/up and Q6_K down experts tensors [E, rows, cols] (a Q4_K_M file's types) read as each
    expert's int4/int8 weight, equal to gguf-py's dequantization of that expert's rows."""
    experts, hidden, units = 3, 256, 512
    rng = np.random.default_rng(4)
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in dict(block_count=1, context_length=64, embedding_length=hidden).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_feed_forward_length(units)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(2)
    written = {}
    for short, (rows, cols) in {
        "gate": (units, hidden),
        "up": (units, hidden),
        "down": (hidden, units),
    }.items():
        if short == "down":
            qtype = gguf.GGMLQuantizationType.Q6_K
            blocks = rng.integers(0, 256, (experts * rows, cols // 256, 210), dtype=np.uint8)
            blocks[..., 208:210] = (
                rng.uniform(1e-4, 2e-3, (experts * rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
            )
        else:
            qtype, blocks = (
                gguf.GGMLQuantizationType.Q4_K,
                _random_q4_k_blocks(rng, experts * rows, cols // 256),
            )
        blocks = blocks.reshape(experts, rows, -1)
        written[f"blk.0.ffn_{short}_exps.weight"] = (qtype, blocks)
        writer.add_tensor(f"blk.0.ffn_{short}_exps.weight", blocks, raw_dtype=qtype)
    writer.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((experts, hidden)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = gguf_native.read_quantized_tensors(str(path), load_arch_config(str(path)))
    for gguf_name, (qtype, blocks) in written.items():
        stacked = hf_name(gguf_name)
        kind = (Int8Weight, 16) if qtype == gguf.GGMLQuantizationType.Q6_K else (Int4Weight, 32)
        for expert in range(experts):
            name = stacked.replace(".experts.", f".experts.{expert}.")
            reference = torch.from_numpy(gguf.quants.dequantize(blocks[expert], qtype))
            assert (type(weights[name]), weights[name].group_size) == kind, name
            assert torch.equal(weights[name].dequantize(), reference), name
