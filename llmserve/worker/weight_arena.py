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
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.worker.memory_report import module_tensors, weights_file_bytes
from llmserve.worker.prefault import advise_huge_pages, populate, populate_in_background

logger = logging.getLogger("llmserve")

_HUGE_PAGE = 2 << 20
_ALIGN = 64  # each storage's start: a cache line, and a multiple of every element size


class WeightArena:
    """A private anonymous mapping of whole 2 MiB pages (from a 2 MiB boundary) for a model's weights,
    advised into huge pages and mapped in before the copy writes it: on a daemon thread while the model
    loads (`reserve_weight_arena`), or at once (`gather_weights` without a reserved one). A fresh huge
    page can cost milliseconds on a VM, and the KV pool's prefault competes for them: mapped in after
    loading, they lengthen the start-up; beside it, loading hides them."""

    def __init__(self, nbytes: int, background: bool) -> None:
        self.nbytes = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        # private (a shared anonymous mapping is shmem, whose huge pages are configured apart), a huge
        # page more than asked so that the aligned part holds all of it
        self.mapping = mmap.mmap(-1, self.nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.start = -torch.frombuffer(self.mapping, dtype=torch.uint8).data_ptr() % _HUGE_PAGE
        pages = self.bytes(0, self.nbytes)
        self.prefault = populate_in_background(pages) if background else None
        if not background and advise_huge_pages(pages):
            populate(pages)

    def bytes(self, offset: int, count: int) -> torch.Tensor:
        """uint8 [count] from `offset`, a storage of its own (the memory report counts storages) that
        holds the mapping."""
        return torch.frombuffer(self.mapping, dtype=torch.uint8, count=count, offset=self.start + offset)

    def trim(self, used: int) -> None:
        """Give back the whole pages past the first `used` bytes (a reservation's margin)."""
        end = -(-used // _HUGE_PAGE) * _HUGE_PAGE
        if end < self.nbytes:
            self.mapping.madvise(mmap.MADV_DONTNEED, self.start + end, self.nbytes - end)

    def release(self) -> None:
        """Stop mapping pages in (the arena goes unused: its mapping goes with the last reference)."""
        if self.prefault is not None:
            self.prefault.chunks.stop()
            self.prefault.join()


def reserve_weight_arena(config: ModelConfig) -> WeightArena | None:
    """An arena for the weights of a CPU model served at its file's size (a quantization read from
    files: a GGUF's blocks, a saved or published checkpoint), mapped in while it loads; None elsewhere
    (`gather_weights` then maps one at once) or where the OS cannot."""
    if config.device.type != "cpu" or config.quantization is None:
        return None
    from llmserve.quantization.sharding import FROM_FILES  # quantization's modules: only where quantized

    size = weights_file_bytes(config.path)
    if config.quantization.method not in FROM_FILES or not size:
        return None
    try:  # the file's size and a margin: the packed layouts add little (scales, padding)
        return WeightArena(size + size // 16 + _HUGE_PAGE, background=True)
    except OSError as error:
        logger.warning("weights: no mapping for huge pages (%s)", error)
        return None


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
                holders.setdefault(storage.data_ptr(), []).append(tensor)
            tensor = tensor._base
    for tensors in holders.values():
        yield tensors[0].untyped_storage(), tensors


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _plan(model: nn.Module) -> tuple[list[tuple[list[torch.Tensor], int]], int, int]:
    """(each movable storage's tensors and its place in the buffer, the buffer's bytes, the bytes of the
    storages held outside the model); no handle on a storage outlives it, so each is freed once moved."""
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


def gather_weights(model: nn.Module, arena: WeightArena | None = None) -> int:
    """Move the model's CPU weights into huge pages (module docstring): into `arena` where it holds them
    (reserve_weight_arena), else a new one; returns the bytes moved."""
    movable, total, held_elsewhere = _plan(model)
    if arena is not None and arena.nbytes < total:
        arena.release()
        arena = None
    if total == 0:
        return 0
    if arena is None:
        try:
            arena = WeightArena(total, background=False)
        except OSError as error:  # no address space or memory for it: the weights stay where they are
            logger.warning("weights: no mapping of %.1f MiB for huge pages (%s)", total / 2**20, error)
            return 0
    with torch.inference_mode():  # some weights are inference tensors (made under it)
        for tensors, place in movable:
            old = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
            new = arena.bytes(place, old.numel())
            new.copy_(old)
            del old
            for tensor in tensors:
                tensor.set_(new.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    arena.release()  # done where the copy came first
    arena.trim(total)
    logger.debug(
        "weights: %.1f MiB gathered into huge pages, %.1f MiB left where held outside the model",
        total / 2**20,
        held_elsewhere / 2**20,
    )
    return total
