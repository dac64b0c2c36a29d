"""Incremental detokenization: text from a growing token list in O(1) per token, and stop strings.

Tokens do not map to characters: a multi-byte character can be split across tokens, and a token's
text can depend on its neighbours (leading spaces). So each step decodes a short window of recent
tokens twice, with and without the new ones, and appends the difference (the prefix-offset /
read-offset technique). A window whose text ends in U+FFFD ends mid-character: it is held back until
a later token completes it.
"""

from __future__ import annotations

from typing import Protocol

from llmserve.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context, so the first output token is spaced right


class SupportsDecode(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """One request's output text, extended token by token, cut at the first stop string (before it,
    or after it with `include_stop_str_in_output`)."""

    def __init__(
        self, tokenizer: SupportsDecode, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = list(params.stop)
        self.max_stop_len = max(map(len, self.stop), default=0)
        self.include_stop = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string that ended the text, once one has
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._token_ids = context  # prompt context + output; only the window past prefix_offset is decoded
        self._prefix_offset = 0  # window start: tokens decoded for context only
        self._read_offset = len(context)  # tokens before this are already in output_text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append new tokens' text; return the stop string if one now occurs (text cut before it)."""
        if self.stop_reason is not None:
            return None  # the text ended at a stop string; later tokens are not part of it
        self._token_ids.extend(new_token_ids)
        previous_len = len(self.output_text)
        self.output_text += self._decode_new_text()
        return self._check_stop(previous_len)

    def get_text(self, finished: bool) -> str:
        """Text safe to show: while unfinished, a tail that could start a stop string is held back."""
        if finished or self.stop_reason is not None or not self.stop:
            return self.output_text  # final: nothing more can complete a stop string
        return self.output_text[: len(self.output_text) - self._partial_stop_len()]

    def _decode_new_text(self) -> str:
        window = self._token_ids[self._prefix_offset :]
        read = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:read])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still split across tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop(self, previous_len: int) -> str | None:
        """Earliest stop string in the new text; earlier text was already searched on earlier steps."""
        if not self.stop or len(self.output_text) == previous_len:
            return None
        start = max(previous_len - self.max_stop_len + 1, 0)
        hits = [(index, stop) for stop in self.stop if (index := self.output_text.find(stop, start)) >= 0]
        if not hits:
            return None
        index, stop = min(hits, key=lambda hit: hit[0])
        self.output_text = self.output_text[: index + (len(stop) if self.include_stop else 0)]
        self.stop_reason = stop
        return stop

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of output_text that is a proper prefix of some stop string."""
        text = self.output_text
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
