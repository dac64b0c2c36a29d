"""A model off the CPU never builds or loads the compiled CPU kernels: on a CUDA machine the first
start would otherwise wait a minute for a C++ build whose kernels it cannot use."""

import pytest
import torch

import llmserve.kernels.small_batch_linear as small_batch_linear
import llmserve.models.decode_stack as decode_stack
from llmserve.attention.registry import get_attention_backend
from llmserve.model_loader import load_arch_config
from llmserve.models.llama import LlamaForCausalLM
from tests.helpers import make_tiny_llama_dir


@pytest.fixture
def no_kernel_loading(monkeypatch):
    def refuse():
        raise AssertionError("the CPU kernels were loaded for a model off the CPU")

    monkeypatch.setattr(small_batch_linear, "load_cpu_ops", refuse)
    monkeypatch.setattr(decode_stack, "load_cpu_ops", refuse)


def test_a_model_off_the_cpu_neither_swaps_linears_nor_builds_a_decode_stack(tmp_path, no_kernel_loading):
    arch = load_arch_config(make_tiny_llama_dir(str(tmp_path / "tiny")))
    device = torch.device("meta")  # stands in for CUDA: any device but the CPU
    with device:
        model = LlamaForCausalLM(arch, 64, device)
    assert small_batch_linear.use_small_batch_linear(model) == 0
    assert decode_stack.build_decode_stack(model, get_attention_backend("torch")) is None
