"""The one glibc malloc policy, for every process that runs an engine: a fixed mmap threshold of
512 MiB (large allocations from the heap), and the heap's top kept.

By default glibc serves an allocation above its mmap threshold (dynamic, from 128 KiB up to 32 MiB)
with a fresh `mmap` and returns it with `munmap` when freed. Both take the process's memory-map lock
for writing, so each waits for the KV prefault's populate calls, which hold it for reading while
they fault a 2 MiB page in (milliseconds each on a VM whose host has taken the free memory back).
Loading the default model beside the prefault of its pool took about three times as long as alone;
with these settings little more than alone, and throughput and batch-1 latency did not change
(docs/benchmarks.md, "Start-up").

A fixed threshold also makes a process's speed independent of its history: glibc's dynamic one rises
as large blocks are freed, so whether a step's large temporaries (oneDNN's buffers for varying row
counts) were mapped afresh or kept on the heap depended on what ran before (an engine that had
speculated at small batches ran slower than an identical fresh one, and its RSS grew). A low fixed
threshold (1 MiB) would do that too, but would map and unmap every large temporary of every step,
each call taking the memory-map lock and faulting the pages in again; a high one keeps them on the
heap, which is why this one is high.

The settings: allocations below 512 MiB come from the heap (a KV pool of 512 MiB or more stays a
mapping of its own); the heap grows 64 MiB past each request, so that few `brk` calls take the lock;
and up to 1 GiB free at its top is kept for the next step's temporaries instead of being returned and
faulted in again. Once the model is loaded, `release_free_heap` gives back what the loading freed.
The engine process applies them first thing (engine/engine_core.py); the `llmserve` console script
applies them to its own process where glibc serves malloc (cli/launch.py: an offline command runs its
engine there). Under tcmalloc they do not apply.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger("llmserve")

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 512 << 20), (_M_TOP_PAD, 64 << 20), (_M_TRIM_THRESHOLD, 1 << 30))


def keep_large_allocations_on_the_heap() -> bool:
    """Apply the settings to this process (glibc on Linux); False where they do not apply (tcmalloc
    preloaded, or another C library)."""
    if not sys.platform.startswith("linux") or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    applied = all(mallopt(option, value) == 1 for option, value in _SETTINGS)
    if not applied:
        logger.debug("malloc settings not applied (mallopt refused one)")
    return applied


def release_free_heap() -> None:
    """Return the heap's free pages to the OS (`malloc_trim`): the loading's temporaries (a converted
    copy of the weights) would otherwise stay resident."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
