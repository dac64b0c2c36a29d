"""`llmserve serve --data-parallel-size 2 --distributed-executor-backend ray` on a two-node Ray cluster
of this machine (one CPU each, `ray.cluster_utils.Cluster`): each replica is a Ray actor's server on
its own node, the router in front answers with one engine's greedy tokens, and stopping the server
stops the replicas and gives the cluster back its CPUs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from llmserve import LLM, SamplingParams
from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN, start_server, tiny_server_args
from tests.helpers import wait_until

pytestmark = [pytest.mark.server, pytest.mark.ray]

PROMPTS = [[5, 6, 7, 8] * 6, [100, 200, 300] * 5 + [9], list(range(1000, 1040)), [42] * 3]


@pytest.fixture(scope="module")
def cluster_address():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster.address
    cluster.shutdown()


def test_replicas_on_two_nodes_answer_with_one_engines_greedy_tokens(
    cluster_address, tiny_model_dir, tmp_path, monkeypatch
):
    llm = LLM(tiny_model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [output.outputs[0].text for output in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    monkeypatch.setenv("RAY_ADDRESS", cluster_address)
    args = ["--data-parallel-size", "2", "--distributed-executor-backend", "ray", "--health-interval", "600"]
    server = start_server(tiny_server_args(tiny_model_dir, *args), tmp_path / "server.log", api_key=API_KEY)
    try:
        got = []
        with server.http() as client:
            for prompt in PROMPTS:
                body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
                response = client.post("/v1/completions", json={"model": "tiny-llama", **body})
                assert response.status_code == 200, response.text
                got.append(response.json()["choices"][0]["text"])
        nodes = re.findall(r"replica \d: (http://\S+), a Ray actor on node (\w+)", server.log())
    finally:
        assert server.stop() == 0
    assert got == want
    urls = [url for url, _ in nodes]
    assert len(nodes) == 2 and len({node for _, node in nodes}) == 2  # one replica per node
    for url in urls:  # the replicas stopped with the server
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2.0)
    ray.init(address=cluster_address, logging_level="WARNING")
    try:
        wait_until(lambda: ray.available_resources().get("CPU", 0) >= 2, 30, "the cluster's CPUs back")
        assert ray.available_resources().get("CPU", 0) == 2  # the placement group was removed
    finally:
        ray.shutdown()


def test_more_replicas_than_the_cluster_has_cpus_for_is_one_line(cluster_address, tiny_model_dir):
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--port", "0"]
    command += tiny_server_args(
        tiny_model_dir, "--data-parallel-size", "3", "--distributed-executor-backend", "ray"
    )
    env = {**os.environ, "RAY_ADDRESS": cluster_address}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "llmserve" in line and "error" in line]
    assert lines and "the Ray cluster has 2 CPU; --data-parallel-size 3 needs 3 CPU" in lines[-1], (
        result.stderr
    )
