"""The compiled CPU kernels (paged decode and prefill attention, small-batch linear, fused
norm/rotary/SwiGLU, K/V writes, greedy sampling), built once per machine with torch's C++ extension loader.

`make venv` builds them during set-up (so the first `llmserve serve` does not wait for a compiler);
if compilation fails the engine falls back to the pure-PyTorch reference backend and says so. They are
compiled for the CPU's instruction-set level (config/cpu_isa.py), one build per level.
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

from llmserve.config.cpu_isa import IsaLevel, is_forced, selected_level

logger = logging.getLogger("llmserve")

_SOURCE_NAMES = (
    "module.cpp",
    "paged_attention.cpp",
    "paged_attention_low_bit.cpp",
    "prefill_attention.cpp",
    "prefill_attention_fma.cpp",
    "linear.cpp",
    "linear_amx.cpp",
    "linear_f32.cpp",
    "linear_quantized.cpp",
    "elementwise.cpp",
    "kv_write.cpp",
    "decode_stack.cpp",
    "draft_head.cpp",
    "greedy.cpp",
    "lora.cpp",
    "moe.cpp",
    "threads.cpp",
    "shm_collectives.cpp",
)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [str(_CSRC / name) for name in _SOURCE_NAMES]

# -mtune=native schedules for this CPU; the binary still runs on any CPU of its level.
_CFLAGS = ["-O3", "-mtune=native", "-fopenmp"]


def compiler_flags(level: IsaLevel) -> list[str]:
    return [*_CFLAGS, *level.compiler_flags]


def _build_directory(root: str, level: IsaLevel) -> str:
    """One build per distinct source, torch, flags (the level's) and paths: two checkouts, versions or
    levels on one machine never rebuild over each other's module, each finds its own build on the
    next start. The paths count because ninja rebuilds whenever the command of a build changes, even
    for identical sources: the checkout's, and torch's headers as this process reaches them (a venv
    reached through a symlink gives other include paths)."""
    digest = hashlib.sha256()
    for source in sorted(_CSRC.iterdir()):  # the headers too
        digest.update(source.read_bytes())
    paths = f"{_CSRC.resolve()} {os.path.dirname(torch.__file__)}"
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {compiler_flags(level)} {paths}".encode())
    path = Path(root) / f"llmserve_cpu_ops_{level.name}-{digest.hexdigest()[:16]}"
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
    """The compiled module for this CPU's level, or None (with a warning) if it cannot be built here."""
    try:
        level = selected_level()
    except ValueError as error:  # a forced level this CPU lacks
        logger.warning("compiled CPU kernels unavailable (%s); using the torch reference paths", error)
        return None
    if level is None:
        logger.warning("compiled CPU kernels need an x86-64 CPU with AVX2; using the torch reference paths")
        return None
    try:
        from torch.utils.cpp_extension import load

        # torch finds `ninja` on PATH; the pinned one lives beside this interpreter in the venv.
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        build_root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
            Path.home() / ".cache" / "llmserve" / "torch_extensions"
        )
        build_directory = _build_directory(build_root, level)
        with build_lock(build_directory):
            module = load(
                name=f"llmserve_cpu_ops_{level.name}",
                sources=_SOURCES,
                extra_cflags=compiler_flags(level),
                extra_ldflags=["-fopenmp"],
                build_directory=build_directory,
                verbose=False,
            )
        how = "forced by LLMSERVE_CPU_ISA" if is_forced() else "the CPU's best"
        logger.info("compiled CPU kernels: the %s level (%s)", level.name, how)
        return module
    except Exception as error:  # noqa: BLE001 - any build failure means "use the fallback"
        logger.warning("compiled CPU kernels unavailable (%s); using the torch reference paths", error)
        return None


def cpu_ops_for(tensor: torch.Tensor) -> ModuleType | None:
    """The compiled kernels if `tensor` can go to them (it is on the CPU), else None: the caller
    then runs its PyTorch formulation (CUDA, or a machine where the build failed). Called per op
    and layer on the decode path, so it is one attribute test and a cached lookup."""
    return load_cpu_ops() if tensor.device.type == "cpu" else None
