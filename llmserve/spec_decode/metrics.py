"""Counters of speculative decoding, engine-wide and per request (the same class for both).

In the paper's terms a verification step of one request proposes k drafts, accepts the leading a of
them and adds one more token (the recovered token at the first rejection, or the bonus token when all
k were accepted), so it yields a + 1 tokens for one target forward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps (one request, one step) that had at least one draft
    num_draft_tokens: int = 0  # draft tokens proposed and verified
    num_accepted_tokens: int = 0  # draft tokens the target accepted

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def __add__(self, other: SpecDecodeStats) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification step: accepted drafts plus the recovered or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
