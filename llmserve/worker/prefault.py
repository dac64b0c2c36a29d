"""Fault the KV pool's pages in ahead of use, without touching its contents.

On the CPU the pool is `torch.empty`: the OS maps each 4 KiB page on its first write. Left to the
forward pass, that first write lands in the attention kernel's K/V stores, one fault at a time
inside a parallel region where the other thread waits, so a fresh engine's first pass was slower
than the same pass again until the pool was faulted in beforehand. Writing zeros up front
would cost start-up time; `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) maps the pages writable
without changing a byte, so it can run on a background thread while the engine already serves:
a page the engine writes first is simply one fault fewer for the thread.

Before that the pool is advised into transparent huge pages (`MADV_HUGEPAGE`; most distributions
enable THP only where advised): a decode step reads blocks scattered over the whole pool, and with
4 KiB pages nearly every block of one layer's K or V costs a TLB miss of its own (offline
throughput was higher with 2 MiB pages in alternated runs).

The low blocks of every layer's K and V, which the block pool hands out first, are mapped first: an
engine serving before the prefault ends (`--no-warmup`, or offline) writes there. A fresh 2 MiB page
can cost milliseconds (on a VM whose host took the free memory back, the whole pool takes seconds,
several times its time in 4 KiB pages), and each populate call holds the process's memory-map lock,
so that an mmap waits meanwhile (worker/malloc_tuning.py keeps the engine process's large allocations
off mmap). The thread keeps its priority: lowered to SCHED_IDLE it never finished during a busy
offline run, and its calls in the gaps cost throughput and batch-1 latency (docs/benchmarks.md,
"Start-up").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
import threading

import torch

logger = logging.getLogger("llmserve")

MADV_HUGEPAGE = 14  # linux/mman.h
MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
_PAGE = 4096
_HUGE_PAGE = 2 << 20
# One madvise call per 2 MiB. The call holds the process's memory-map lock while it faults its range
# in, and the engine's own mmap/munmap calls (large temporaries) wait for it: small calls keep the
# first requests after /health from waiting behind a long one, and the whole pool takes as long.
_CHUNK = 2 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _whole_pages(tensor: torch.Tensor, page: int) -> tuple[int, int] | None:
    """[start, end) of the `page`-aligned part of a contiguous CPU tensor's memory; None where there is
    no such part or no libc to advise it."""
    if _libc() is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    address = tensor.data_ptr()
    start = -(-address // page) * page
    end = (address + tensor.numel() * tensor.element_size()) // page * page
    return (start, end) if end > start else None


class _Chunks:
    """Ranges of memory handed out one at a time, in order, to whichever thread asks: the background
    thread, and a caller that would otherwise wait for it (`PrefaultThread.finish`)."""

    def __init__(self, ranges: list[tuple[int, int]], label: str = "kv") -> None:
        self._ranges = ranges
        self.label = label  # what the memory is, for the thread's name and the logs
        self._next = 0
        self._lock = threading.Lock()
        self.failed = False

    def stop(self) -> None:
        """Hand out no more ranges (the memory is being given back)."""
        with self._lock:
            self._next = len(self._ranges)

    def take(self) -> tuple[int, int] | None:
        """The next (address, length), or None when none is left."""
        with self._lock:
            if self.failed or self._next >= len(self._ranges):
                return None
            self._next += 1
            return self._ranges[self._next - 1]

    def populate(self) -> bool:
        """Populate ranges until none is left; False where the OS refused one (the others stop too)."""
        libc = _libc()
        while (chunk := self.take()) is not None:
            address, length = chunk
            if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE) != 0:
                logger.debug("%s prefault stopped: madvise errno %d", self.label, ctypes.get_errno())
                self.failed = True
        return not self.failed


def _ranges(start: int, end: int, planes: int) -> list[tuple[int, int]]:
    """[start, end) in `_CHUNK`-sized ranges. With `planes` equal planes (the pool's K or V of one
    layer, each block-indexed from its start) they go by their offset in their plane, so that the low
    blocks of every plane come first (a range across a plane boundary holds a plane's start: offset 0)."""
    chunks = [(address, min(address + _CHUNK, end) - address) for address in range(start, end, _CHUNK)]
    plane = max(1, (end - start) // max(1, planes))

    def offset(chunk: tuple[int, int]) -> int:
        first, last = chunk[0] - start, chunk[0] + chunk[1] - 1 - start
        return 0 if first // plane != last // plane else first % plane

    return sorted(chunks, key=offset)


def populate(tensor: torch.Tensor) -> bool:
    """Map every whole page of a CPU tensor's memory writable now; False where the OS cannot."""
    pages = _whole_pages(tensor, _PAGE)
    return pages is not None and _Chunks(_ranges(*pages, 1)).populate()


def advise_huge_pages(tensor: torch.Tensor, label: str = "kv") -> bool:
    """Ask for transparent huge pages over the 2 MiB-aligned part of a CPU tensor's memory, before
    anything touches it; False where the OS declines (THP off, or not Linux)."""
    pages = _whole_pages(tensor, _HUGE_PAGE)
    if pages is None:
        return False
    libc, (start, end) = _libc(), pages
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) != 0:
        logger.debug("%s: no transparent huge pages (madvise errno %d)", label, ctypes.get_errno())
        return False
    return True


class PrefaultThread(threading.Thread):
    """The background prefault; `finish` populates alongside it in the calling thread, then joins."""

    def __init__(self, chunks: _Chunks) -> None:
        super().__init__(target=chunks.populate, name=f"{chunks.label}-prefault", daemon=True)
        self.chunks = chunks

    def finish(self) -> None:
        """Block until every page is mapped, mapping chunks here too (ctypes releases the GIL, so both
        threads fault pages in at once: about half the time on two cores)."""
        self.chunks.populate()
        self.join()


def populate_in_background(tensor: torch.Tensor, planes: int = 1, label: str = "kv") -> PrefaultThread | None:
    """Huge pages advised, then `populate` on a daemon thread (ctypes releases the GIL for the call);
    None off the CPU. The tensor's memory is `planes` equal planes block-indexed from their starts
    (the pool's [layer, K/V] slices), mapped low blocks of every plane first; `label` names it in logs."""
    pages = _whole_pages(tensor, _PAGE) if tensor.device.type == "cpu" else None
    if pages is None:
        return None
    advise_huge_pages(tensor, label)
    thread = PrefaultThread(_Chunks(_ranges(*pages, planes), label))
    thread.start()
    return thread
