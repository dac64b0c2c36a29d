"""Structured outputs through the offline engine on a tiny random model: every output follows its
grammar, with n > 1 and seeds, and recompute preemption (the matcher replays the output) changes no
token; a bad grammar raises at add_request."""

from __future__ import annotations

import re

import pytest

from llmserve import LLM, SamplingParams
from llmserve.structured.params import GrammarError, StructuredOutputsParams
from tests.e2e.conftest import long_text
from tests.helpers import make_tiny_llama_dir

PATTERN = r"[a-z]{3,8}( [a-z]{3,8}){6,9}\."


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("models") / "tiny-llama"))


def params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(regex=PATTERN), **kwargs)


def test_outputs_follow_the_grammar_and_recompute_preemption_changes_no_token(tiny_model):
    roomy = LLM(tiny_model, dtype="float32", kv_cache_memory="64MiB", prefix_caching=False)
    prompts = [roomy.engine.tokenizer.encode(long_text(40 + 30 * i)) for i in range(5)]
    batch = [params(temperature=0.0) if i % 2 else params(temperature=1.0, seed=i, n=2) for i in range(5)]
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, batch, use_tqdm=False)]
    num_blocks = sum(-(-(len(p) + 1) // 16) for p in prompts) + 3  # all admitted; growth won't fit
    tight = LLM(
        tiny_model,
        dtype="float32",
        block_size=16,
        num_kv_blocks=num_blocks,
        prefix_caching=False,
        preemption_mode="recompute",
    )
    outputs = tight.generate(prompts, batch, use_tqdm=False)
    assert tight.engine.scheduler.preemptions_by_mode["recompute"] > 0
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    for output in outputs:
        for choice in output.outputs:
            assert choice.finish_reason == "stop" and re.fullmatch(PATTERN, choice.text), choice.text


def test_a_bad_grammar_raises_at_add_request(tiny_model):
    llm = LLM(tiny_model, dtype="float32", kv_cache_memory="64MiB")
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "a" | b'))
    with pytest.raises(GrammarError, match="not defined"):
        llm.generate(["hi"], bad, use_tqdm=False)
