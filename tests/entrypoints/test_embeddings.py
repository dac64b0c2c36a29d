"""POST /v1/embeddings through the official client: the vector is the last token's final hidden state,
L2-normalized, as transformers computes it in float32 (cosine >= 0.999), on the tiny model and on the
default model; batched inputs equal single ones; every input shape and encoding; dimensions."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
import transformers

from llmserve.model_loader import default_model_path
from tests.entrypoints.conftest import API_KEY, start_server

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "A", "Embeddings pool the last token's state."]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def reference_embeddings(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> np.ndarray:
    """Last-token final hidden state (after the final norm), L2-normalized, float32."""
    rows = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
            rows.append(torch.nn.functional.normalize(hidden.float(), dim=-1).numpy())
    return np.stack(rows)


def vectors(response) -> np.ndarray:
    return np.array(
        [item.embedding for item in sorted(response.data, key=lambda d: d.index)], dtype=np.float64
    )


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_embeddings_match_transformers(client, tiny_model_dir, tokenizer):
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    response = client.embeddings.create(model=MODEL, input=TEXTS)
    got = vectors(response)
    expected = reference_embeddings(model, [tokenizer.encode(text) for text in TEXTS])
    assert got.shape == (len(TEXTS), model.config.hidden_size)
    assert cosines(got, expected).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    tokens = sum(len(tokenizer.encode(text)) for text in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    assert response.model == MODEL and response.object == "list"


def test_batched_inputs_equal_single_ones(client):
    batched = vectors(client.embeddings.create(model=MODEL, input=TEXTS))
    singles = np.concatenate([vectors(client.embeddings.create(model=MODEL, input=text)) for text in TEXTS])
    np.testing.assert_allclose(batched, singles, atol=1e-5)


def test_token_id_inputs_and_base64(client, tokenizer):
    ids = [tokenizer.encode(text) for text in TEXTS[:2]]
    from_text = vectors(client.embeddings.create(model=MODEL, input=TEXTS[:2]))
    from_ids = vectors(client.embeddings.create(model=MODEL, input=ids))
    one = vectors(client.embeddings.create(model=MODEL, input=ids[0]))
    np.testing.assert_allclose(from_ids, from_text, atol=1e-5)
    np.testing.assert_allclose(one[0], from_text[0], atol=1e-5)
    # the client decodes base64 itself: ask through plain HTTP to see the wire format
    encoded = client.embeddings.with_raw_response.create(
        model=MODEL, input=TEXTS[:2], encoding_format="base64"
    ).http_response.json()
    decoded = np.stack(
        [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in encoded["data"]]
    )
    np.testing.assert_allclose(decoded, from_text, atol=1e-6)


def test_dimensions_and_bad_inputs(client, server):
    size = len(client.embeddings.create(model=MODEL, input="x").data[0].embedding)
    assert len(client.embeddings.create(model=MODEL, input="x", dimensions=size).data[0].embedding) == size
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL, input="x", dimensions=size // 2)
    assert error.value.body["param"] == "dimensions" and "not supported" in error.value.body["message"]
    with server.http() as http:
        for body, param in [
            ({"input": []}, "input"),
            ({"input": ""}, "input"),
            ({"input": [10**7]}, "input"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ]:
            response = http.post("/v1/embeddings", json={"model": MODEL, **body})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
        # generation still works after the embeddings: nothing was left in the engine
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200


@pytest.mark.slow
def test_default_model_embeddings_match_transformers(tmp_path, hf_model_fp32):
    from llmserve.model_loader import load_tokenizer

    path = default_model_path()
    args = [
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "64MiB",
        "--dtype",
        "float32",
        "--quantization",
        "none",
    ]
    server = start_server(args, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        got = vectors(client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS))
        tokenizer = load_tokenizer(path)
        expected = reference_embeddings(hf_model_fp32, [tokenizer.encode(text) for text in TEXTS])
        assert cosines(got, expected).min() >= 0.999
    finally:
        server.stop()
