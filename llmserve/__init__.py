"""llmserve: an LLM inference-serving engine with a paged KV cache and continuous batching."""

from __future__ import annotations

import importlib

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "llmserve.entrypoints.llm",
    "EngineArgs": "llmserve.config",
    "SamplingParams": "llmserve.sampling_params",
    "RequestOutputKind": "llmserve.sampling_params",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
}


def __getattr__(name: str):
    """Import lazily so that `import llmserve.core...` does not load the whole engine."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
