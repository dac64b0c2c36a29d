"""The loaded model's CPU weights in one huge-page buffer (llmserve/worker/weight_arena.py): every
storage moved with all its views, none that something outside the model holds, the values and the
outputs unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmserve.config import EngineArgs
from llmserve.kernels.small_batch_linear import PackedLinear
from llmserve.model_loader import load_arch_config
from llmserve.worker import model_loading, weight_arena
from llmserve.worker.memory_report import weights_memory_bytes
from llmserve.worker.weight_arena import gather_weights, huge_page_mapping
from tests.helpers import make_tiny_llama_dir, vm_flags

_HUGE_PAGE = 2 << 20


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage
        self.register_buffer("scale", torch.arange(3.0))
        self.packed = torch.arange(5, dtype=torch.int8)  # a plain tensor attribute (a kernel's packed copy)
        self.rows = self.embed.weight.detach()[2:]  # a view of a moved storage
        self.fused = torch.arange(12.0).view(3, 4)[:, 1:]  # a view whose base only it reaches
        with torch.inference_mode():  # an inference tensor (quantized weights are made under the mode)
            self.codes = torch.arange(4, dtype=torch.int32)


@pytest.fixture
def huge_pages_on(monkeypatch):
    """The copy runs as where the OS has THP on (without it the pages are 4 KiB, the same bytes)."""
    monkeypatch.setattr(weight_arena, "_huge_pages_on", lambda: True)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _in_one_mapping(tensors: list[torch.Tensor], moved: int) -> bool:
    """Whether the tensors' storages lie in `moved` bytes from a 2 MiB boundary (gather_weights' mapping)."""
    starts = [t.untyped_storage().data_ptr() for t in tensors]
    ends = [t.untyped_storage().data_ptr() + t.untyped_storage().nbytes() for t in tensors]
    return min(starts) % _HUGE_PAGE == 0 and max(ends) - min(starts) <= moved


def test_every_storage_moves_into_one_aligned_mapping_with_all_its_views(huge_pages_on):
    model = _Tied()
    before = {name: value.clone() for name, value in vars(model).items() if isinstance(value, torch.Tensor)}
    weights = {"embed": model.embed.weight.clone(), "scale": model.scale.clone()}
    storages = {_storage(t) for t in (model.embed.weight, model.scale, model.packed)}
    report = weights_memory_bytes(model)
    moved = gather_weights(model)
    tensors = [model.embed.weight, model.head.weight, model.scale, model.packed, model.rows, model.fused]
    tensors.append(model.codes)
    assert moved > 0 and _in_one_mapping(tensors, moved)
    assert not storages & {_storage(t) for t in tensors}  # none left behind
    assert weights_memory_bytes(model) == report  # each storage its own still, of its size
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, weights["embed"]) and torch.equal(model.scale, weights["scale"])
    for name, value in before.items():
        assert torch.equal(getattr(model, name), value), name
    with torch.no_grad():
        model.embed.weight[3, 1] = 42.0
    assert model.rows[1, 1] == 42.0  # still a view of the weight, not a copy of it
    assert model.fused._base is not None and _storage(model.fused._base) == _storage(model.fused)


def test_the_move_faults_the_mapping_in_ahead_and_trims_the_heap_behind_chunk_by_chunk(
    huge_pages_on, monkeypatch
):
    """With 2 MiB chunks, a model of several storages above a chunk in all is moved with the mapping
    faulted in a chunk at a time just ahead of the copy (every byte a copy writes lies in a faulted
    range) and the heap trimmed once each chunk of old copies is freed; the values are unchanged."""
    monkeypatch.setattr(weight_arena, "_CHUNK", _HUGE_PAGE)
    model = nn.Sequential(*(nn.Linear(512, 512 + 64 * i, bias=False) for i in range(6)))  # 1-1.6 MiB each
    weights = [layer.weight.clone() for layer in model]
    faulted, trims, populate = [], [], weight_arena._populate

    def record(pages: torch.Tensor) -> None:
        faulted.append((pages.data_ptr(), pages.data_ptr() + pages.numel()))
        populate(pages)

    monkeypatch.setattr(weight_arena, "_populate", record)
    monkeypatch.setattr(weight_arena, "release_free_heap", lambda: trims.append(len(faulted)))
    moved = gather_weights(model)
    assert moved > 3 * _HUGE_PAGE and len(faulted) >= 3  # chunk by chunk, not all at once
    assert all(end - start <= 2 * _HUGE_PAGE for start, end in faulted)
    for layer, weight in zip(model, weights, strict=True):
        first, last = layer.weight.data_ptr(), layer.weight.data_ptr() + layer.weight.nbytes
        assert any(start <= first and last <= end for start, end in _merged(faulted)), "written unfaulted"
        assert torch.equal(layer.weight, weight)
    assert len(trims) >= 3 and trims[0] < len(faulted)  # trimmed while the mapping was still being faulted in


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def test_a_storage_held_outside_the_model_stays_where_it_is(huge_pages_on):
    model = _Tied()
    outside = model.scale.detach()  # another tensor on the buffer's storage, which the model does not reach
    where = model.scale.data_ptr()
    gather_weights(model)
    assert model.scale.data_ptr() == where and _storage(model.embed.weight) != _storage(model.scale)
    outside[0] = 7.0
    assert model.scale[0] == 7.0  # the two still share their memory


def test_nothing_moves_where_thp_is_off_or_the_copy_would_not_fit(monkeypatch):
    model = _Tied()
    where = model.embed.weight.data_ptr()
    monkeypatch.setattr(weight_arena, "_huge_pages_on", lambda: False)
    assert gather_weights(model) == 0
    monkeypatch.setattr(weight_arena, "_huge_pages_on", lambda: True)
    monkeypatch.setattr(weight_arena, "_available_bytes", lambda: 100)  # less than twice the weights
    assert gather_weights(model) == 0 and model.embed.weight.data_ptr() == where


def test_the_mapping_is_2mib_aligned_zeroed_and_advised_into_huge_pages():
    mapped = huge_page_mapping(3 << 20)
    if mapped is None:  # the advice refused: only where the kernel has no THP at all
        assert not weight_arena._huge_pages_on()
        return
    mapping, start = mapped
    buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=3 << 20, offset=start)
    address = buffer.data_ptr()
    assert address % _HUGE_PAGE == 0 and int(buffer.sum()) == 0
    assert "hg" in vm_flags(address)  # MADV_HUGEPAGE set on the mapping


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_loaded_model_serves_from_the_mapping_and_its_packed_copies_stay(tmp_path, monkeypatch, dtype):
    path = make_tiny_llama_dir(str(tmp_path / "tiny"))
    args = EngineArgs(model=path, dtype=dtype, max_model_len=128, kv_cache_memory="8MiB")
    config = args.create_config(load_arch_config(path), path).model
    monkeypatch.setattr(model_loading, "gather_weights", lambda model: 0)
    plain = model_loading.load_model(config)
    monkeypatch.undo()
    monkeypatch.setattr(weight_arena, "_huge_pages_on", lambda: True)
    model = model_loading.load_model(config)
    tensors = [*model.parameters(), *model.buffers()]
    padded = weights_memory_bytes(model) + 64 * len({_storage(t) for t in tensors})  # each from a cache line
    assert _in_one_mapping(tensors, padded)
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    assert bool(packed) == (dtype == "float32")
    # a PackedLinear packs again for a weight at a new address: a moved one must not look new
    monkeypatch.setattr(PackedLinear, "_pack_again", lambda self: pytest.fail("packed again"))
    ids = torch.randint(0, config.arch.vocab_size, (1, 12))
    with torch.no_grad():
        hidden, plain_hidden = model.model.embed_tokens(ids), plain.model.embed_tokens(ids)
        layer, plain_layer = model.model.layers[0].mlp, plain.model.layers[0].mlp
        assert torch.equal(layer(hidden), plain_layer(plain_hidden))
