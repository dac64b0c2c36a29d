"""The tiny model, the `llmserve router` command line and the metrics of routers and replicas."""

from __future__ import annotations

import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.helpers import make_tiny_llama_dir

    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("models") / "tiny-llama"))


def router_command(replicas: list[str], model_dir: str, port: int, *extra: str) -> list[str]:
    flags = [arg for url in replicas for arg in ("--replica", url)]
    return [
        sys.executable,
        "-m",
        "llmserve.cli",
        "router",
        *flags,
        "--model",
        model_dir,
        "--port",
        str(port),
        *extra,
    ]


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name plus its labels in order."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def replica_urls(router_url: str) -> list[str]:
    prefix = "llmserve_router:replica_healthy{replica="
    return sorted(name[len(prefix) : -1] for name in scrape(router_url) if name.startswith(prefix))
