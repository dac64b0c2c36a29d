"""The model's CPU weights gathered into one mapping of transparent huge pages, once loaded.

A decode step at batch 1 streams every weight once. Where loading leaves them (the heap's 4 KiB pages,
worker/malloc_tuning.py: a few hundred tensors, each layer's own), that stream crosses a page every
4 KiB: a TLB miss each time, and the hardware prefetchers, which stop at page boundaries, start over.
In one private anonymous mapping advised into 2 MiB pages (`MADV_HUGEPAGE`: most distributions enable
THP only where advised, as for the KV pool, worker/prefault.py) the same kernels read the same bytes
faster (batch-1 decode, alternated runs: the commit that added it gives the figures).

Storage by storage, every tensor of the model that views one is pointed at its copy (`Tensor.set_`), so
views keep sharing (a tied embedding's packed head, fused projections) and the old memory is freed. A
storage moves only where those tensors are all that hold it (its use count says so): a tensor outside
the model, or a C++ object holding one, would go on reading the old copy, so such a storage stays.
Nothing moves where the copy could not be huge pages (THP off, not Linux) or where two chunks of it
would not fit in the memory available: the mapping is faulted in a chunk ahead of the copy and the heap
given back a chunk behind it, so the move never holds both copies of the model at once.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator

import torch
from torch import nn

from llmserve.worker.malloc_tuning import release_free_heap
from llmserve.worker.memory_report import module_tensors
from llmserve.worker.prefault import advise_huge_pages, populate_in_background

logger = logging.getLogger("llmserve")

_HUGE_PAGE = 2 << 20
_ALIGN = 64  # each storage's start: a cache line, and a multiple of every element size
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_CHUNK = 256 << 20  # of the mapping faulted in ahead of the copy, and of old copies freed between trims


def _huge_pages_on() -> bool:
    """Whether the OS gives advised mappings transparent huge pages (Linux, THP not `never`)."""
    try:
        with open(_THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:  # not Linux, or a kernel without THP
        return False


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where there is none."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """A private anonymous mapping with `nbytes` from a 2 MiB boundary, advised into huge pages (not yet
    faulted in: `_populate`), and that boundary's offset in it; None where the OS refuses.
    `torch.frombuffer(mapping, ..., offset=...)` views it, each storage holding the mapping."""
    span = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    try:  # private: a shared anonymous mapping is shmem, whose huge pages are configured apart
        mapping = mmap.mmap(-1, span + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as error:
        logger.warning("weights: no mapping of %.1f MiB for huge pages (%s)", nbytes / 2**20, error)
        return None
    start = -torch.frombuffer(mapping, dtype=torch.uint8).data_ptr() % _HUGE_PAGE
    pages = torch.frombuffer(mapping, dtype=torch.uint8, count=span, offset=start)
    if not advise_huge_pages(pages, label="weights"):
        return None
    return mapping, start


def _populate(pages: torch.Tensor) -> None:
    """Fault `pages` in (this thread and a helper, as the KV pool's prefault finishes) before a copy
    writes them: half the time of faulting them one by one as it goes."""
    prefault = populate_in_background(pages, label="weights")
    if prefault is not None:
        prefault.finish()


def _storages(model: nn.Module) -> Iterator[tuple[torch.UntypedStorage, list[torch.Tensor]]]:
    """Each CPU storage behind the model's tensors, with the tensors that view it."""
    holders: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for found in module_tensors(model):
        tensor = found
        while tensor is not None:  # a view's base holds its storage too
            if id(tensor) in seen or tensor.device.type != "cpu" or tensor.layout != torch.strided:
                break
            seen.add(id(tensor))
            try:
                storage = tensor.untyped_storage()
            except (NotImplementedError, RuntimeError):  # opaque (oneDNN-blocked): no storage to move
                break
            if storage.nbytes():
                holders.setdefault(storage._cdata, []).append(tensor)  # the storage itself, not its address
            tensor = tensor._base
    for tensors in holders.values():
        yield tensors[0].untyped_storage(), tensors


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _plan(model: nn.Module) -> tuple[list[tuple[list[torch.Tensor], int]], int, int]:
    """(each movable storage's tensors and its place in the mapping, the mapping's bytes, the bytes of
    the storages held outside the model); no handle on a storage outlives it, so each is freed once moved."""
    single = torch.empty(1)  # a storage one tensor holds, as counted with a Python handle on it
    handle_count = _use_count(single.untyped_storage()) - 1
    movable, total, held_elsewhere = [], 0, 0
    for storage, tensors in _storages(model):
        if _use_count(storage) == len(tensors) + handle_count:
            movable.append((tensors, total))
            total += -(-storage.nbytes() // _ALIGN) * _ALIGN
        else:
            held_elsewhere += storage.nbytes()
    return movable, total, held_elsewhere


def gather_weights(model: nn.Module) -> int:
    """Move the model's CPU weights into huge pages (module docstring); returns the bytes moved."""
    if not _huge_pages_on():
        return 0
    movable, total, held_elsewhere = _plan(model)
    available = _available_bytes()
    largest = max((tensors[0].untyped_storage().nbytes() for tensors, _ in movable), default=0)
    if total == 0 or (available is not None and available < min(2 * total, largest + 2 * _CHUNK)):
        return 0  # the largest storage's new copy beside its old one, the chunks ahead and behind
    mapped = huge_page_mapping(total)
    if mapped is None:
        return 0
    mapping, start = mapped
    span = -(-total // _HUGE_PAGE) * _HUGE_PAGE
    pages = torch.frombuffer(mapping, dtype=torch.uint8, count=span, offset=start)
    faulted = freed = 0  # the mapping's bytes faulted in; old copies' bytes freed since the last trim
    with torch.inference_mode():  # some weights are inference tensors (made under it)
        for tensors, place in movable:
            old = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
            if place + old.numel() > faulted:  # the next chunks, before the copy writes them
                end = min(span, -(-(place + old.numel()) // _CHUNK) * _CHUNK)
                _populate(pages[faulted:end])
                faulted = end
            # a storage of its own for each (the memory report counts a module's storages)
            new = torch.frombuffer(mapping, dtype=torch.uint8, count=old.numel(), offset=start + place)
            new.copy_(old)
            freed += old.numel()
            del old
            for tensor in tensors:
                tensor.set_(new.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
            if freed >= _CHUNK:  # the old copies behind, back to the OS as the move goes
                release_free_heap()
                freed = 0
    release_free_heap()  # the last old copies, freed to the heap
    logger.debug(
        "weights: %.1f MiB gathered into huge pages, %.1f MiB left where held outside the model",
        total / 2**20,
        held_elsewhere / 2**20,
    )
    return total
