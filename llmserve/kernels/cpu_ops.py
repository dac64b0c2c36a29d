"""The compiled CPU kernels (paged attention, small-batch bf16 linear), built once per machine with
torch's C++ extension loader.

`make venv` builds them during set-up (so the first `llmserve serve` does not wait for a compiler);
if compilation fails the engine falls back to the pure-PyTorch reference backend and says so.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("llmserve")

_SOURCES = [
    str(Path(__file__).parent / "csrc" / name) for name in ("module.cpp", "paged_attention.cpp", "linear.cpp")
]


@functools.cache
def load_cpu_ops() -> ModuleType | None:
    """The compiled module, or None (with a warning) if it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        # torch finds `ninja` on PATH; the pinned one lives beside this interpreter in the venv.
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        os.environ.setdefault(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "llmserve" / "torch_extensions")
        )
        return load(
            name="llmserve_cpu_ops",
            sources=_SOURCES,
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # noqa: BLE001 - any build failure means "use the fallback"
        logger.warning("compiled CPU attention unavailable (%s); using the torch reference backend", error)
        return None
