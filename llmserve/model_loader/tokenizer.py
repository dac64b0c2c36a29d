"""The tokenizer and chat template, from an HF directory or a GGUF's metadata (via transformers)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from llmserve.model_loader import cache
from llmserve.model_loader.errors import ModelLoadError

logger = logging.getLogger("llmserve")


class Tokenizer:
    """A thin wrapper over a transformers fast tokenizer with the calls the engine needs."""

    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.vocab_size = len(hf_tokenizer)
        self.all_special_ids = list(hf_tokenizer.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation rendered with the model's chat template."""
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use plain completions")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError("each message needs a 'role' and a 'content'")
        text = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(path: str, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path) if os.path.isdir(path) else _gguf_tokenizer(path)
    except ModelLoadError:
        raise
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds for a bad tokenizer
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({error})") from None
    eos = eos_token_ids or ((hf.eos_token_id,) if hf.eos_token_id is not None else ())
    return Tokenizer(hf, tuple(eos))


def _gguf_tokenizer(path: str):
    """Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached."""
    from transformers import AutoTokenizer

    entry = cache.entry_path(path, "tokenizer")
    if entry.is_dir():
        return AutoTokenizer.from_pretrained(entry)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(dir=entry.parent, prefix=".tokenizer-")
    hf.save_pretrained(staging)
    try:
        os.rename(staging, entry)
    except OSError:  # another process cached it first
        shutil.rmtree(staging, ignore_errors=True)
    return hf
