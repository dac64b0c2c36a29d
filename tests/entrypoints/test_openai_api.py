"""The OpenAI-compatible API through the official client: shapes, streaming, n, stop, seeds, logprobs."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN

pytestmark = pytest.mark.server

MODEL = "tiny-llama"  # the served name defaults to the model directory's name
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
NO_EOS = {"ignore_eos": True}  # a random model may sample EOS; fixed lengths make counts exact


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def stream_completion(client: openai.OpenAI, **kwargs) -> tuple[dict[int, str], dict[int, list[str]], list]:
    """Joined text and finish reasons per choice index, plus the raw chunks."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, chunks


def stream_chat(client: openai.OpenAI, **kwargs) -> tuple[dict[int, str], dict[int, list[str]], list]:
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, chunks


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_shape_and_exact_usage(client, tokenizer):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, extra_body=NO_EOS)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    (choice,) = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and isinstance(choice.text, str)
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6


def test_completion_stream_joins_to_the_same_text(client):
    kwargs = dict(prompt=PROMPT, max_tokens=12, temperature=0.8, seed=7, extra_body=NO_EOS)
    plain = client.completions.create(model=MODEL, **kwargs)
    texts, finishes, chunks = stream_completion(client, stream_options={"include_usage": True}, **kwargs)
    assert texts == {0: plain.choices[0].text}
    assert finishes == {0: ["length"]}
    *body, last = chunks
    assert last.choices == [] and last.usage == plain.usage
    assert all(chunk.usage is None for chunk in body)
    assert all(c.text for chunk in body for c in chunk.choices if c.finish_reason is None)


def test_same_seed_same_text_and_different_seed_differs(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, extra_body=NO_EOS
            )
            .choices[0]
            .text
        )

    assert sample(1) == sample(1)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_completion_n_and_a_list_of_prompts(client, tokenizer):
    prompts = [PROMPT, "Once upon a time"]
    response = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0.0, extra_body=NO_EOS
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == 4 * 4
    alone = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=4, temperature=0.0, extra_body=NO_EOS
    )
    by_index = {c.index: c.text for c in response.choices}
    assert by_index[2] == by_index[3] == alone.choices[0].text  # greedy samples of prompt 1


def test_streamed_n_gives_each_choice_one_finish(client):
    kwargs = dict(prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=11, extra_body=NO_EOS)
    plain = client.completions.create(model=MODEL, **kwargs)
    texts, finishes, _ = stream_completion(client, **kwargs)
    assert texts == {c.index: c.text for c in plain.choices}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}


def test_token_id_prompts(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    as_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0)
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0.0)
    as_batch = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5, temperature=0.0)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert [c.text for c in as_batch.choices] == [as_text.choices[0].text] * 2


def test_stop_string_cuts_the_text(client):
    full = (
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, extra_body=NO_EOS
        )
        .choices[0]
        .text
    )
    stop = next((full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].strip()), None)
    assert stop is not None, f"no two-character stop string in {full!r}"  # the seeded model's text
    kwargs = dict(prompt=PROMPT, max_tokens=24, temperature=0.0, extra_body=NO_EOS)
    cut = client.completions.create(model=MODEL, stop=[stop], **kwargs)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    texts, finishes, _ = stream_completion(client, stop=stop, **kwargs)
    assert texts == {0: cut.choices[0].text} and finishes == {0: ["stop"]}


def test_echo_prepends_the_prompt(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert response.choices[0].text == PROMPT + plain.choices[0].text
    texts, _, _ = stream_completion(client, prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True)
    assert texts == {0: response.choices[0].text}


def test_completion_logprobs_shape(client):
    kwargs = dict(prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3, extra_body=NO_EOS)
    response = client.completions.create(model=MODEL, **kwargs)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert len(logprobs.text_offset) == 6 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[0] == 0
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0.0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the sampled token is the best
        assert top[token] == pytest.approx(logprob)
    _, _, chunks = stream_completion(client, **kwargs)
    streamed = [
        lp for chunk in chunks for c in chunk.choices if c.logprobs for lp in c.logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(logprobs.token_logprobs)


def test_chat_shape_usage_and_stream(client, server):
    kwargs = dict(messages=MESSAGES, max_tokens=8, temperature=0.7, seed=3, extra_body=NO_EOS)
    response = client.chat.completions.create(model=MODEL, **kwargs)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    with server.http() as http:
        counted = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert response.usage.prompt_tokens == counted
    assert response.usage.completion_tokens == 8
    texts, finishes, chunks = stream_chat(client, stream_options={"include_usage": True}, **kwargs)
    assert texts == {0: choice.message.content} and finishes == {0: ["length"]}
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert chunks[-1].choices == []
    # Not `== response.usage`: the stream may reuse the first request's prompt blocks (cached_tokens).
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (counted, 8)


def test_chat_content_parts_and_max_completion_tokens(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi."}]}]
    joined = [{"role": "user", "content": "Say\nhi."}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=5, temperature=0.0)
    b = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=5, temperature=0.0)
    assert a.choices[0].message.content == b.choices[0].message.content
    # The same prompt tokens; b may find a's blocks in the prefix cache, so cached_tokens can differ.
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.usage.completion_tokens == b.usage.completion_tokens


def test_chat_n_streamed(client):
    kwargs = dict(messages=MESSAGES, n=2, max_tokens=6, temperature=1.0, seed=5, extra_body=NO_EOS)
    plain = client.chat.completions.create(model=MODEL, **kwargs)
    texts, finishes, _ = stream_chat(client, **kwargs)
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert finishes == {0: ["length"], 1: ["length"]}
    assert plain.usage.completion_tokens == 12


def test_chat_logprobs_shape(client):
    kwargs = dict(
        messages=MESSAGES, max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=2, extra_body=NO_EOS
    )
    response = client.chat.completions.create(model=MODEL, **kwargs)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0.0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    _, _, chunks = stream_chat(client, **kwargs)
    streamed = [
        e.logprob for chunk in chunks for c in chunk.choices if c.logprobs for e in c.logprobs.content
    ]
    assert streamed == pytest.approx([e.logprob for e in content])
    no_logprobs = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert no_logprobs.choices[0].logprobs is None


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    with server.http() as http:
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens == {
            "count": len(tokens["tokens"]),
            "max_model_len": MAX_MODEL_LEN,
            "tokens": tokenizer.encode(PROMPT),
        }
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPT}


def test_32_concurrent_streams_match_one_by_one(client, server):
    prompts = [f"Request number {i} says" for i in range(32)]
    kwargs = dict(max_tokens=6, temperature=0.0, extra_body=NO_EOS)
    alone = [client.completions.create(model=MODEL, prompt=p, **kwargs).choices[0].text for p in prompts]

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0
        ) as aclient:

            async def one(prompt: str) -> str:
                stream = await aclient.completions.create(model=MODEL, prompt=prompt, stream=True, **kwargs)
                return "".join([c.text async for chunk in stream for c in chunk.choices])

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run_all()) == alone


def test_logit_bias_bans_and_forces_tokens(client, tokenizer):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=1, extra_body=NO_EOS)
    plain = client.completions.create(**kwargs)
    first = tokenizer.encode(plain.choices[0].logprobs.tokens[0])[0]
    banned = client.completions.create(logit_bias={str(first): -100}, **kwargs)
    assert tokenizer.encode(banned.choices[0].logprobs.tokens[0])[0] != first
    forced = tokenizer.encode(" fox")[0]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0.0, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == " fox" * 3
    with pytest.raises(openai.BadRequestError) as error:  # past the vocabulary
        client.completions.create(logit_bias={"10000000": 1}, **kwargs)
    assert error.value.body["param"] == "logit_bias"
    for key in ("²", "٣", "x", "-1"):  # only ASCII digits name a token
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(logit_bias={key: 1}, **kwargs)
        assert error.value.body["param"] == "logit_bias"
