"""Which x86-64 instruction-set level the compiled CPU kernels are built for on this machine.

The kernels are compiled per level, not with `-march=native`: a build then runs on every CPU that has
its level (a shared cache, an image built elsewhere), and its cache key names what the binary needs
rather than the machine it was built on. At start-up the highest level the CPU reports is chosen
(PyTorch's ATen dispatch and llama.cpp's CPU variants choose the same way);
`LLMSERVE_CPU_ISA=<level>` forces a lower one, so an AVX-512 machine runs and tests the AVX2 kernels.

| level         | what the CPU must report                   | who has it                              |
|---------------|--------------------------------------------|-----------------------------------------|
| `avx2`        | AVX2, FMA, F16C, BMI2 (x86-64-v3)          | Haswell on, Zen 1-3                     |
| `avx512`      | AVX-512 F/BW/DQ/CD/VL (x86-64-v4)          | Skylake-X, Ice Lake                     |
| `avx512_bf16` | the above with AVX-512 BF16 and VNNI       | Cooper Lake, Zen 4/5                    |
| `amx`         | the above with AMX tiles (BF16, INT8)      | Sapphire Rapids on                      |

A kernel's source decides what it compiles to at each level by the compiler's feature macros; the
module says at run time which kernels it holds (`*_supported()`).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

FORCE_VARIABLE = "LLMSERVE_CPU_ISA"


@dataclass(frozen=True)
class IsaLevel:
    name: str
    cpu_flags: frozenset[str]  # as /proc/cpuinfo names them
    compiler_flags: tuple[str, ...]


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512dq", "avx512cd", "avx512vl"}
_BF16 = _V4 | {"avx512_bf16", "avx512_vnni"}
_AMX = _BF16 | {"amx_tile", "amx_bf16", "amx_int8"}

LEVELS: tuple[IsaLevel, ...] = (  # lowest first
    IsaLevel("avx2", _V3, ("-march=x86-64-v3",)),
    IsaLevel("avx512", _V4, ("-march=x86-64-v4",)),
    IsaLevel("avx512_bf16", _BF16, ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni")),
    IsaLevel(
        "amx",
        _AMX,
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
    ),
)
_BY_NAME = {level.name: level for level in LEVELS}


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the CPU reports (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def best_level(flags: frozenset[str]) -> IsaLevel | None:
    """The highest level whose flags the CPU has, or None (no AVX2, or not x86-64)."""
    supported = [level for level in LEVELS if level.cpu_flags <= flags]
    return supported[-1] if supported else None


def resolve_level(flags: frozenset[str], forced: str | None) -> IsaLevel | None:
    """The level to build and load: the CPU's best, or the forced one if the CPU has it.

    A forced level the CPU lacks is an error, not a fallback: its kernels would die on an illegal
    instruction."""
    best = best_level(flags)
    if not forced:
        return best
    if forced not in _BY_NAME:
        raise ValueError(f"{FORCE_VARIABLE}={forced!r}: choose one of {', '.join(_BY_NAME)}")
    level = _BY_NAME[forced]
    if not level.cpu_flags <= flags:
        missing = ", ".join(sorted(level.cpu_flags - flags))
        raise ValueError(f"{FORCE_VARIABLE}={forced}: this CPU lacks {missing}")
    return level


@functools.cache
def selected_level() -> IsaLevel | None:
    """This process's level (None: no compiled kernels on this CPU)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # other architectures: the PyTorch paths until kernels exist for them
    return resolve_level(cpu_flags(), os.environ.get(FORCE_VARIABLE) or None)


def is_forced() -> bool:
    return bool(os.environ.get(FORCE_VARIABLE))
