"""The load generator against a real `llmserve serve` on a tiny random Llama (loopback port)."""

import asyncio
import json
import socket
import subprocess
import sys

import httpx
import pytest

from llmserve.benchmarks.commands.serve import response_format_body
from llmserve.benchmarks.serve import LoadGenerator, pick_salts, salt_requests, served_model_name, summarize
from llmserve.benchmarks.workload import BenchRequest
from llmserve.cli.main import main
from tests.helpers import wait_until

pytestmark = pytest.mark.server

STARTUP_SECONDS = 120


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    port = free_port()
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--model", tiny_model_dir,
               "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16MiB"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, url)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def wait_until_ready(process: subprocess.Popen, url: str) -> None:
    def answers() -> bool:
        if process.poll() is not None:
            pytest.fail(f"llmserve serve exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, STARTUP_SECONDS, "llmserve serve to answer /v1/models", interval=0.2)


def test_streamed_completions_are_timed_and_counted(server_url):
    requests = [
        BenchRequest("", list(range(100, 100 + n)), max_tokens) for n, max_tokens in ((5, 4), (9, 1), (3, 6))
    ]
    generator = LoadGenerator(server_url, served_model_name(server_url), max_concurrency=2)
    results, duration = asyncio.run(generator.run(requests))
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [4, 1, 6]  # ignore_eos: exactly max_tokens each
    assert [r.prompt_tokens for r in results] == [5, 9, 3]
    for result in results:
        assert 0 < result.ttft <= result.e2e <= duration
        assert len(result.itls) <= result.output_tokens - 1
    metrics = summarize(results, duration, goodput={"ttft": 1e6, "tpot": 1e6})
    assert metrics.output_tokens == 11 and metrics.slo_attainment == 1.0
    assert [r["prompt_tokens"] for r in metrics.per_request] == [5, 9, 3]
    sent = [r["sent_s"] for r in metrics.per_request]
    assert all(0 <= s <= duration for s in sent) and max(sent) > min(sent)  # the third waited for a slot


def test_text_prompts_and_a_sweep_from_the_command_line(server_url, tiny_model_dir, tmp_path):
    output, plot = tmp_path / "serve.json", tmp_path / "sweep.png"
    argv = ["bench", "serve", "--url", server_url, "--tokenizer", tiny_model_dir, "--num-requests", "3",
            "--prompt-len-median", "8", "--output-len-median", "3", "--output-len-range", "2,4",
            "--prompt-format", "text", "--request-rates", "25:50:25,inf", "--goodput", "ttft:60000",
            "e2el:60000"]  # fmt: skip
    assert main([*argv, "--output", str(output), "--plot", str(plot)]) == 0
    result = json.loads(output.read_text())
    assert [run["request_rate"] for run in result["runs"]] == [25, 50, "inf"]
    assert all(run["num_ok"] == 3 for run in result["runs"])
    assert all(run["goodput_targets_ms"] == {"ttft": 60000, "e2el": 60000} for run in result["runs"])
    assert all(run["slo_attainment"] == 1.0 and run["request_goodput"] > 0 for run in result["runs"])
    assert all(run["client_cpu_seconds"] > 0 for run in result["runs"])  # the load generator's own CPU
    assert plot.stat().st_size > 0
    salts = result["cache_bust_salt_token_ids"]
    assert len(salts) == 3 and len(set(salts)) == 3
    # each run's prompts carry its salt text: more prompt tokens than the workload itself
    assert all(run["prompt_tokens"] > result["workload"]["prompt_tokens"] for run in result["runs"])


def test_a_json_schema_constrains_every_request(server_url, tiny_model_dir, tmp_path):
    """--json-schema sends response_format json_schema with every request (an open-ended array, so
    that ignore_eos never meets a finished document); a schema the server refuses fails the requests."""
    schema, output = tmp_path / "schema.json", tmp_path / "serve.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer"}}))
    argv = ["bench", "serve", "--url", server_url, "--tokenizer", tiny_model_dir, "--num-requests", "3",
            "--prompt-len-median", "8", "--output-len-median", "6", "--output-len-range", "4,8"]  # fmt: skip
    assert main([*argv, "--json-schema", str(schema), "--output", str(output)]) == 0
    (run,) = json.loads(output.read_text())["runs"]
    assert run["num_ok"] == 3
    schema.write_text(json.dumps({"type": "object", "not": {}}))  # a keyword the grammar engine refuses
    main([*argv, "--json-schema", str(schema), "--output", str(output)])
    (run,) = json.loads(output.read_text())["runs"]
    assert run["num_ok"] == 0
    assert response_format_body(None) is None
    with pytest.raises(ValueError, match="--json-schema /nonexistent"):
        response_format_body("/nonexistent")


def test_salts_are_distinct_workload_tokens_put_before_every_prompt():
    requests = [BenchRequest("a b", [7, 8], 3), BenchRequest("c", [9, 7], 2)]
    salts = pick_salts(requests, 3, seed=0)
    assert sorted(salts) == [7, 8, 9]
    salted = salt_requests(requests, salts[0], "x ")
    assert [r.prompt_token_ids for r in salted] == [[salts[0], 7, 8], [salts[0], 9, 7]]
    assert [r.prompt for r in salted] == ["x a b", "x c"] and [r.max_tokens for r in salted] == [3, 2]
    with pytest.raises(ValueError, match="only 3 distinct tokens"):
        pick_salts(requests, 4)
