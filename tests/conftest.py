"""Suite-wide policy: a compiled-kernel build that fails fails the tests; it never skips them quietly.

A test that needs the compiled CPU kernels (llmserve/kernels/cpu_ops.py) carries the `cpu_kernels`
mark, naming the instruction sets its kernel needs, if any (keys of CPU_FEATURES):

    pytestmark = pytest.mark.cpu_kernels
    @pytest.mark.cpu_kernels("avx512_bf16")

- The kernels did not build (`load_cpu_ops()` is None): the run stops before any test, exit status 1,
  with the build's error. On a machine without a C++ compiler, set LLMSERVE_ALLOW_NO_KERNELS=1: those
  tests are then skipped with a reason naming the variable, and the rest run on the PyTorch fallbacks.
  CI (.ci/run) never sets it.
- The kernels built but their instruction-set level (llmserve/config/cpu_isa.py: the CPU's best, or
  a lower one forced by LLMSERVE_CPU_ISA) lacks an instruction set a test names: that test is skipped,
  a hardware limit rather than a failure, and `make test` prints the reason (-rs), naming the
  instruction set and the level. Every other test passes on any x86-64 CPU with AVX2 and FMA, and at
  every level such a CPU can be forced to.

The fast tier (`make test`) leaves out the tests marked as starting processes (PROCESS_MARKS, the
markers in pyproject.toml). A test without such a mark that starts one of this project's processes (an
`llmserve` command, a Python child running llmserve's or the tests' code) fails, saying to mark it.
"""

from __future__ import annotations

import logging
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest

ALLOW_NO_KERNELS = "LLMSERVE_ALLOW_NO_KERNELS"

# The CUDA path's Triton kernels run on CPU tensors by Triton's interpreter (tests/triton_interpreter.py).
# Triton fixes that when a kernel is defined, its own library's included, and torch itself may import
# triton at any time, so it is switched on before anything runs; LLMSERVE_TEST_DEVICE=cuda compiles.
if os.environ.get("LLMSERVE_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
PROCESS_MARKS = ("process", "server", "ray", "browser")


def _bf16_prefill(ops: ModuleType) -> bool:
    """The bf16 prefill attention kernel's bf16 products (without AVX-512 BF16 it runs in float32)."""
    import torch

    return ops.prefill_attention_path(torch.bfloat16) in ("avx512_bf16", "amx")


# mark argument -> (what the CPU must have, whether this build's kernels have it here). A mark names
# the kernels a test runs, whose check is the one the engine makes before taking them; several
# kernels need no more than AVX2 and FMA.
CPU_FEATURES: dict[str, tuple[str, Callable[[ModuleType], bool]]] = {
    "avx2": ("AVX2 and FMA", lambda ops: ops.small_batch_linear_f32_supported()),
    "bf16_linear": ("AVX2 and FMA", lambda ops: ops.small_batch_linear_supported()),
    "int8_linear": ("AVX2 and FMA", lambda ops: ops.small_batch_linear_int8_supported()),
    "avx512_bf16": ("AVX-512 BF16", _bf16_prefill),  # the bf16 prefill attention kernel
    "amx_bf16": ("AMX (BF16 tiles)", lambda ops: ops.prefill_attention_amx_supported()),
    # PyTorch's own oneDNN, whose bf16 GEMM the layers take above the kernels' rows
    "onednn_bf16": ("oneDNN's bf16 GEMM (AVX-512; ONEDNN_MAX_CPU_ISA caps it)", lambda ops: _onednn_bf16()),
}


def _onednn_bf16() -> bool:
    import torch

    from llmserve.kernels.small_batch_linear import pack_for_onednn

    return pack_for_onednn(torch.ones(32, 32, dtype=torch.bfloat16)) is not None


class _BuildErrors(logging.Handler):
    """Keeps the warning `load_cpu_ops` logs when the build fails: pytest shows no log records from
    collection, which is where test modules first load the kernels."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.funcName == "load_cpu_ops":
            self.messages.append(record.getMessage())


_build_errors = _BuildErrors()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cpu_kernels(*features): needs the compiled CPU kernels and these CPU features (tests/conftest.py)",
    )
    logging.getLogger("llmserve").addHandler(_build_errors)


def pytest_unconfigure(config: pytest.Config) -> None:
    logging.getLogger("llmserve").removeHandler(_build_errors)


def _no_kernels_allowed() -> bool:
    return os.environ.get(ALLOW_NO_KERNELS, "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needing = [item for item in items if item.get_closest_marker("cpu_kernels") is not None]
    if not needing:
        return  # no kernel test selected: nothing is built
    from llmserve.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        _without_kernels(needing)
        return
    for item in needing:
        for feature in _features(item):
            name, supported = CPU_FEATURES[feature]
            if not supported(ops):
                item.add_marker(pytest.mark.skip(reason=_lacks(name)))


def _lacks(instruction_set: str) -> str:
    from llmserve.config.cpu_isa import FORCE_VARIABLE, is_forced, selected_level

    level = selected_level().name
    if is_forced():
        return f"the kernels' level {level} ({FORCE_VARIABLE}={level}) lacks {instruction_set}"
    return f"this CPU lacks {instruction_set} (a hardware limit: the kernels built for its level {level})"


def _without_kernels(needing: list[pytest.Item]) -> None:
    """Stop the run (the default), or skip the kernel tests where the opt-out says so."""
    if not _no_kernels_allowed():
        error = "\n".join(_build_errors.messages) or "(no warning was logged: see load_cpu_ops)"
        pytest.exit(
            f"the compiled CPU kernels did not build, and {len(needing)} selected tests need them.\n"
            f"{error}\n"
            f"Fix the build, or on a machine without a C++ compiler set {ALLOW_NO_KERNELS}=1 "
            "to skip those tests instead (tests/conftest.py).",
            returncode=1,
        )
    skip = pytest.mark.skip(reason=f"the compiled CPU kernels did not build and {ALLOW_NO_KERNELS} is set")
    for item in needing:
        item.add_marker(skip)


def _features(item: pytest.Item) -> set[str]:
    features = {feature for mark in item.iter_markers("cpu_kernels") for feature in mark.args}
    unknown = features - CPU_FEATURES.keys()
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: unknown cpu_kernels features {sorted(unknown)}")
    return features


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request, monkeypatch):
    """Refuse this project's processes to a test without a PROCESS_MARKS mark (module docstring).
    Fixtures of a wider scope start before this one: their processes are not seen here."""
    if any(request.node.get_closest_marker(mark) for mark in PROCESS_MARKS):
        return
    start, popen_init = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def guarded_start(process):
        target = getattr(process, "_target", None)
        if getattr(target, "__module__", "").startswith(("llmserve", "tests")):
            _refuse(request.node, f"a process running {target.__module__}.{target.__qualname__}")
        start(process)

    def guarded_popen_init(popen, args, *rest, **kwargs):
        if _runs_llmserve(args):
            _refuse(request.node, f"the command {args}")
        popen_init(popen, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen_init)


def _runs_llmserve(args) -> bool:
    """An `llmserve` command, or Python running `-m llmserve...` or a `-c` script importing it."""
    argv = [os.fsdecode(arg) for arg in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    if not argv or os.path.basename(argv[0]) == "llmserve":
        return bool(argv)
    python = argv[0] == sys.executable or os.path.basename(argv[0]).startswith("python")
    return python and any(
        arg.startswith("llmserve") or "import llmserve" in arg or "from llmserve" in arg for arg in argv[1:]
    )


def _refuse(item: pytest.Item, what: str) -> None:
    raise AssertionError(
        f"{item.nodeid} starts {what}: mark it process, server, ray or browser (pyproject.toml), "
        "so that the fast tier (make test) leaves it out"
    )


@pytest.fixture(scope="session")
def hf_model_fp32():
    """transformers' own float32 loading of the default GGUF, the suite's reference model: loaded once
    (its GGUF parsing takes seconds), shared read-only by every test that compares against it."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmserve.model_loader import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
