"""One request's position in its grammar, kept in step with the tokens each logits row follows.

The state is derived from tokens, never pushed by the engine: before a row's mask is filled the
matcher is brought to that row's tokens (`sync`), accepting what is new and rolling back what is
not there any more. That covers every path with one rule: a sampled token is accepted at the next
step; a speculative verify row j follows the output plus j drafts (a draft the grammar refuses makes
the later rows moot: its own row gives it probability 0, so it is rejected); rejected drafts roll
back; a request resumed after a recompute preemption replays its output on a fresh matcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import xgrammar


class GrammarState:
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.tokens: list[int] = []  # the output tokens the matcher has accepted, in order

    def sync(self, target: Sequence[int]) -> bool:
        """Bring the matcher to `target` (the output tokens a row follows); False when the grammar
        refuses one of them (the matcher stays at the longest accepted prefix)."""
        tokens = self.tokens
        common = len(tokens)
        if len(target) < common or target[:common] != tokens:
            common = _common_prefix(tokens, target)
            self.matcher.rollback(len(tokens) - common)
            del tokens[common:]
        for token in target[common:]:  # one token a step; more after drafts or a resumption
            if not self.matcher.accept_token(token):
                return False
            tokens.append(token)
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """The tokens allowed next into bitmask[row] (1 bit per token); False, leaving the row as it is,
        after the end of sequence (a row a drafter runs past it: moot)."""
        if self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (a rollback: rejected drafts)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
