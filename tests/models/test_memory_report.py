"""The loaded model's memory report (llmserve/worker/memory_report.py): unique storages, once each."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn

from llmserve.worker.memory_report import (
    MemoryReport,
    resident_bytes,
    unique_storage_bytes,
    weights_file_bytes,
    weights_memory_bytes,
)
from tests.helpers import make_tiny_llama_dir


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 160 bytes
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage
        self.register_buffer("scale", torch.ones(3))  # 12 bytes
        self.packed = torch.zeros(5)  # a plain tensor attribute (a kernel's packed copy): 20 bytes
        self.view = self.embed.weight.detach()[2:]  # a view of a counted storage: nothing more


def test_a_tied_weight_counts_once_and_buffers_and_packed_copies_count():
    assert weights_memory_bytes(_Tied()) == 160 + 12 + 20


def test_an_excluded_storage_and_its_views_are_left_out():
    pool = torch.zeros(2, 8)
    model = _Tied()
    model.cache = pool[1]  # a KV view bound to a layer
    assert weights_memory_bytes(model, exclude=(pool,)) == 160 + 12 + 20
    assert unique_storage_bytes([pool[0], pool[1], pool]) == 64


def test_file_bytes_and_resident_set(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "b.safetensors").write_bytes(b"x" * 5)
    (tmp_path / "config.json").write_bytes(b"{}")
    assert weights_file_bytes(str(tmp_path)) == 15
    assert weights_file_bytes(str(tmp_path / "config.json")) == 2
    assert weights_file_bytes(str(tmp_path / "missing")) is None
    if os.path.exists("/proc/self/statm"):
        assert resident_bytes() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_measures_its_model_once(tmp_path, dtype):
    from llmserve.config import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine

    path = make_tiny_llama_dir(str(tmp_path / "tiny"))
    engine = LLMEngine(EngineArgs(model=path, dtype=dtype, kv_cache_memory="4MiB"))
    report = engine.memory
    assert isinstance(report, MemoryReport)
    model = engine.model_runner.model
    # independently: the distinct storages of the parameters and buffers (the tied head once)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()
    }
    kv = engine.model_runner.kv_cache.untyped_storage().data_ptr()
    assert kv not in storages
    assert report.weights_memory_bytes >= sum(storages.values())
    assert report.weights_memory_bytes == weights_memory_bytes(model, (engine.model_runner.kv_cache,))
    files = sum(os.path.getsize(name) for name in glob.glob(os.path.join(path, "*.safetensors")))
    assert report.weights_file_bytes == files
    # float32 on disk, a bf16 model holds about half; both add the kernels' packed copies (tied head too)
    low, high = (0.95, 4.0) if dtype == "float32" else (0.45, 2.0)
    assert low * files <= report.weights_memory_bytes <= high * files, (report, files)
    if os.path.exists("/proc/self/statm"):
        assert report.engine_resident_bytes > report.weights_memory_bytes
