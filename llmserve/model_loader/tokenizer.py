"""The tokenizer and chat template of a model, over a transformers fast tokenizer.

For a GGUF, transformers builds the tokenizer from the vocabulary and merges in its metadata, which
takes seconds; the result is saved in the model cache (keyed like the weights) and loaded from there
on later starts. That saved `tokenizer.json` is the very `tokenizers` object transformers built, so
a cached tokenizer encodes and decodes on it directly and transformers loads only when `.hf` is
first needed (the chat template): importing it and building its tokenizer takes seconds, and the
engine process, which only decodes, would pay that on the start-up's critical path
(docs/benchmarks.md, "Start-up"). An HF directory whose tokenizer is transformers' plain fast one
(`_on_backend`'s conditions) loads the same way from its own files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llmserve.model_loader import multimodal, weights_cache
from llmserve.model_loader.default_model import is_gguf, resolve_model_path
from llmserve.model_loader.errors import ModelLoadError, describe
from llmserve.model_loader.weights import load_arch_config

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_TOKENIZER_DIR = "tokenizer"


class Tokenizer:
    """The tokenizer calls the engine makes; `.hf` is the underlying transformers tokenizer.

    With a `backend` (a cached tokenizer: module docstring) encode, decode and token lookups run on
    it, and `.hf` is built by `load_hf` on first use; without one every call goes to `.hf`.
    """

    def __init__(
        self,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        vocab_size: int,
        load_hf: Callable[[], PreTrainedTokenizerBase],
        backend: tokenizers.Tokenizer | None = None,
    ) -> None:
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.vocab_size = vocab_size  # includes added tokens, unlike hf.vocab_size
        self._load_hf = load_hf
        self._hf: PreTrainedTokenizerBase | None = None
        self._backend = backend

    @classmethod
    def from_hf(cls, hf: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...]) -> Tokenizer:
        return cls(eos_token_ids, hf.bos_token_id, len(hf), lambda: hf)

    @property
    def backend(self) -> tokenizers.Tokenizer | None:
        """The `tokenizers` object encoding and decoding run on, where they do not go through `.hf`."""
        return self._backend

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        if self._hf is None:
            self._hf = self._load_hf()
        return self._hf

    def load_chat_template(self) -> None:
        """Build `.hf` (which renders the chat template) now, if it is not built yet."""
        _ = self.hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; ValueError for text the tokenizer cannot take (a lone surrogate)."""
        try:
            if self._backend is not None:
                return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        except TypeError as error:  # `tokenizers` takes only text that encodes to UTF-8
            if not isinstance(text, str):
                raise
            raise ValueError(_unencodable(text)) from error

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        if self._backend is not None:
            return [self._backend.id_to_token(token_id) for token_id in ids]
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation rendered by the model's chat template.

        Raises ValueError when the model has no template, a message is malformed, or the template
        itself rejects the conversation (e.g. roles out of order).
        """
        text = self.render_chat(messages, add_generation_prompt)
        # The template writes any BOS itself; encoding must not add a second one.
        return self.encode(text, add_special_tokens=False)

    def chat_template_text(self, override: str | None = None, tools: bool = False) -> str | None:
        """The Jinja source that renders chats: `override`, else the model's (its `tool_use` one, if it
        has named templates, when tools are given)."""
        template = override or self.hf.chat_template
        if isinstance(template, dict):
            template = template.get("tool_use" if tools else "default") or template.get("default")
        return template or None

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The conversation as the chat template (or `chat_template`, replacing it) writes it;
        `tools` and `template_kwargs` become template variables. ValueError as apply_chat_template."""
        import jinja2

        if not self.chat_template_text(chat_template):
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        _check_messages(messages)
        try:
            return self.hf.apply_chat_template(
                messages,
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except (jinja2.TemplateError, TypeError, LookupError) as error:  # the template's own checks and slips
            raise ValueError(f"the chat template rejected the messages: {error}") from error


def _unencodable(text: str) -> str:
    """Why `text` cannot be tokenized, without quoting it (a surrogate would break the JSON reply)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = text[error.start]
        return f"the text is not valid Unicode: it holds a lone UTF-16 surrogate (U+{ord(char):04X})"
    return "the tokenizer cannot encode the text"


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
    if eos_token_ids is None:
        eos_token_ids = load_arch_config(path).eos_token_ids
    if is_gguf(path):
        cached = weights_cache.cached_dir(path, _TOKENIZER_DIR)
        if cached is not None:
            try:
                load_hf = lambda: _load_cached_hf_tokenizer(path, cached)  # noqa: E731
                tokenizer = _on_backend(cached, eos_token_ids, load_hf)
            except Exception as error:  # a damaged entry: transformers' path converts again and replaces it
                logger.warning("ignoring the unreadable cached tokenizer %s (%s)", cached, describe(error))
                tokenizer = None
            if tokenizer is not None:
                return tokenizer
    else:
        try:
            tokenizer = _on_backend(Path(path), eos_token_ids, lambda: _load_hf_tokenizer(path))
        except Exception:  # noqa: BLE001 - transformers' loading below names what is wrong
            tokenizer = None
        if tokenizer is not None:
            return tokenizer
    hf = _load_hf_tokenizer(path)
    if not eos_token_ids and hf.eos_token_id is not None:
        eos_token_ids = (hf.eos_token_id,)
    return Tokenizer.from_hf(hf, tuple(eos_token_ids))


# tokenizer_config.json keys that leave transformers' plain fast tokenizer encoding and decoding
# exactly as its `tokenizers` object does; any other key (add_bos_token, add_prefix_space, legacy, ...)
# may change them, and such a tokenizer loads through transformers.
_PLAIN_CONFIG_KEYS = frozenset(
    {
        "backend",
        "tokenizer_class",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "sep_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "extra_special_tokens",
        "added_tokens_decoder",
        "clean_up_tokenization_spaces",
        "model_max_length",
        "model_input_names",
        "padding_side",
        "truncation_side",
        "is_local",
        "local_files_only",
        "chat_template",
    }
)
# The class transformers 5 writes for a tokenizer it loaded as its plain fast one: for a model type
# whose tokenizer is another class (or Mistral's), it would have loaded and saved that class instead.
_PLAIN_CLASS = "TokenizersBackend"
_ADDED_TOKEN_FLAGS = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")


def _on_backend(
    directory: Path, eos_token_ids: tuple[int, ...], load_hf: Callable[[], PreTrainedTokenizerBase]
) -> Tokenizer | None:
    """The tokenizer of `directory` (a cached GGUF conversion or an HF model directory) on its
    `tokenizers` object alone, transformers built by `load_hf` only when `.hf` is first needed; None
    where that might not be transformers' own encoding and decoding: another tokenizer class, a
    configuration key outside the plain ones or a file transformers would also read, cleaned-up
    decoding, a special token that is not one of the object's special added tokens, an added token
    whose flags differ from the object's. Raises for unreadable files."""
    import tokenizers

    config_file, tokenizer_file = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    if any((directory / name).exists() for name in ("special_tokens_map.json", "added_tokens.json")):
        return None
    config = json.loads(config_file.read_text())
    if (
        not isinstance(config, dict)
        or config.get("tokenizer_class") != _PLAIN_CLASS
        or config.get("clean_up_tokenization_spaces")
        or not set(config) <= _PLAIN_CONFIG_KEYS
    ):
        return None
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    backend.no_truncation()  # transformers turns a tokenizer.json's own off for every call
    backend.no_padding()
    added = {index: token.__getstate__() for index, token in backend.get_added_tokens_decoder().items()}
    special_added = {token["content"] for token in added.values() if token["special"]}
    declared = config.get("added_tokens_decoder", {})
    if not isinstance(declared, dict):
        return None
    for token_id, token in declared.items():  # transformers adds each again, with these flags
        present = added.get(int(token_id)) if str(token_id).isdigit() else None
        if not isinstance(token, dict) or present is None:
            return None
        if any(token.get(flag, present[flag]) != present[flag] for flag in _ADDED_TOKEN_FLAGS):
            return None
    # a null token is unset; a dict without content is malformed, so not plain
    named = {
        name: _content(token)
        for name, token in config.items()
        if name.endswith("_token") and token is not None
    }
    extra = [*_listed(config.get("additional_special_tokens")), *_listed(config.get("extra_special_tokens"))]
    if not all(isinstance(text, str) and text in special_added for text in [*named.values(), *extra]):
        return None  # transformers would add it, or mark it special
    special = {name: backend.token_to_id(content) for name, content in named.items()}
    if not eos_token_ids and special.get("eos_token") is not None:
        eos_token_ids = (special["eos_token"],)
    return Tokenizer(
        tuple(eos_token_ids),
        special.get("bos_token"),
        backend.get_vocab_size(with_added_tokens=True),
        load_hf,
        backend,
    )


def _content(token: object) -> object:
    """A configured token's text: the string, or an AddedToken dict's content."""
    return token.get("content") if isinstance(token, dict) else token


def _listed(tokens: object) -> list:
    """The texts of a configuration's extra special tokens: a list, or (transformers 5) a dict of
    named ones; [None] (not plain) for anything else."""
    if tokens is None:
        return []
    if isinstance(tokens, dict):
        tokens = list(tokens.values())
    return [_content(token) for token in tokens] if isinstance(tokens, list) else [None]


def _load_cached_hf_tokenizer(path: str, cached: Path) -> PreTrainedTokenizerBase:
    """transformers' class for the cached entry, named directly: AutoTokenizer would import the
    registry of every model transformers knows to find the same class."""
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(cached, local_files_only=True)
    except Exception as error:  # transformers raises many kinds for a bad tokenizer
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({describe(error)})") from None


def _load_hf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if is_gguf(path):
            return _gguf_tokenizer(path)
        # the plain fast class named directly: AutoTokenizer imports every model's configuration first
        plain = _tokenizer_class(path) == _PLAIN_CLASS
        loader = PreTrainedTokenizerFast if plain else AutoTokenizer
        hf = loader.from_pretrained(path, local_files_only=True)
    except Exception as error:  # transformers raises many kinds for a missing or bad tokenizer
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({describe(error)})") from None
    if not hf.chat_template:  # a multimodal model may keep its template beside its processor
        hf.chat_template = multimodal.processor_chat_template(path)
    return hf


def _tokenizer_class(directory: str) -> str | None:
    try:
        config = json.loads((Path(directory) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


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
