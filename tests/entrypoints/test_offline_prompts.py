"""The offline API's prompt forms: text, token ids, and vLLM's prompt dicts; anything else is a clear
ValueError before the engine sees it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir, dtype="float32", max_model_len=128, kv_cache_memory="8MiB") as engine:
        yield engine


def _tokens(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_prompt_dicts_give_what_text_and_token_ids_give(llm):
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    plain = _tokens(llm.generate([text, ids], GREEDY, use_tqdm=False))
    assert plain[0] == plain[1]
    dicts = [{"prompt": text}, {"prompt_token_ids": ids}]
    assert _tokens(llm.generate(dicts, GREEDY, use_tqdm=False)) == plain
    assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)) == plain[:1]
    # numpy's and torch's integers are token ids too: one array is one prompt, as one list is
    for one in (np.array(ids), torch.tensor(ids), list(np.array(ids))):
        assert _tokens(llm.generate(one, GREEDY, use_tqdm=False)) == plain[:1]
    assert _tokens(llm.generate([np.array(ids), torch.tensor(ids)], GREEDY, use_tqdm=False)) == plain[:1] * 2


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, "one of the keys prompt, prompt_token_ids"),
        ({"text": "hi"}, "one of the keys prompt, prompt_token_ids"),
        ({"prompt": [1, 2]}, "'prompt' is text"),
        ({"prompt_token_ids": "hi"}, "'prompt_token_ids' is a list of token ids"),
        ([[True, 5]], "integer token ids"),
        ([[1, "a", 3]], "integer token ids"),
        ([[1.5, 2.0]], "integer token ids"),
        (["a good prompt", [1, 2], [[3]]], "integer token ids"),  # the good ones before it are not kept
    ],
)
def test_a_malformed_prompt_is_a_clear_error(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
