"""The compiled CPU kernels (paged decode and prefill attention, small-batch linear, fused
norm/rotary/SwiGLU, K/V writes, greedy sampling), built once per machine with torch's C++ extension loader.

`make venv` builds them during set-up (so the first `llmserve serve` does not wait for a compiler);
if compilation fails the engine falls back to the pure-PyTorch reference backend and says so.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
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


# A build takes minutes on a small machine; a lock this old was left by a build that was killed.
_STALE_LOCK_SECONDS = 30 * 60


def remove_stale_lock(build_directory: str) -> bool:
    """Remove the build lock a killed build left behind; whether one was removed. torch's loader
    waits for `lock` to disappear, so a lock whose build died would make every later start hang."""
    lock = Path(build_directory) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < _STALE_LOCK_SECONDS:
        return False  # a build may still be running: wait for it as torch does
    logger.warning("removing a stale kernel build lock (%.0f minutes old): %s", age / 60, lock)
    lock.unlink(missing_ok=True)
    return True


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
        remove_stale_lock(build_directory)
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
