"""Tiny random Llama and Qwen2 checkpoints whose heads split unevenly (6 query / 3 KV heads), a
quantized checkpoint in GGUF's formats, and a tensor-parallel engine that is always shut down (a
process serves one tensor-parallel group at a time)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.config import EngineArgs
from llmserve.model_loader import default_model_path, load_arch_config, load_tokenizer, load_weights
from llmserve.models.registry import build_model
from llmserve.outputs import RequestOutput
from llmserve.quantization import checkpoint
from llmserve.quantization.formats import quantize_int4, quantize_int8
from llmserve.quantization.methods import decoder_linears
from tests.helpers import TINY_LLAMA_CONFIG, make_tiny_llama_dir

# 6 query heads over 3 KV heads: 2 ranks hold 4 + 2 query and 2 + 1 KV heads; 128 MLP units: 43/43/42
UNEVEN_HEADS = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
ENGINE_KWARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory="8MiB")
# A bias confining the output to four tokens: it repeats itself, so prompt lookup finds drafts.
REPEATING = SamplingParams(
    temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, logit_bias={t: 100.0 for t in (5, 6, 7, 8)}
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tp-llama")), **UNEVEN_HEADS)


@pytest.fixture(scope="session")
def gguf_like_checkpoint(tiny_llama_dir, tmp_path_factory) -> str:
    """A quantized checkpoint of `tiny_llama_dir` in GGUF's formats: int4 groups of 32 in the decoder
    layers (as Q4_0/Q4_1), int8 groups of 32 in the lm_head (as Q8_0)."""
    config = EngineArgs(model=tiny_llama_dir, dtype="float32", kv_cache_memory="4MiB")
    model = build_model(
        config.create_config(load_arch_config(tiny_llama_dir), tiny_llama_dir).model,
        load_weights(tiny_llama_dir, torch.float32),
    )
    weights = {name: quantize_int4(linear.weight, 32) for name, linear in decoder_linears(model).items()}
    weights["lm_head"] = quantize_int8(model.lm_head.weight, 32)
    info = {"method": "int4", "source": tiny_llama_dir, "source_id": checkpoint.source_id(tiny_llama_dir)}
    path = str(tmp_path_factory.mktemp("gguf-like"))
    checkpoint.save_quantized(path, weights, info)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """Qwen2 with q/k/v biases (drawn nonzero: HF starts them at zero) and an untied lm_head."""
    path = str(tmp_path_factory.mktemp("tp-qwen2"))
    torch.manual_seed(1)
    config = transformers.Qwen2Config(**{**TINY_LLAMA_CONFIG, **UNEVEN_HEADS, "tie_word_embeddings": False})
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif param.dim() > 1:
                param.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)
    return path


@contextlib.contextmanager
def engine(model_dir: str | None, **kwargs) -> Iterator[LLM]:
    llm = LLM(model_dir, **{**ENGINE_KWARGS, **kwargs})
    try:
        yield llm
    finally:
        llm.shutdown()


def assert_same_greedy(reference: RequestOutput, got: RequestOutput, tolerance: float = 1e-4) -> None:
    """Equal tokens, or equal up to a step where the reference's two candidates were within
    `tolerance` of each other (summing in another order may flip such a near-tie); the reference
    ran with logprobs >= 2 so each step's top two are at hand."""
    want, have = reference.outputs[0], got.outputs[0]
    for step, (a, b) in enumerate(zip(want.token_ids, have.token_ids, strict=True)):
        if a != b:
            candidates = want.logprobs[step]
            assert b in candidates, f"step {step}: {b} was not even in the reference's top two"
            gap = candidates[a] - candidates[b]
            assert gap < tolerance, f"step {step}: tokens {a} vs {b} with a logit gap of {gap:.2e}"
            return
