"""LoRA adapters through `llmserve serve`: /v1/models lists them under their base, a request names
one in `model`, an unknown name is a 404 with an OpenAI-style body, and adapters load and unload
while the server runs (behind the API key)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, start_server, tiny_server_args
from tests.lora.adapters import make_model_dirs

pytestmark = pytest.mark.server

BASE = "tiny-base"
AT_START = ("qv", "all")  # --lora-modules; "mlp" is loaded at run time
LONG = 200  # tokens: completions still running while an adapter loads


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    dirs = make_model_dirs(tmp_path_factory.mktemp("lora"))
    modules = [f"{name}={dirs[name]}" for name in AT_START]
    args = tiny_server_args(dirs["base"], "--served-model-name", BASE, "--enable-lora", "--max-loras", "2")
    log = tmp_path_factory.mktemp("server") / "server.log"
    process = start_server([*args, "--lora-modules", *modules], log, api_key=API_KEY)
    yield process, dirs
    process.stop()


def _complete(http, model: str, max_tokens: int = 8) -> str:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model  # an adapter's name, as vLLM reports it
    return response.json()["choices"][0]["text"]


def test_models_lists_adapters_with_their_base_as_parent(server):
    process, dirs = server
    with process.http() as http:
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert set(cards) == {BASE, *AT_START}
    assert cards[BASE]["parent"] is None
    for name in AT_START:
        assert cards[name]["parent"] == BASE and cards[name]["root"] == dirs[name]


def test_a_request_runs_under_the_adapter_it_names(server):
    process, _ = server
    with process.http() as http:
        texts = {name: _complete(http, name) for name in (BASE, *AT_START)}
        assert _complete(http, "qv") == texts["qv"]  # greedy: the same adapter, the same text
    assert len(set(texts.values())) == len(texts)  # every adapter changes the base model's text


def test_unknown_model_is_an_openai_404(server):
    process, _ = server
    with process.http() as http:
        body = {"model": "nope", "prompt": "hi", "max_tokens": 2}
        response = http.post("/v1/completions", json=body)
        embedding = http.post("/v1/embeddings", json={"model": "qv", "input": "hi"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "'qv'" in error["message"]
    assert embedding.status_code == 404  # embeddings run the base model only


def test_load_and_unload_while_serving(server):
    process, dirs = server
    with process.http() as http:
        before = {name: _complete(http, name) for name in (BASE, *AT_START)}
        keys = http.get("/server_info").json()["lora_cache_keys"]  # for a router (docs/lora.md)
        assert set(keys) == set(AT_START) and len(set(keys.values())) == len(AT_START)
        assert http.post("/v1/completions", json={"model": "mlp", "prompt": "hi"}).status_code == 404
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": dirs["mlp"]})
        assert response.status_code == 200, response.text
        assert "mlp" in {card["id"] for card in http.get("/v1/models").json()["data"]}
        loaded = http.get("/server_info").json()["lora_cache_keys"]
        assert loaded.keys() == {*AT_START, "mlp"} and loaded["mlp"] not in keys.values()
        text = _complete(http, "mlp")
        assert text not in before.values()
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": dirs["mlp"]})
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": dirs["base"]})
        assert bad.status_code == 400 and "not a PEFT adapter directory" in bad.json()["error"]["message"]

        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
        assert http.get("/server_info").json()["lora_cache_keys"] == keys
        assert http.post("/v1/completions", json={"model": "mlp", "prompt": "hi"}).status_code == 404
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert {name: _complete(http, name) for name in (BASE, *AT_START)} == before
    body = {"lora_name": "x", "lora_path": "/"}
    unauthorized = httpx.post(f"{process.base_url}/v1/load_lora_adapter", json=body)
    assert unauthorized.status_code == 401


def test_metrics_count_requests_by_adapter(server):
    process, _ = server
    with process.http() as http:
        _complete(http, "qv")
        text = http.get("/metrics").text
    lines = text.splitlines()
    for name in AT_START:
        for kind in ("running", "waiting"):
            series = [line for line in lines if line.startswith(f"llmserve:lora_requests_{kind}{{")]
            assert any(f'lora_name="{name}"' in line and line.endswith(" 0.0") for line in series), series
    generated = [line for line in lines if line.startswith("llmserve:lora_generation_tokens_total{")]
    assert any('lora_name="qv"' in line and float(line.split()[-1]) > 0 for line in generated), generated
    first = [line for line in lines if line.startswith("llmserve:lora_time_to_first_token_seconds_count{")]
    assert any('lora_name="qv"' in line and float(line.split()[-1]) >= 1 for line in first), first
    (info,) = [line for line in lines if line.startswith("vllm:lora_requests_info{")]  # nothing queued
    assert 'running_lora_adapters=""' in info and 'waiting_lora_adapters=""' in info and "max_lora=" in info


def test_loading_while_requests_run_fails_none_and_mixes_no_adapters(server):
    """Completions under every adapter run while another adapter loads and unloads: each answers
    as it does alone (greedy), none fails."""
    process, dirs = server
    names = (BASE, *AT_START)
    with process.http() as http:
        alone = {name: _complete(http, name, LONG) for name in names}
        with ThreadPoolExecutor(max_workers=6) as pool:
            running = [pool.submit(_complete_fresh, process, names[i % len(names)]) for i in range(12)]
            body = {"lora_name": "mlp", "lora_path": dirs["mlp"]}
            assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
            results = [future.result() for future in running]
    for i, text in enumerate(results):
        assert text == alone[names[i % len(names)]], i


def _complete_fresh(process, model: str) -> str:
    with process.http() as http:
        return _complete(http, model, LONG)
