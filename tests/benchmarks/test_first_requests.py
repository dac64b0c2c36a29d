"""Smoke test of benchmarks/tools/first_requests.py on a tiny model: two fresh servers, both
rounds, the speculation comparison; no timing is asserted."""

from __future__ import annotations

import json
import socket

import pytest

from benchmarks.tools import first_requests
from benchmarks.tools.first_requests import PromptSource


@pytest.mark.server
def test_first_requests_times_two_rounds_per_fresh_server_and_compares_speculation(tiny_model_dir, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    output = tmp_path / "first.json"
    server_args = "--dtype float32 --max-model-len 256 --kv-cache-memory 16MiB"
    argv = ["--configs", "none,ngram", "--lengths", "16,40,24", "--max-tokens", "4", "--serve-seconds", "0.5"]
    argv += ["--model", tiny_model_dir, "--server-args", server_args, "--port", str(port)]
    results = first_requests.main([*argv, "--output", str(output), "--logs", str(tmp_path / "logs")])
    assert [r.config for r in results] == ["none", "ngram"]
    payload = json.loads(output.read_text())
    for config in payload["configs"]:
        assert len(config["first_ttft"]) == len(config["later_ttft"]) == 3
        assert all(t > 0 for t in config["first_ttft"] + config["later_ttft"])
        assert config["startup_seconds"] > 0 and config["served_between"] >= 1
        assert config["summary"]["first_p90_ms"] >= config["summary"]["first_median_ms"] > 0
    assert "--speculative-method ngram" in payload["configs"][1]["server_command"]
    assert set(payload["speculation"]) == {"ngram"}
    log = (tmp_path / "logs" / "first-requests-ngram.log").read_text()
    assert "engine warmed up" in log


def test_first_requests_prompts_never_share_a_first_token(tiny_model_dir):
    source = PromptSource(tiny_model_dir)
    prompts = [source.prompt(n) for n in (8, 64, 8, 300) * 10]
    assert [len(p) for p in prompts] == [8, 64, 8, 300] * 10
    assert len({p[0] for p in prompts}) == len(prompts)
