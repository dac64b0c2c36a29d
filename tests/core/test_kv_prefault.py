"""The KV pool's background prefault maps pages without changing what is in them."""

import ctypes
import ctypes.util
import mmap
import os
import platform
import sys

import pytest
import torch

from llmserve.worker.prefault import (
    _CHUNK,
    _ranges,
    advise_huge_pages,
    populate,
    populate_in_background,
)
from tests.helpers import vm_flags


def _kernel_has_populate_write() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


pytestmark = pytest.mark.skipif(
    not _kernel_has_populate_write(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE)"
)


def _resident_fraction(tensor: torch.Tensor) -> float:
    """Share of the tensor's pages the kernel has mapped (mincore), for page-aligned memory."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    length = tensor.numel() * tensor.element_size()
    pages = (ctypes.c_ubyte * (-(-length // page)))()
    assert libc.mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(length), pages) == 0
    return sum(flag & 1 for flag in pages) / len(pages)


def test_populate_keeps_contents():
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=generator)
    before = tensor.clone()
    assert populate(tensor)
    assert torch.equal(tensor, before)


def test_populate_maps_untouched_pages():
    memory = mmap.mmap(-1, 16 << 20)  # fresh anonymous pages: none mapped yet
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    assert _resident_fraction(tensor) == 0.0
    assert populate(tensor)
    assert _resident_fraction(tensor) == 1.0
    del tensor


def test_background_populate_while_writing():
    """The engine writes KV while the thread populates: every write must survive."""
    tensor = torch.empty(32 << 20, dtype=torch.uint8)
    thread = populate_in_background(tensor)
    assert thread is not None
    tensor[::4096].fill_(7)
    thread.join()
    assert bool((tensor[::4096] == 7).all())


def test_populate_off_cpu_tensors_is_a_no_op():
    meta = torch.empty(1024, device="meta")
    assert not populate(meta)
    assert populate_in_background(meta) is None


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


@pytest.mark.skipif(not _thp_available(), reason="transparent huge pages are off")
def test_the_pool_is_advised_into_huge_pages_and_keeps_its_contents():
    tensor = torch.empty(16 << 20, dtype=torch.uint8)
    tensor[::4096] = 3  # written before the advice: must survive it and the prefault
    assert advise_huge_pages(tensor)
    aligned = -(-tensor.data_ptr() // (2 << 20)) * (2 << 20)
    assert "hg" in vm_flags(aligned)  # MADV_HUGEPAGE set on the mapping
    assert populate(tensor)
    assert bool((tensor[::4096] == 3).all())


def test_huge_page_advice_skips_tensors_without_a_whole_huge_page():
    assert not advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))  # no aligned 2 MiB inside
    assert not advise_huge_pages(torch.empty(1024, device="meta"))


def test_a_waiter_helps_the_background_thread_and_every_page_is_mapped():
    memory = mmap.mmap(-1, 64 << 20)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    thread = populate_in_background(tensor)
    thread.finish()  # populates beside the thread, then joins it
    assert not thread.is_alive() and not thread.chunks.failed
    assert thread.chunks.take() is None  # nothing left to hand out
    assert _resident_fraction(tensor) == 1.0
    del tensor


def test_chunks_go_by_their_offset_in_a_plane_so_every_plane_starts_first():
    start, plane, planes = 4096, 5 * _CHUNK + 12288, 6  # planes not aligned to chunks, as in a pool
    end = start + planes * plane
    chunks = _ranges(start, end, planes)
    assert sorted(chunks) == [(a, min(a + _CHUNK, end) - a) for a in range(start, end, _CHUNK)]
    covered = [(a - start, a - start + length) for a, length in chunks]
    for p in range(planes):  # every plane's first block is in one of the first `planes` ranges
        assert any(lo <= p * plane < hi for lo, hi in covered[:planes])
    in_plane = [0 if lo // plane != (hi - 1) // plane else lo % plane for lo, hi in covered]
    assert in_plane == sorted(in_plane)  # then by the offset in their plane: low blocks first


_MALLOC_PRELUDE = (
    "import ctypes, os\n"
    "from llmserve.worker.malloc_tuning import keep_large_allocations_on_the_heap, release_free_heap\n"
    "libc = ctypes.CDLL('libc.so.6'); libc.malloc.restype = ctypes.c_void_p\n"
)


def _fresh_process(code: str) -> str:
    """stdout of `code` in a fresh interpreter (malloc's settings are the process's)."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", _MALLOC_PRELUDE + code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.process
@pytest.mark.parametrize("tuned", [False, True])
def test_the_engine_process_keeps_large_allocations_on_the_heap(tuned):
    """With the settings a 64 MiB allocation comes from the heap; by default it is a mapping of its own."""
    code = (
        f"assert {tuned} is False or keep_large_allocations_on_the_heap()\n"
        "address = libc.malloc(64 << 20)\n"
        "heap = [line for line in open('/proc/self/maps') if '[heap]' in line][0].split()[0].split('-')\n"
        "print(int(heap[0], 16) <= address < int(heap[1], 16))\n"
    )
    assert _fresh_process(code) == str(tuned)


@pytest.mark.process
def test_freed_heap_memory_goes_back_after_the_loading():
    """With the settings a freed 256 MiB stays resident (kept for the next step) until
    `release_free_heap`, which the engine process calls once the model is loaded."""
    code = (
        "assert keep_large_allocations_on_the_heap()\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') >> 20\n"
        "keep = libc.malloc(1 << 20)\n"
        "big = libc.malloc(256 << 20); ctypes.memset(big, 1, 256 << 20)\n"
        "guard = libc.malloc(1 << 20)  # above it: the freed block is not the heap's top\n"
        "libc.free(ctypes.c_void_p(big)); held = rss()\n"
        "release_free_heap(); print(held - rss())\n"
    )
    assert int(_fresh_process(code)) > 200  # MiB given back
