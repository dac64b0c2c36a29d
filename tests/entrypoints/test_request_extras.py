"""Request fields beyond the basics, through the official client against a real server: prompt logprobs
(vLLM's field and echo with logprobs) against transformers in float32, best_of, stop_token_ids,
include_stop_str_in_output, suffix."""

from __future__ import annotations

import math

import openai
import pytest
import torch
import transformers

from llmserve.entrypoints.openai.fim import fim_prompt, fim_token_ids
from tests.entrypoints.conftest import API_KEY

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids) -> torch.Tensor:
    """transformers' float32 log-softmax after each prompt token."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt_ids])).logits[0].log_softmax(-1)


def greedy_ids(hf_model, prompt_ids: list[int], count: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def test_prompt_logprobs_match_transformers(client, prompt_ids, reference):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0, extra_body={"prompt_logprobs": 2}
    )
    entries = response.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for position, (token, entry) in enumerate(zip(prompt_ids[1:], entries[1:], strict=True)):
        row = reference[position]
        assert math.isclose(entry[str(token)]["logprob"], float(row[token]), abs_tol=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(2)
        for rank, (top_id, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True)):
            assert entry[str(top_id)]["rank"] == rank + 1
            assert math.isclose(entry[str(top_id)]["logprob"], value, abs_tol=1e-4)
        assert len(entry) in (2, 3)  # the top 2, and the real token when it is not among them


def test_chat_prompt_logprobs_and_not_streamed(client, server):
    messages = [{"role": "user", "content": "hi"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    tokens = server.http().post("/tokenize", json={"messages": messages}).json()["tokens"]
    entries = response.model_extra["prompt_logprobs"]
    assert len(entries) == len(tokens) and entries[0] is None
    assert all(str(token) in entry for token, entry in zip(tokens[1:], entries[1:], strict=True))
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert error.value.body["param"] == "prompt_logprobs"


def test_echo_with_logprobs_reports_the_prompt_first(client, prompt_ids, reference):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True, logprobs=1)
    response = client.completions.create(**kwargs, extra_body=NO_EOS)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(logprobs.tokens) == len(prompt_ids) + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position, token in enumerate(prompt_ids[1:]):
        expected = float(reference[position, token])
        assert math.isclose(logprobs.token_logprobs[position + 1], expected, abs_tol=1e-4)
    assert all(value is not None for value in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    # streamed: the same text and the same tokens
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    streamed = [token for piece in pieces for token in piece.tokens]
    assert streamed == logprobs.tokens
    assert [offset for piece in pieces for offset in piece.text_offset] == logprobs.text_offset


def test_best_of_returns_the_likeliest_candidate(client):
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7)
    candidates = client.completions.create(**common, n=4, logprobs=0, extra_body=NO_EOS)
    scores = [sum(c.logprobs.token_logprobs) for c in candidates.choices]
    assert len(set(scores)) == 4  # distinct candidates: the choice among them is not vacuous
    best = client.completions.create(**common, best_of=4, extra_body=NO_EOS)
    (choice,) = best.choices
    assert choice.index == 0 and choice.logprobs is None
    assert choice.text == candidates.choices[scores.index(max(scores))].text
    assert best.usage.completion_tokens == 4 * 5  # every candidate counts
    two = client.completions.create(**common, n=2, best_of=4, extra_body=NO_EOS)
    ranked = sorted(range(4), key=lambda i: scores[i], reverse=True)
    assert [c.text for c in two.choices] == [candidates.choices[i].text for i in ranked[:2]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of")],
    ids=["below-n", "streamed"],
)
def test_best_of_refusals(server, extra, param):
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_stop_token_ids_end_the_completion(client, hf_model, prompt_ids):
    greedy = greedy_ids(hf_model, prompt_ids, 8)
    index = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])
    response = client.completions.create(
        model=MODEL,
        prompt=prompt_ids,
        max_tokens=8,
        temperature=0.0,
        extra_body={"stop_token_ids": [greedy[index]], **NO_EOS},
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == index + 1
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="x", extra_body={"stop_token_ids": [10**6]})
    assert error.value.body["param"] == "stop_token_ids"


def test_include_stop_str_in_output(client):
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0)
    text = client.completions.create(**common, extra_body=NO_EOS).choices[0].text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip())
    cut = text.index(stop)
    without = client.completions.create(**common, stop=[stop], extra_body=NO_EOS).choices[0]
    kept = client.completions.create(
        **common, stop=[stop], extra_body={"include_stop_str_in_output": True, **NO_EOS}
    ).choices[0]
    assert without.text == text[:cut] and without.finish_reason == "stop"
    assert kept.text == text[: cut + len(stop)] and kept.finish_reason == "stop"


def test_suffix_without_fill_in_the_middle_tokens_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="def f(", suffix="    return x\n")
    assert error.value.body["param"] == "suffix"
    assert "fill-in-the-middle" in error.value.body["message"]
    # an empty suffix asks for nothing
    assert client.completions.create(model=MODEL, prompt="def f(", suffix="", max_tokens=2).choices


def test_fim_prompt_uses_the_vocabulary_tokens():
    vocab = {"a": 0, "<fim_prefix>": 7, "<fim_middle>": 9, "<fim_suffix>": 8}
    tokens = fim_token_ids(vocab)
    assert tokens == (7, 8, 9)
    assert fim_prompt(tokens, [1, 2], [3]) == [7, 1, 2, 8, 3, 9]
    assert fim_token_ids({"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3}) == (1, 2, 3)
    assert fim_token_ids({"<fim_prefix>": 1, "<fim_suffix>": 2}) is None
