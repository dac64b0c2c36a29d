"""Prompt lookup decoding: when the last n tokens occurred earlier in the prompt or output, propose the
tokens that followed that occurrence. Free to run (no model), and right surprisingly often on code,
extraction, summaries and any text that quotes its context.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_NO_MATCH = -1  # padding that equals no token id


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, num_drafts: int) -> np.ndarray:
        """Up to `num_drafts` tokens (none without a match of at least `min_n`).

        The longest suffix match wins (n from max_n down to min_n), and among equally long matches the
        latest, as recent context predicts best. The continuation is copied LZ77-style: when it runs
        into the end of the sequence it continues from its own start, so a repeating loop of period p
        still yields `num_drafts` tokens.
        """
        length = len(token_ids)
        max_n = min(self.max_n, length - 1)
        if max_n < self.min_n or num_drafts < 1:
            return token_ids[:0]
        match_len = self._match_lengths(token_ids, max_n)
        best = int(match_len.max())
        if best < self.min_n:
            return token_ids[:0]
        end = len(match_len) - 1 - int(np.argmax(match_len[::-1] == best))  # latest end of a best match
        start = end + 1
        return token_ids[start + np.arange(num_drafts) % (length - start)]

    @staticmethod
    def _match_lengths(token_ids: np.ndarray, max_n: int) -> np.ndarray:
        """For each earlier position e: how many tokens ending at e equal the sequence's last (<= max_n).

        One [length - 1, max_n] comparison of sliding windows against the suffix; the match length is
        the run of equal tokens counted back from the window's end.
        """
        padded = np.concatenate([np.full(max_n - 1, _NO_MATCH, dtype=token_ids.dtype), token_ids[:-1]])
        windows = sliding_window_view(padded, max_n)  # row e: the max_n tokens ending at position e
        equal = windows == token_ids[-max_n:]
        return np.cumprod(equal[:, ::-1], axis=1).sum(axis=1)
