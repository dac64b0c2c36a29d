"""What a loaded model holds in memory, measured once at start-up (log line and `/server_info`).

The weights' bytes are those of the model's unique storages: every parameter, buffer and tensor
attribute of its modules (the packed kernel copies: `small_batch_weight`, `packed_weight`, which the
fused decode stack reads too), each storage counted once, so tied or shared tensors count once and a
view counts its whole storage. The KV pool's tensors are left out (`exclude`). The process's resident
set comes from /proc/self/statm (Linux; None elsewhere).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReport:
    weights_memory_bytes: int  # the model's unique tensor storages, packed copies included
    weights_file_bytes: int | None  # the GGUF file, or a directory's *.safetensors; None: neither
    engine_resident_bytes: int | None  # the engine process's resident set (rank 0's); None off Linux


def _storage_key(tensor: torch.Tensor) -> tuple[object, int]:
    """(key, bytes) of the memory behind `tensor`: its storage's, or for an opaque (oneDNN-blocked)
    tensor, which has no storage to ask, the tensor's own."""
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return ("opaque", id(tensor)), tensor.numel() * tensor.element_size()
    return (tensor.device, storage.data_ptr()), storage.nbytes()


def module_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    for module in model.modules():
        yield from (t for t in module._parameters.values() if t is not None)
        yield from (t for t in module._buffers.values() if t is not None)
        yield from (t for t in vars(module).values() if isinstance(t, torch.Tensor))


def unique_storage_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
    """The bytes of the distinct storages behind `tensors`, less those behind `exclude`."""
    excluded = {_storage_key(t)[0] for t in exclude}
    sizes = dict(_storage_key(t) for t in tensors)
    return sum(size for key, size in sizes.items() if key not in excluded and size > 0)


def weights_memory_bytes(model: nn.Module, exclude: Iterable[torch.Tensor] = ()) -> int:
    """The bytes `model`'s weights hold (module docstring); `exclude`: the KV pool."""
    return unique_storage_bytes(module_tensors(model), exclude)


def weight_count(model: nn.Module) -> int:
    """The weights `model`'s forward multiplies by: its parameters, and the linear layers held only in a
    packed or quantized copy (no `weight` parameter), counted as in_features x out_features."""
    count = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        linear = hasattr(module, "in_features") and hasattr(module, "out_features")
        if linear and getattr(module, "weight", None) is None:
            count += module.in_features * module.out_features
    return count


def weights_file_bytes(path: str) -> int | None:
    """The size of a single-file model (GGUF), or of a directory's *.safetensors; None without any."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    if not os.path.isdir(path):
        return None
    names = [name for name in os.listdir(path) if name.endswith(".safetensors")]
    return sum(os.path.getsize(os.path.join(path, name)) for name in names) if names else None


def resident_bytes() -> int | None:
    """This process's resident set: /proc/self/statm's resident pages times the page size (Linux)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def measure_memory(model: nn.Module, path: str, exclude: Iterable[torch.Tensor] = ()) -> MemoryReport:
    return MemoryReport(weights_memory_bytes(model, exclude), weights_file_bytes(path), resident_bytes())


def log_memory_report(report: MemoryReport, path: str) -> None:
    """One line: the weights in memory, the file(s) they came from, the process's resident set."""
    mib = 2**20
    files = "the GGUF file" if path.endswith(".gguf") else "the model file"
    files = "the weights files" if os.path.isdir(path) else files
    size = report.weights_file_bytes
    file_part = "" if size is None else f" ({files}: {size / mib:.1f} MiB)"
    resident = report.engine_resident_bytes
    resident_part = "unknown" if resident is None else f"{resident / mib:.0f} MiB"
    logger.info(
        "model: %.1f MiB of weights in memory%s; engine process resident: %s",
        report.weights_memory_bytes / mib,
        file_part,
        resident_part,
    )
