"""Fill-in-the-middle prompts for `suffix` on /v1/completions.

A model trained for fill-in-the-middle knows three special tokens and completes the middle of
`<prefix-token> prompt <suffix-token> suffix <middle-token>` (the prefix-suffix-middle order of
StarCoder, SantaCoder, DeepSeek-Coder and Qwen2.5-Coder). A tokenizer without such tokens cannot
express the request, so `suffix` is then a 400 rather than text appended to the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

# (prefix, suffix, middle) spellings, tried in order
FIM_TOKEN_SETS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fim_token_ids(vocab: dict[str, int]) -> tuple[int, int, int] | None:
    """The prefix, suffix and middle token ids of the first set the vocabulary has whole; else None."""
    for names in FIM_TOKEN_SETS:
        if all(name in vocab for name in names):
            prefix, suffix, middle = (vocab[name] for name in names)
            return prefix, suffix, middle
    return None


def fim_prompt(
    tokens: tuple[int, int, int], prefix_ids: Sequence[int], suffix_ids: Sequence[int]
) -> list[int]:
    """Prefix-suffix-middle order: the model writes what goes between prefix and suffix."""
    prefix_token, suffix_token, middle_token = tokens
    return [prefix_token, *prefix_ids, suffix_token, *suffix_ids, middle_token]
