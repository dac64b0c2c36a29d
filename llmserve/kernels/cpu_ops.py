"""The compiled CPU kernels (paged decode and prefill attention, small-batch linear, fused
norm/rotary/SwiGLU, K/V writes, greedy sampling), built once per machine with torch's C++ extension loader.

`make venv` builds them during set-up (so the first `llmserve serve` does not wait for a compiler);
if compilation fails the engine falls back to the pure-PyTorch reference backend and says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("llmserve")

_SOURCE_NAMES = (
    "module.cpp",
    "paged_attention.cpp",
    "prefill_attention.cpp",
    "prefill_attention_f32.cpp",
    "linear.cpp",
    "linear_amx.cpp",
    "linear_f32.cpp",
    "linear_quantized.cpp",
    "elementwise.cpp",
    "kv_write.cpp",
    "decode_stack.cpp",
    "draft_head.cpp",
    "greedy.cpp",
    "threads.cpp",
    "shm_collectives.cpp",
)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [str(_CSRC / name) for name in _SOURCE_NAMES]


_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _build_directory(root: str) -> str:
    """One build per distinct source, torch, flags and checkout: two checkouts (or versions) on one
    machine then never rebuild over each other's module, each finds its own build on the next start.
    The checkout's path counts too, since ninja rebuilds whenever the source paths of its build
    commands change, even for identical sources."""
    digest = hashlib.sha256()
    for source in sorted(_CSRC.iterdir()):  # the headers too
        digest.update(source.read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {_CFLAGS} {_CSRC.resolve()}".encode())
    path = Path(root) / f"llmserve_cpu_ops-{digest.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@contextlib.contextmanager
def build_lock(build_directory: str) -> Iterator[bool]:
    """Held while this process loads (and maybe builds) the kernels; yields whether it removed a lock
    file left by a killed build. torch's loader waits for its `lock` file to disappear, and a build
    killed midway leaves that file forever; an flock is dropped by the kernel when its holder dies,
    so once this process holds it no live build owns torch's lock and the file can go."""
    with open(Path(build_directory) / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        lock = Path(build_directory) / "lock"
        stale = lock.exists()
        if stale:
            logger.warning("removing the lock of a kernel build that was killed: %s", lock)
            lock.unlink(missing_ok=True)
        try:
            yield stale
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load_cpu_ops() -> ModuleType | None:
    """The compiled module, or None (with a warning) if it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        # torch finds `ninja` on PATH; the pinned one lives beside this interpreter in the venv.
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        build_root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
            Path.home() / ".cache" / "llmserve" / "torch_extensions"
        )
        build_directory = _build_directory(build_root)
        with build_lock(build_directory):
            return load(
                name="llmserve_cpu_ops",
                sources=_SOURCES,
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=build_directory,
                verbose=False,
            )
    except Exception as error:  # noqa: BLE001 - any build failure means "use the fallback"
        logger.warning("compiled CPU kernels unavailable (%s); using the torch reference paths", error)
        return None


def cpu_ops_for(tensor: torch.Tensor) -> ModuleType | None:
    """The compiled kernels if `tensor` can go to them (it is on the CPU), else None: the caller
    then runs its PyTorch formulation (CUDA, or a machine where the build failed). Called per op
    and layer on the decode path, so it is one attribute test and a cached lookup."""
    return load_cpu_ops() if tensor.device.type == "cpu" else None
