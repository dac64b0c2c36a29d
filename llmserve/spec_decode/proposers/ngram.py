"""Prompt lookup decoding: when the last n tokens occurred earlier in the prompt or output, propose the
tokens that followed that occurrence. Free to run (no model), and right surprisingly often on code,
extraction, summaries and any text that quotes its context.
"""

from __future__ import annotations

import numpy as np

from llmserve.config.speculative import SpeculativeConfig
from llmserve.request import DraftProposal
from llmserve.spec_decode.proposer import SampledBatch

# Drafts a match of n tokens may propose: 2 ** n. How often draft j is accepted depends mostly on how
# long the matched suffix is (docs/speculative.md), while every draft costs the verify pass a row.
# Short matches therefore propose few drafts.
_DRAFTS_PER_MATCH_BASE = 2


class NgramProposer:
    """The Proposer of `--speculative-method ngram`: prompt lookup over each request's tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.lookup = PromptLookup(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, batch: SampledBatch) -> dict[str, DraftProposal | None]:
        proposals = {}
        for index, request in enumerate(batch.requests):
            k = batch.draft_limit(index, self.config.drafts_for(request.sampling_params))
            proposals[request.request_id] = self.lookup.proposal(batch, index, k)
        return proposals


class PromptLookup:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def proposal(self, batch: SampledBatch, index: int, k: int) -> DraftProposal | None:
        """Up to k drafts continuing request `index` of `batch` (one-hot q), or None without a match."""
        if k <= 0:
            return None
        drafts = self.drafts(np.asarray(batch.context(index), dtype=np.int64), k)
        return DraftProposal(batch.num_tokens(index), drafts.tolist()) if len(drafts) else None

    def drafts(self, token_ids: np.ndarray, num_drafts: int) -> np.ndarray:
        """Up to `num_drafts` tokens (none without a match of at least `min_n`), at most 2 ** n after
        a match of n tokens.

        The longest suffix match wins (n up to max_n), and among equally long matches the latest, as
        recent context predicts best. The continuation is copied LZ77-style: when it runs into the end
        of the sequence it continues from its own start, so a repeating loop of period p still yields
        its drafts.
        """
        match_len, end = self._longest_match(token_ids)
        if match_len < self.min_n or num_drafts < 1:
            return token_ids[:0]
        start = end + 1
        count = min(num_drafts, _DRAFTS_PER_MATCH_BASE**match_len)
        return token_ids[start + np.arange(count) % (len(token_ids) - start)]

    def _longest_match(self, token_ids: np.ndarray) -> tuple[int, int]:
        """(n, e): the longest n <= max_n such that the n tokens ending at an earlier position e equal
        the sequence's last n, with the latest such e; (0, -1) without a match.

        Candidates are the positions holding the last token; each round keeps those whose match
        extends one token further back, so the work is a few small array operations, not a scan per n.
        """
        last = len(token_ids) - 1
        ends = np.flatnonzero(token_ids[:last] == token_ids[last]) if last > 0 else token_ids[:0]
        if len(ends) == 0:
            return 0, -1
        length = 1
        while length < self.max_n:
            before = ends - length
            longer = ends[(before >= 0) & (token_ids[np.maximum(before, 0)] == token_ids[last - length])]
            if len(longer) == 0:
                break
            ends, length = longer, length + 1
        return length, int(ends[-1])
