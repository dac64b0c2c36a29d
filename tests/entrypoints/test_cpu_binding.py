"""The server's CPU binding: the engine's OpenMP threads one per CPU, the server's threads off the
CPU of the engine's main thread. Run in a child process, since binding changes the process it runs in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmserve.cli import launch
from llmserve.worker import cpu_binding

_SCRIPT = """
import asyncio, json, os, sys
from pathlib import Path
from llmserve import SamplingParams
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM

def cpus_of(pid):
    result = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        result[int(task.name)] = sorted(os.sched_getaffinity(int(task.name)))
    return result

args = EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=128, kv_cache_memory="16MiB")
llm = AsyncLLM(args, fork=True, bind_cpus=sys.argv[2] == "1")

async def generate():
    async for output in llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "r"):
        last = output
    return last.outputs[0].token_ids

tokens = asyncio.run(generate())  # the server's threads exist now; the engine has run a step
engine_pid = llm.engine_core.pid
print(json.dumps({"server": cpus_of(os.getpid()), "engine": cpus_of(engine_pid), "engine_pid": engine_pid,
                  "tokens": tokens}))
llm.shutdown()
"""

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs"
)


def _run(tiny_model_dir: str, bind: bool) -> dict:
    command = [sys.executable, "-c", _SCRIPT, tiny_model_dir, "1" if bind else "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.process
@needs_two_cpus
@pytest.mark.cpu_kernels  # they pin the OpenMP threads
def test_the_engine_threads_are_pinned_and_the_server_keeps_off_the_engines_main_cpu(tiny_model_dir):
    expected = cpu_binding.engine_cpus()  # the child has this process's CPUs and thread count
    result = _run(tiny_model_dir, bind=True)
    engine = {int(tid): cpus for tid, cpus in result["engine"].items()}
    main_cpu = expected[0]
    assert engine[result["engine_pid"]] == [main_cpu]  # the main thread is OpenMP thread 0
    assert [expected[1]] in engine.values()  # an OpenMP worker, on the next CPU
    for cpus in result["server"].values():  # every server thread (event loop, sender, reader)
        assert main_cpu not in cpus and cpus
    assert len(result["tokens"]) == 4


@pytest.mark.process
@needs_two_cpus
def test_without_binding_nothing_is_pinned(tiny_model_dir):
    allowed = sorted(os.sched_getaffinity(0))
    result = _run(tiny_model_dir, bind=False)
    assert result["engine"][str(result["engine_pid"])] == allowed
    assert all(cpus == allowed for cpus in result["server"].values())


def test_the_engine_takes_one_cpu_per_physical_core_before_any_smt_sibling(monkeypatch):
    cores = {0: ("0", "0"), 1: ("0", "0"), 2: ("0", "1"), 3: ("0", "1"), 4: ("1", "0"), 5: ("1", "0")}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores), raising=False)
    monkeypatch.setattr(cpu_binding, "_core_of", cores.get)
    monkeypatch.setattr(cpu_binding.torch, "get_num_threads", lambda: 3)
    assert cpu_binding.engine_cpus() == [0, 2, 4]  # core 0 of package 1 is not core 0 of package 0
    monkeypatch.setattr(cpu_binding.torch, "get_num_threads", lambda: 5)
    assert cpu_binding.engine_cpus() == [0, 2, 4, 1, 3]


def test_serve_gets_a_short_openmp_spin_unless_one_is_set(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")  # recorded, so that teardown restores the real state
    monkeypatch.delenv("GOMP_SPINCOUNT")
    launch.shorten_openmp_spin_for_serve(["llmserve", "bench", "throughput"])
    assert "GOMP_SPINCOUNT" not in os.environ  # offline commands keep libgomp's default
    launch.shorten_openmp_spin_for_serve(["llmserve", "serve", "--port", "9"])
    assert os.environ["GOMP_SPINCOUNT"] == launch.SERVER_OPENMP_SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    launch.shorten_openmp_spin_for_serve(["llmserve", "serve"])
    assert os.environ["GOMP_SPINCOUNT"] == "123"  # an explicit setting wins
