"""Quantized models under tensor and pipeline parallelism, ranks as real processes: the greedy tokens of one
process running the same weights (float32, up to 1e-4 near-ties), the fused decode stack on the
quantized shards (bfloat16), and a split that cuts a quantization group as a one-line CLI error.

test_quantized_shards.py proves each rank's weights exact against the whole model's; here the
engine runs them: the shards' all-reduces, the lm_head's vocabulary blocks, the worker's own
quantization (its tokenizer and whole model for calibration).
"""

from __future__ import annotations

import pytest
import torch

from llmserve.cli.main import main
from llmserve.distributed.shard import ShardLayout
from llmserve.model_loader import load_weights
from llmserve.quantization.formats import quantize_int8
from llmserve.sampling_params import SamplingParams
from tests.distributed.conftest import assert_same_greedy, engine
from tests.helpers import round_inputs_as_the_small_batch_kernels

pytestmark = pytest.mark.process

PROMPTS = [[5, 6, 7, 8] * 6, [100, 200, 300] * 5 + [9], list(range(1000, 1040)), [31, 4159, 2653, 17]]
BF16_TIE = 0.1  # bfloat16 moves this model's logits by a few hundredths between 1 and 2 ranks
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5
)  # near-ties among more than two candidates in bf16


def _assert_same_tokens(reference, outputs) -> None:
    for want, got in zip(reference, outputs, strict=True):
        assert_same_greedy(want, got)


@pytest.mark.parametrize(
    ("method", "parallel"),
    [
        pytest.param("int4", {"tensor_parallel_size": 2}, id="int4-tp2"),
        pytest.param("int8", {"tensor_parallel_size": 2}, id="int8-tp2"),
        pytest.param("checkpoint", {"tensor_parallel_size": 2}, id="checkpoint-tp2"),
        pytest.param("int4", {"pipeline_parallel_size": 2}, id="int4-pp2"),
        pytest.param("int8", {"pipeline_parallel_size": 2}, id="int8-pp2"),
    ],
)
def test_shards_of_one_quantization_decode_like_one_process(
    method, parallel, tiny_llama_dir, gguf_like_checkpoint
):
    """int4 (each rank quantizes its shard; groups of 32 fall on the cuts), int8 (GPTQ: every rank
    calibrates the whole model, the worker with its own tokenizer) and a checkpoint in GGUF's
    formats (cut per rank) hold the very weights of one process, so they decode alike; so do two
    pipeline stages, each holding its layers' part."""
    kwargs = dict(quantization=gguf_like_checkpoint if method == "checkpoint" else method, max_model_len=512)
    with engine(tiny_llama_dir, **kwargs) as llm:
        reference = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with engine(tiny_llama_dir, **parallel, **kwargs) as llm:
        _assert_same_tokens(reference, llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_int8_rtn_shards_decode_like_a_float_model_of_their_weights(tiny_llama_dir):
    """int8-rtn scales each rank's rows: in o_proj and down_proj over the rank's columns only, so
    the reference is one float process whose weights are the ranks' quantized shards put together.
    Where the shards' small-batch kernels round their decode rows (float32 inputs on the AVX2 level;
    the ranks' cuts fall on the 32-column blocks), the reference's layers round theirs the same way."""
    with engine(tiny_llama_dir, tensor_parallel_size=2, quantization="int8-rtn") as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        rank0 = llm.engine.model_runner.model  # every rank takes the same kernels
    with engine(tiny_llama_dir) as llm:
        model = llm.engine.model_runner.model
        if round_inputs_as_the_small_batch_kernels(model, rank0):
            llm.engine.model_runner.decode_stack = None  # the hooks are on the modules
        floats = load_weights(tiny_llama_dir, torch.float32)
        layouts = [ShardLayout.of(model.arch, 2, rank) for rank in range(2)]
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith(("o_proj", "down_proj")):
                    whole = floats[f"{name}.weight"]
                    field = "q_heads" if name.endswith("o_proj") else "intermediate"
                    scale = model.arch.head_dim if field == "q_heads" else 1
                    cuts = [getattr(layout, field) for layout in layouts]
                    parts = [whole[:, cut.start * scale : cut.stop * scale] for cut in cuts]
                    module.weight.copy_(
                        torch.cat([quantize_int8(part).dequantize() for part in parts], dim=1)
                    )
                elif name.endswith(("qkv_proj", "gate_up_proj")):
                    module.weight.copy_(quantize_int8(module.weight).dequantize())
            head = quantize_int8(model.lm_head.weight).dequantize()  # tied: the embedding stays float
            model.lm_head.weight = torch.nn.Parameter(head)
        reference = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _assert_same_tokens(reference, outputs)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_shards_take_the_fused_decode_stack(method, tiny_llama_dir):
    """bfloat16: every rank's int4 or int8 (per channel) layers run in the fused decode stack through
    their small-batch kernels, with the all-reduces inside it. The shards hold one process's weights,
    and decode its tokens up to near-ties of bfloat16's rounding (the ranks sum partial outputs
    rounded to bfloat16)."""
    kwargs = dict(dtype="bfloat16", quantization=method, max_model_len=512)
    with engine(tiny_llama_dir, **kwargs) as llm:
        reference = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    with engine(tiny_llama_dir, tensor_parallel_size=2, **kwargs) as llm:
        outputs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        fused_steps = llm.engine.model_runner.decode_stack.calls
    assert fused_steps >= GREEDY.max_tokens - 1
    assert_same_greedy(reference[0], outputs[0], tolerance=BF16_TIE)


def test_a_split_that_cuts_a_group_is_a_one_line_error(tiny_llama_dir, gguf_like_checkpoint, capsys):
    argv = ["generate", "hi", "--model", tiny_llama_dir, "--kv-cache-memory", "4MiB", "--max-tokens", "2"]
    assert main([*argv, "--tensor-parallel-size", "3", "--quantization", gguf_like_checkpoint]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "rank 0's input columns 0..43 cut its groups of 32 columns" in err
