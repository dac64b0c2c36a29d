"""Suffix decoding (in the spirit of SuffixDecoding, Oliaro et al., 2024): where the context's last
tokens occurred before, in the request's own prompt and output or in the outputs of recent requests,
propose the continuation those occurrences share most often. Free to run (no model), and right often
on agent and coding traffic, which repeats long spans of earlier turns, tool outputs and answers.

The suffix structure is implicit: a node of the suffix tree (a string s) is the set of positions
where s occurs, its count their number, and its children the tokens that follow them. So a
request's structure is its token array and grows by appending the new tokens, never rebuilt; the
global one is the outputs of the last `max_cached_requests` finished requests in one array (a
separator after each, the oldest dropped first), with an index of each token's positions updated as
outputs are added. Drafting for a request finds every earlier occurrence of its last token (in the
global structure from the index, so without reading the tokens it keeps) and how far back each
matches (one gather), then walks down from a few match lengths, a handful of small array operations
per draft, and keeps the path whose estimated probabilities sum highest (the expected number of
accepted drafts).

A proposal is a chain, the most frequent path; `children` gives every continuation of a node with
its count, from which a token tree can be grown once the verifier takes trees.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from llmserve.config.speculative import SpeculativeConfig, SuffixDecodingConfig
from llmserve.request import DraftProposal
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.worker.request_state import CachedRequestState

SEPARATOR = -1  # ends a cached output: no match or continuation crosses it (token ids are >= 0)
# Match lengths walked per source, the longest first: a longer match predicts better but has fewer
# occurrences, whose continuations may run into the end of the text sooner; a few cover both.
MATCH_LENGTHS_TRIED = 4


class TokenBuffer:
    """A growing array (int32 tokens by default): appending is amortized O(new tokens); `view` shares
    the memory."""

    def __init__(self, capacity: int = 256, dtype: type = np.int32) -> None:
        self._data = np.empty(capacity, dtype=dtype)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        """Tokens it has room for before it grows."""
        return len(self._data)

    def view(self) -> np.ndarray:
        return self._data[: self._size]

    def extend(self, token_ids: list[int] | np.ndarray) -> None:
        size = self._size + len(token_ids)
        if size > len(self._data):
            grown = np.empty(max(size, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size : size] = token_ids
        self._size = size

    def drop_front(self, count: int) -> None:
        """Forget the first `count` tokens (one copy of the rest)."""
        rest = self._data[count : self._size].copy()
        self._data[: len(rest)] = rest
        self._size = len(rest)


class RecentOutputs:
    """The global structure: the outputs of the last `max_requests` finished requests, each followed
    by a separator, in one array; the oldest output is dropped when one more would exceed it. Each
    token's buffer positions are indexed as outputs are added, so finding a token's occurrences costs
    their number, not the tokens kept."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._buffer = TokenBuffer()
        self._start = 0  # the oldest kept output's first token in the buffer
        self._lengths: deque[int] = deque()  # each kept output's length, separator included, oldest first
        # token -> its buffer positions, ascending; those before _start are dropped at the next compaction
        self._positions: dict[int, TokenBuffer] = {}

    def __len__(self) -> int:
        """Outputs kept."""
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        """Tokens kept, separators included."""
        return len(self._buffer) - self._start

    @property
    def capacity(self) -> int:
        """Tokens its buffer has room for: its memory."""
        return self._buffer.capacity

    def tokens(self) -> np.ndarray:
        return self._buffer.view()[self._start :]

    def occurrences(self, token: int) -> np.ndarray:
        """Where `token` occurs in `tokens()`, ascending: `np.flatnonzero(tokens() == token)`."""
        positions = self._positions.get(token)
        if positions is None:
            return np.empty(0, dtype=np.int64)
        positions = positions.view()
        return positions[np.searchsorted(positions, self._start) :] - self._start

    def add(self, token_ids: np.ndarray) -> None:
        if self.max_requests == 0 or len(token_ids) == 0:
            return
        self._index(np.asarray(token_ids), len(self._buffer) + np.arange(len(token_ids), dtype=np.int64))
        self._buffer.extend(token_ids)
        self._buffer.extend([SEPARATOR])
        self._lengths.append(len(token_ids) + 1)
        while len(self._lengths) > self.max_requests:
            self._start += self._lengths.popleft()
        if self._start > len(self._buffer) // 2:  # amortized: each token is copied at most once more
            self._buffer.drop_front(self._start)
            self._start = 0
            self._positions = {}  # rebuilt for the kept tokens' new positions (amortized as the copy)
            kept = self._buffer.view()
            self._index(kept[kept != SEPARATOR], np.flatnonzero(kept != SEPARATOR))

    def _index(self, token_ids: np.ndarray, positions: np.ndarray) -> None:
        """Append each token's buffer positions (ascending, later than those it holds) to its entry."""
        order = np.argsort(token_ids, kind="stable")  # stable: each token's positions stay ascending
        tokens, firsts = np.unique(token_ids[order], return_index=True)
        for token, group in zip(tokens.tolist(), np.split(positions[order], firsts[1:]), strict=True):
            entry = self._positions.get(token)
            if entry is None:
                entry = self._positions[token] = TokenBuffer(4, np.int64)
            entry.extend(group)


@dataclass
class _History:
    """A live request's own text (prompt and output), appended to as it grows."""

    num_prompt_tokens: int
    tokens: TokenBuffer


@dataclass(frozen=True)
class Path:
    """A path down the suffix structure: its tokens and, for each, the estimated probability that the
    path so far is right (the product of each step's share of the occurrences that continue so)."""

    token_ids: list[int]
    probs: list[float]

    @property
    def score(self) -> float:
        """The expected number of drafts accepted, if the estimates hold."""
        return sum(self.probs)


NO_PATH = Path([], [])


class SuffixProposer:
    """The Proposer of `--speculative-method suffix`."""

    def __init__(self, config: SpeculativeConfig, live_requests: Mapping[str, CachedRequestState]) -> None:
        assert config.suffix is not None
        self.config = config
        self.search = SuffixSearch(config.suffix)
        self.live_requests = live_requests  # the target runner's: a request gone from it has finished
        self.recent = RecentOutputs(config.suffix.max_cached_requests)
        self._histories: dict[str, _History] = {}

    def propose(self, batch: SampledBatch) -> dict[str, DraftProposal | None]:
        self._retire_finished()
        proposals: dict[str, DraftProposal | None] = {}
        recent = self.recent.tokens()
        for index, request in enumerate(batch.requests):
            if request.num_output_tokens == 0:  # its first token leaves with this step: no work for it yet
                proposals[request.request_id] = None
                continue
            context = self._append(request, batch.new_token_ids[index])
            params = request.sampling_params
            k = batch.draft_limit(index, self.config.drafts_for(params))
            # A seeded sampling request's draws depend on its drafts: from its own text only, so that
            # its seed gives the same tokens whatever other requests ran before.
            searched = recent if params.seed is None or params.is_greedy else recent[:0]
            ends = self.recent.occurrences(int(context[-1])) if len(searched) else None
            drafts = self.search.drafts(context, searched, k, ends) if k > 0 else []
            proposals[request.request_id] = DraftProposal(batch.num_tokens(index), drafts) if drafts else None
        return proposals

    def history(self, request_id: str) -> np.ndarray | None:
        """The tokens of a live request it holds (prompt and output so far); None before its first decode."""
        history = self._histories.get(request_id)
        return None if history is None else history.tokens.view()

    def _append(self, request: CachedRequestState, new_token_ids: list[int]) -> np.ndarray:
        """The request's tokens including this step's, appending to its history what it lacks."""
        history = self._histories.get(request.request_id)
        if history is None:
            history = self._histories[request.request_id] = _History(request.num_prompt_tokens, TokenBuffer())
        known = len(history.tokens)
        if known < request.num_tokens:
            history.tokens.extend(request.all_token_ids[known:])
        history.tokens.extend(new_token_ids)
        return history.tokens.view()

    def _retire_finished(self) -> None:
        """Move the outputs of requests the target runner no longer holds into the global structure."""
        for request_id in [r for r in self._histories if r not in self.live_requests]:
            history = self._histories.pop(request_id)
            self.recent.add(history.tokens.view()[history.num_prompt_tokens :])


class SuffixSearch:
    """The continuations of a context's suffix in a text, by the suffix decoding options."""

    def __init__(self, options: SuffixDecodingConfig) -> None:
        self.options = options

    def drafts(
        self, context: np.ndarray, recent: np.ndarray, k: int, recent_ends: np.ndarray | None = None
    ) -> list[int]:
        """Up to `k` drafts to follow `context`: the best-scoring path of the context's own earlier
        text and of `recent` (the global structure's tokens); none where neither matches.
        `recent_ends`: where the context's last token occurs in `recent` (None: found by a scan)."""
        if len(context) < 2 or k < 1:
            return []
        own = self.best_path(context, np.flatnonzero(context[:-1] == context[-1]), context, k)
        if len(recent) and recent_ends is None:
            recent_ends = np.flatnonzero(recent == context[-1])
        other = self.best_path(recent, recent_ends, context, k) if len(recent) else NO_PATH
        return (other if other.score > own.score else own).token_ids

    def best_path(self, text: np.ndarray, ends: np.ndarray, context: np.ndarray, k: int) -> Path:
        """The best-scoring most frequent path after an occurrence of the context's last tokens that
        ends at a position of `ends` (ascending, where `text` holds the context's last token), tried
        from the longest match down (`MATCH_LENGTHS_TRIED` lengths at most)."""
        if len(ends) == 0:
            return NO_PATH
        depth = self.options.max_tree_depth
        lengths = match_lengths(text, ends, context, depth - 1)
        best = NO_PATH
        for length in np.unique(lengths)[::-1][:MATCH_LENGTHS_TRIED]:
            num_drafts = min(k, int(self.options.max_spec_factor * length), depth - int(length))
            if num_drafts < 1:
                continue
            rows = continuations(text, ends[lengths >= length], num_drafts)
            path = most_frequent_path(rows, self.options.min_token_prob)
            if path.score > best.score:
                best = path
        return best


def match_lengths(text: np.ndarray, ends: np.ndarray, context: np.ndarray, max_length: int) -> np.ndarray:
    """For each position e of `ends`, how many tokens of `text` ending at e equal the context's last
    ones (at most `max_length`; a separator matches nothing)."""
    width = min(max_length, len(context))
    positions = ends[:, None] - np.arange(width)
    wanted = context[len(context) - width :][::-1]
    equal = (positions >= 0) & (text[np.maximum(positions, 0)] == wanted)
    return np.cumprod(equal, axis=1).sum(axis=1)


def continuations(text: np.ndarray, ends: np.ndarray, count: int) -> np.ndarray:
    """[len(ends), count]: the tokens of `text` after each position of `ends`, SEPARATOR from the end
    of the text or a separator on."""
    positions = ends[:, None] + 1 + np.arange(count)
    rows = np.where(positions < len(text), text[np.minimum(positions, len(text) - 1)], SEPARATOR)
    rows[np.maximum.accumulate(rows == SEPARATOR, axis=1)] = SEPARATOR
    return rows


def children(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens following a node's occurrences (`column`, oldest first, none a separator) and their
    counts, the most frequent first and, among equally frequent ones, the most recent first."""
    tokens, latest, counts = np.unique(column[::-1], return_index=True, return_counts=True)
    order = np.lexsort((latest, -counts))
    return tokens[order], counts[order]


def most_frequent_path(rows: np.ndarray, min_prob: float) -> Path:
    """From the node whose occurrences' continuations are `rows` (oldest first), follow the most
    frequent child while the path's probability stays at least `min_prob`. An occurrence whose
    continuation runs out (the text's end, a separator) leaves the counts from there: it tells
    nothing of the next token."""
    alive = rows
    token_ids: list[int] = []
    probs: list[float] = []
    prob = 1.0
    for depth in range(rows.shape[1]):
        column = alive[:, depth]
        known = column != SEPARATOR
        alive, column = alive[known], column[known]
        if len(alive) == 0:
            break
        if len(alive) == 1:  # one occurrence left: the rest of its row, at the same probability
            rest = alive[0, depth:]
            rest = rest[rest != SEPARATOR]  # separators only ever end a row
            token_ids += rest.tolist()
            probs += [prob] * len(rest)
            break
        tokens, counts = children(column)
        prob *= counts[0] / len(column)
        if prob < min_prob:
            break
        token_ids.append(int(tokens[0]))
        probs.append(prob)
        alive = alive[column == tokens[0]]
    return Path(token_ids, probs)
