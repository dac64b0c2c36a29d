"""The `llmserve` console script: puts the process on tcmalloc where the system has it, then runs
the CLI. `python -m llmserve.cli.launch ...` is the same for tools that start a server as users do
(the soak); `python -m llmserve.cli` skips this set-up.

glibc's malloc is slow for the engine's pattern (thousands of short-lived tensors per step, freed on
another thread than the one that allocated some of them): tcmalloc makes decode steps markedly
faster, and vLLM's CPU backend asks for the same preload. A preload must be in place before the
process starts, so the script re-executes itself once with `LD_PRELOAD` set, before torch is
imported (the cost is one more Python start-up). Set `LLMSERVE_TCMALLOC=0` to keep the system
allocator; install it with `apt-get install libtcmalloc-minimal4` (Debian/Ubuntu).

`llmserve serve` also shortens how long an idle OpenMP worker spins before it sleeps (libgomp's
GOMP_SPINCOUNT, read when torch loads it: 10,000 spins instead of libgomp's 300,000). The server's
own threads share the workers' cores (worker/cpu_binding.py); a worker that spun through the engine's
serial part of each step would keep them off that core just when they can run without stalling the
engine. An explicit GOMP_SPINCOUNT wins; other commands keep libgomp's default.

Where it runs on glibc's malloc after all, it applies the engine's malloc policy to its own process
(worker/malloc_tuning.py, where the policy and its reason are stated), so that an engine an offline
command runs in this process allocates as the server's engine process does.
"""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path

from llmserve.worker.malloc_tuning import keep_large_allocations_on_the_heap

_LIBRARY_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def find_tcmalloc() -> str | None:
    for directory in _LIBRARY_DIRS:
        for name in _LIBRARY_NAMES:
            path = Path(directory) / name
            if path.exists():
                return str(path)
    return None


def preload_tcmalloc() -> None:
    """Re-execute this process with tcmalloc preloaded, unless it already is, is turned off, or the
    library is not installed (then nothing happens: the system allocator works, only slower)."""
    preload = os.environ.get("LD_PRELOAD", "")
    turned_off = os.environ.get("LLMSERVE_TCMALLOC", "1") == "0"
    if turned_off or "tcmalloc" in preload or not sys.platform.startswith("linux"):
        return
    library = find_tcmalloc()
    if library is None:
        return
    env = dict(os.environ, LD_PRELOAD=f"{library}:{preload}" if preload else library)
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # could not re-execute (unusual interpreter set-up): run as we are


SERVER_OPENMP_SPINCOUNT = "10000"


def shorten_openmp_spin_for_serve(argv: list[str]) -> None:
    """For `llmserve serve`, a short OpenMP spin unless one is set (module docstring); before torch loads."""
    if argv[1:2] == ["serve"]:
        os.environ.setdefault("GOMP_SPINCOUNT", SERVER_OPENMP_SPINCOUNT)


def main() -> typing.NoReturn:
    shorten_openmp_spin_for_serve(sys.argv)
    preload_tcmalloc()
    keep_large_allocations_on_the_heap()
    from llmserve.cli.main import exit_without_teardown
    from llmserve.cli.main import main as cli_main

    exit_without_teardown(cli_main())


if __name__ == "__main__":
    main()
