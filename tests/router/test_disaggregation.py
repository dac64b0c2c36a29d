"""Prefill/decode disaggregation through `llmserve router` on the tiny model: a prefill instance
(kv_producer) and a decode instance (kv_consumer) sharing a folder; a streamed completion through the
router has one engine's greedy text and the decode instance reports the prompt's full blocks as cached;
a prefill instance that hangs (past --prefill-timeout) and then dies costs only a cold prefill on the
decode instance, never a hung or failed request."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import httpx
import pytest

from tests.entrypoints.conftest import free_port, start_server, tiny_server_args
from tests.helpers import wait_until
from tests.router.conftest import BLOCK_SIZE, router_command, scrape

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
MAX_TOKENS = 5
PREFILL_TIMEOUT = 15  # seconds: a loaded machine still prefills a tiny prompt well within it


def transfer_args(role: str, shared_dir, *extra: str) -> list[str]:
    config = {"kv_connector": "LlmserveConnector", "kv_role": role}
    config["kv_connector_extra_config"] = {"shared_dir": str(shared_dir)}
    return ["--block-size", str(BLOCK_SIZE), "--kv-transfer-config", json.dumps(config), *extra]


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    logs, shared = tmp_path_factory.mktemp("pd"), tmp_path_factory.mktemp("shared")
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    decode_args = transfer_args("kv_consumer", shared, "--kv-events-config", json.dumps(events))
    decode = start_server(tiny_server_args(tiny_model_dir, *decode_args), logs / "decode.log")
    prefill = start_server(
        tiny_server_args(tiny_model_dir, *transfer_args("kv_producer", shared)), logs / "p.log"
    )
    port = free_port()
    command = router_command([decode.base_url], tiny_model_dir, port)
    command += ["--prefill-replica", prefill.base_url, "--prefill-timeout", str(PREFILL_TIMEOUT)]
    with open(logs / "router.log", "wb") as log:
        router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert router.poll() is None, (logs / "router.log").read_text()
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, 120, "the router's /health")
        yield url, prefill, decode, logs / "router.log"
    finally:
        router.terminate()
        router.wait(timeout=30)
        for server in (prefill, decode):
            if server.proc.poll() is None:
                os.kill(server.proc.pid, signal.SIGCONT)  # a stopped process takes no SIGTERM
            server.stop()


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(3 * BLOCK_SIZE + 5)]


def one_engine_text(model_dir: str, prompts: list[list[int]]) -> list[str]:
    from llmserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def streamed(url: str, tokens: list[int]) -> tuple[str, dict]:
    """The streamed completion's text and its usage (the last chunk's)."""
    body = {"model": MODEL, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            text += "".join(choice["text"] for choice in chunk["choices"])
            usage = chunk.get("usage") or usage
    return text, usage


def test_disaggregated_stream_has_one_engines_text_and_the_prompts_blocks_are_cached_hits(
    pair, tiny_model_dir
):
    url, _, _, _ = pair
    prompts = [prompt(0), prompt(1)]
    expected = one_engine_text(tiny_model_dir, prompts)
    for tokens, want in zip(prompts, expected, strict=True):
        text, usage = streamed(url, tokens)
        assert text == want
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK_SIZE  # every full block


def test_a_hung_then_dead_prefill_instance_costs_a_cold_prefill_not_the_request(pair, tiny_model_dir):
    url, prefill, _, router_log = pair
    prompts = [prompt(2), prompt(3)]
    expected = one_engine_text(tiny_model_dir, prompts)
    os.kill(prefill.proc.pid, signal.SIGSTOP)  # takes the connection, never answers
    text, usage = streamed(url, prompts[0])
    assert text == expected[0] and usage["prompt_tokens_details"]["cached_tokens"] == 0
    prefill.proc.kill()
    prefill.proc.wait(timeout=30)
    text, usage = streamed(url, prompts[1])
    assert text == expected[1] and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert "prefill skipped" in router_log.read_text()
    metrics = scrape(url)
    prefilled = f"llmserve_router:prefills_total{{outcome=prefilled,replica={prefill.base_url}}}"
    # the hung one timed out and was marked down: the next prompt found no prefill instance up
    skipped = {"": 1.0, prefill.base_url: 1.0}
    assert (
        metrics[prefilled] == 2
        and {
            name.split("replica=")[1][:-1]: value
            for name, value in metrics.items()
            if name.startswith("llmserve_router:prefills_total{outcome=skipped")
        }
        == skipped
    )
