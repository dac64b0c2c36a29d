"""Shared fixtures for end-to-end tests on the real default model (float32 unless stated)."""

import os

import pytest
import torch

from llmserve.model_loader import default_model_path

PROMPT_TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three prime numbers greater than one hundred:",
]


def long_text(num_words: int) -> str:
    """Deterministic prose from the Python documentation shipped with the interpreter's stdlib."""
    import inspect
    import json

    words = " ".join(inspect.getdoc(m) or "" for m in (json, os, inspect, pytest)).split()
    return " ".join((words * (num_words // max(len(words), 1) + 1))[:num_words])


@pytest.fixture(scope="session")
def prompts_5_to_600(default_tokenizer) -> list[list[int]]:
    """Eight prompts from 5 to about 600 tokens."""
    texts = PROMPT_TEXTS + [long_text(n) for n in (40, 120, 250, 450)]
    ids = [default_tokenizer.encode(t) for t in texts]
    ids[-1] = ids[-1][:600]
    return ids


@pytest.fixture(scope="session")
def default_tokenizer():
    from llmserve.model_loader import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def llm_fp32():
    from llmserve import LLM

    return LLM(dtype="float32", quantization="none", kv_cache_memory="512MiB")


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            pad_token_id=2,
        )
    return out[0, len(prompt_ids) :].tolist()


def teacher_forced_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """The float32 logits the engine computes at every position of `token_ids` in one prefill (the
    model runner's final hidden states, the prompt's rows in order, through the output projection)."""
    from llmserve import SamplingParams

    runner = llm.engine.model_runner
    with runner.capture_hidden_states() as hidden:
        llm.generate([token_ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    with torch.inference_mode():
        return runner.model.compute_logits(torch.cat(hidden)[: len(token_ids)])
