"""The `llmserve` console script: puts the process on tcmalloc where the system has it, then runs
the CLI.

glibc's malloc is slow for the engine's pattern (thousands of short-lived tensors per step, freed on
another thread than the one that allocated some of them): with tcmalloc preloaded a batch-64 decode
step took 68.5 ms instead of 89.7 ms on the project's machine (docs/benchmarks.md), and vLLM's CPU
backend asks for the same preload. A preload must be in place before the process starts, so the
script re-executes itself once with `LD_PRELOAD` set, before torch is imported (the cost is a
Python start-up, about 50 ms). Set `LLMSERVE_TCMALLOC=0` to keep the system allocator; install it
with `apt-get install libtcmalloc-minimal4` (Debian/Ubuntu).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


def main() -> int:
    preload_tcmalloc()
    from llmserve.entrypoints.cli import main as cli_main

    return cli_main()
