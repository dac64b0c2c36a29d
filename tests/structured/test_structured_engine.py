"""Structured outputs through the offline engine on a tiny random model: every output follows its
grammar, with n > 1 and seeds, and recompute preemption (the matcher replays the output) changes no
token; a bad grammar raises at add_request."""

from __future__ import annotations

import re
import threading

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


def test_a_compiling_grammar_holds_only_its_own_request(tiny_model, monkeypatch):
    """The compile runs in a thread: steps go on for the other requests meanwhile, the held request
    can be aborted, and it runs once its grammar is ready."""
    engine = LLM(tiny_model, dtype="float32", kv_cache_memory="64MiB").engine
    compiler, release = engine.grammar_gate.compiler, threading.Event()
    compile_now = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda spec: release.wait(60) and compile_now(spec))
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    held = SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+")
    )
    engine.add_tokenized_request("plain", [1, 2, 3], plain)
    engine.add_tokenized_request("held", [1, 2, 3], held)
    engine.add_tokenized_request("aborted", [1, 2, 3], held)
    for _ in range(4):
        assert [output.request_id for output in engine.step()] == ["plain"]
    assert set(engine.grammar_gate.pending) == {"held", "aborted"}
    assert engine.abort_request("aborted").finished and "aborted" not in engine.grammar_gate.pending
    release.set()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finished) == {"held"} and re.fullmatch("[a-z]+", finished["held"].outputs[0].text)
