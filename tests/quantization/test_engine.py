"""A quantized tiny model through the engine equals a float run of its dequantized weights; CLI errors."""

from __future__ import annotations

import pytest
import torch

from llmserve.cli.main import main
from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.quantization.kernels import QuantizedLinear
from llmserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_llama_dir, round_inputs_as_the_small_batch_kernels

PROMPTS = ["The quick brown fox", "def main():\n    return"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny")))


def _greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    return [list(outputs[str(index)]) for index in range(len(PROMPTS))]


@pytest.mark.parametrize("method", ["int8", "int8-rtn", "int4"])
def test_quantized_engine_matches_float_run_of_its_weights(tiny_dir, method):
    """float32: the swapped modules multiply by their dequantized weights, so a float model of those
    weights gives the same tokens. Where their compiled kernels take float32 inputs (the AVX2
    level) those round every row's input to 8 bits per 32 columns: the float model's layers then
    round theirs the same way. (The bf16 packed kernels are checked against their weights in
    test_formats: their different accumulation order makes a random tiny model's greedy tokens
    drift after a few steps.)"""
    args = dict(model=tiny_dir, dtype="float32", kv_cache_memory="4MiB")
    quantized = LLMEngine(EngineArgs(**args, quantization=method))
    model = quantized.model_runner.model
    swapped = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(swapped) == 2 * 4 + 1  # every decoder linear and the lm_head
    reference = LLMEngine(EngineArgs(**args))
    float_modules = dict(reference.model_runner.model.named_modules())
    with torch.no_grad():
        for name, module in swapped.items():
            if name == "lm_head":  # tied: the embedding keeps its float weights
                float_modules[name].weight = torch.nn.Parameter(module.kernel.dequantize(torch.float32))
            else:
                float_modules[name].weight.copy_(module.kernel.dequantize(torch.float32))
    if round_inputs_as_the_small_batch_kernels(reference.model_runner.model, model):
        reference.model_runner.decode_stack = None  # the hooks are on the modules
    assert _greedy(quantized) == _greedy(reference)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["generate", "hi", "--quantization", "int3"],
            "quantization must be one of int8, int8-rtn, int4, awq, gptq, gguf",
        ),
        (["generate", "hi", "--quantization", "int4", "--quantization-group-size", "48"], "must be one of"),
        (["generate", "hi", "--quantization", "gguf"], "quantization gguf needs a GGUF model"),
        (  # 2 query heads of 16 per rank: o_proj's 32 input columns per rank cut groups of 64
            [
                "generate",
                "hi",
                "--quantization",
                "int4",
                "--quantization-group-size",
                "64",
                "--tensor-parallel-size",
                "2",
            ],
            "quantization_group_size 64 does not divide 32, a tensor-parallel rank's share",
        ),
        (
            ["generate", "hi", "--quantization", "int8", "--max-model-len", "256"],
            "quantization int8 calibrates on windows of 512 tokens: max_model_len must be >= 512, got 256",
        ),
        (["eval", "ppl", "--context", "1"], "--max-tokens and --context must be >= 2"),
        (["quantize", "--quantization", "gguf", "--output", "x"], "--quantization must be one of int8"),
    ],
)
def test_cli_errors_are_one_line(tiny_dir, capsys, argv, message):
    assert main([*argv, "--model", tiny_dir, "--kv-cache-memory", "4MiB"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_saved_checkpoint_reloads_the_same_weights(tiny_dir, tmp_path):
    output = str(tmp_path / "int4")
    assert main(["quantize", "--model", tiny_dir, "--quantization", "int4", "--output", output]) == 0
    args = dict(model=tiny_dir, dtype="float32", kv_cache_memory="4MiB")
    direct, saved = (
        LLMEngine(EngineArgs(**args, quantization="int4")),
        LLMEngine(EngineArgs(**args, quantization=output)),
    )
    assert _greedy(saved) == _greedy(direct)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_output_projection_writes_float32_logits(tiny_dir, method):
    """bf16 model, int8 lm_head: its logits are float32 at any row count, not rounded to bf16."""
    engine = LLMEngine(
        EngineArgs(model=tiny_dir, dtype="bfloat16", kv_cache_memory="4MiB", quantization=method)
    )
    model = engine.model_runner.model
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.float_logits
    reference = model.lm_head.kernel.dequantize(torch.float32)
    for rows in (1, 8, 30):
        hidden = torch.randn(rows, reference.shape[1]).bfloat16()
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        assert not torch.equal(logits, logits.bfloat16().float())  # not bf16 values
        # within the int8 kernel's input rounding of the exact float32 product
        torch.testing.assert_close(logits, hidden.float() @ reference.T, atol=0.05, rtol=0.05)
