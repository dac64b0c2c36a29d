"""Real `llmserve serve` processes on free loopback ports, for black-box HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_until

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `python -m llmserve.cli serve` child; output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("LLMSERVE_API_KEY", None)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        wait_until(self._healthy, timeout, lambda: f"the server's /health 200:\n{self.log()}", interval=0.2)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=60.0, **kwargs)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(args: list[str], log_path: Path, api_key: str | None = None) -> ServerProcess:
    server = ServerProcess(args, log_path, api_key)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.helpers import make_tiny_llama_dir

    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("models") / "tiny-llama"))


def tiny_server_args(model_dir: str, *extra: str) -> list[str]:
    """float32: greedy outputs compared across batch compositions must not hinge on bf16 rounding."""
    return [
        "--model",
        model_dir,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "64MiB",
        "--dtype",
        "float32",
        *extra,
    ]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    """The tiny model behind an API key; shared by every test of a module."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    process = start_server(tiny_server_args(tiny_model_dir), log, api_key=API_KEY)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from llmserve.model_loader import load_tokenizer

    return load_tokenizer(tiny_model_dir)
