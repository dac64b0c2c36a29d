"""The tokenizer and chat template of a model, over a transformers fast tokenizer.

For a GGUF, transformers builds the tokenizer from the vocabulary and merges in its metadata, which
takes seconds; the result is saved in the model cache (keyed like the weights) and loaded from there
on later starts in a fraction of a second.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmserve.model_loader import weights_cache
from llmserve.model_loader.default_model import is_gguf, resolve_model_path
from llmserve.model_loader.errors import ModelLoadError, describe
from llmserve.model_loader.weights import load_arch_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_TOKENIZER_DIR = "tokenizer"


class Tokenizer:
    """The tokenizer calls the engine makes; `.hf` is the underlying transformers tokenizer."""

    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...]) -> None:
        self.hf = hf
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)  # includes added tokens, unlike hf.vocab_size
        self.all_special_ids: tuple[int, ...] = tuple(hf.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation rendered by the model's chat template.

        Raises ValueError when the model has no template, a message is malformed, or the template
        itself rejects the conversation (e.g. roles out of order).
        """
        import jinja2

        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        _check_messages(messages)
        try:
            text = self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template rejected the messages: {error}") from error
        # The template writes any BOS itself; encoding must not add a second one.
        return self.encode(text, add_special_tokens=False)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list | tuple):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {index} must be a dict with a string 'role'")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {index} must have a string 'content'")


def load_tokenizer(path: str, eos_token_ids: tuple[int, ...] | None = None) -> Tokenizer:
    """The tokenizer of the GGUF file or HF directory at `path`.

    `eos_token_ids` default to the model's own stop tokens (GGUF metadata, or generation_config.json
    over config.json), then to the tokenizer's eos token.
    """
    path = resolve_model_path(path)
    hf = _load_hf_tokenizer(path)
    if eos_token_ids is None:
        eos_token_ids = load_arch_config(path).eos_token_ids
    if not eos_token_ids and hf.eos_token_id is not None:
        eos_token_ids = (hf.eos_token_id,)
    return Tokenizer(hf, tuple(eos_token_ids))


def _load_hf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        if is_gguf(path):
            return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:  # transformers raises many kinds for a missing or bad tokenizer
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({describe(error)})") from None


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """From the cache, else converted from the GGUF metadata and cached."""
    from transformers import AutoTokenizer

    cached = weights_cache.cached_dir(path, _TOKENIZER_DIR)
    if cached is not None:
        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True)
        except Exception as error:  # a damaged entry: convert again and replace it
            logger.warning("ignoring the unreadable cached tokenizer %s (%s)", cached, describe(error))
            weights_cache.discard_dir(path, _TOKENIZER_DIR)
    hf = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
    )
    weights_cache.save_dir(path, _TOKENIZER_DIR, hf.save_pretrained)
    return hf
