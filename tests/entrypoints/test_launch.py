"""The console script's tcmalloc preload: re-executes itself once, only where the library exists."""

import os
import sys

import pytest

from llmserve.cli import launch


@pytest.fixture
def execve_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, args, env: calls.append((path, args, env)))
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "/venv/bin/llmserve", "serve", "--port", "9"])
    monkeypatch.delenv("LLMSERVE_TCMALLOC", raising=False)
    return calls


def test_reexecutes_with_the_library_preloaded(monkeypatch, execve_calls):
    monkeypatch.setattr(launch, "find_tcmalloc", lambda: "/usr/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    launch.preload_tcmalloc()
    [(path, args, env)] = execve_calls
    assert path == sys.executable and args == [sys.executable, "/venv/bin/llmserve", "serve", "--port", "9"]
    assert env["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/opt/other.so"


@pytest.mark.parametrize(
    ("library", "env"),
    [
        (None, {}),  # not installed: run on the system allocator
        ("/usr/lib/libtcmalloc_minimal.so.4", {"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}),  # done
        ("/usr/lib/libtcmalloc_minimal.so.4", {"LLMSERVE_TCMALLOC": "0"}),  # turned off
    ],
)
def test_runs_as_it_is_otherwise(monkeypatch, execve_calls, library, env):
    monkeypatch.setattr(launch, "find_tcmalloc", lambda: library)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch.preload_tcmalloc()
    assert execve_calls == []


def test_the_engines_malloc_policy_applies_only_without_tcmalloc(monkeypatch):
    from llmserve.worker import malloc_tuning

    assert launch.keep_large_allocations_on_the_heap is malloc_tuning.keep_large_allocations_on_the_heap
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    assert malloc_tuning.keep_large_allocations_on_the_heap() is False
    monkeypatch.delenv("LD_PRELOAD")
    if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION"):
        assert malloc_tuning.keep_large_allocations_on_the_heap() is True
