"""Triton's kernels on CPU tensors, by its interpreter, for the test modules of the CUDA path.

Triton decides when a kernel is defined (`@triton.jit`) whether the interpreter runs it; tests/conftest.py
switches it on at the start of a CPU run. A module whose tensors are always on the CPU calls
`use_interpreter(always=True)`, which also defines llmserve's Triton kernels again where they were
defined compiled. A module that runs the kernels takes the `triton_loop_bounds` fixture (import it).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

TEST_DEVICE = os.environ.get("LLMSERVE_TEST_DEVICE", "cpu")
KERNEL_MODULES = (
    "llmserve.kernels.triton.elementwise",
    "llmserve.kernels.triton.lora",
    "llmserve.kernels.triton.paged_attention",
    "llmserve.kernels.triton.quantized_linear",
)


def use_interpreter(always: bool = False) -> None:
    """On the CPU (or `always`: a test of CPU tensors only): interpret every llmserve Triton kernel,
    those already defined included."""
    if TEST_DEVICE != "cpu" and not always:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    for name in KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


@pytest.fixture(autouse=True)
def triton_loop_bounds(monkeypatch):
    """Triton 3.6's interpreter makes a tensor loop bound an int with int(array), which numpy 2.4
    refuses for the 1-element arrays its scalars are; `.item()` is what it means (interpreted only)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
