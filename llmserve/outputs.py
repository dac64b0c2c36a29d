"""What the engine returns: per-request outputs with text, tokens, finish reason, timings and
speculative decoding counts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class PromptLogprobs:
    """Prompt log-probs of one request: rows for prompt positions first .. first + len - 1, each about
    prompt token position + 1 (the first prompt token has none)."""

    first_position: int
    token_logprobs: list[float]  # log-prob of the real next prompt token
    token_ranks: list[int]  # its rank in the distribution (1: the most likely)
    top_token_ids: list[list[int]]  # the N most likely next tokens
    top_logprobs: list[list[float]]

    @property
    def end_position(self) -> int:
        return self.first_position + len(self.token_logprobs)

    def extend(self, later: PromptLogprobs) -> None:
        """Append a later chunk's rows; rows already held (a recomputed prompt) are skipped."""
        skip = self.end_position - later.first_position
        if skip < 0:
            raise ValueError(f"prompt log-probs skip positions {self.end_position}..{later.first_position}")
        self.token_logprobs += later.token_logprobs[skip:]
        self.token_ranks += later.token_ranks[skip:]
        self.top_token_ids += later.top_token_ids[skip:]
        self.top_logprobs += later.top_logprobs[skip:]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: top-N plus the sampled token
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SpecDecodeStats:
    """Counters of speculative decoding, engine-wide and per request (the same class for both).

    In the paper's terms a verification step of one request proposes k drafts, accepts the leading a
    of them and adds one more token (the recovered token at the first rejection, or the bonus token
    when all k were accepted), so it yields a + 1 tokens for one target forward.
    """

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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # set when the engine failed this request alone
    spec_decode: SpecDecodeStats | None = None  # drafts proposed and accepted (all n samples); None: none
    prompt_logprobs: PromptLogprobs | None = None  # with the first output, when the request asked
    embedding: list[float] | None = None  # a pooling request's L2-normalized vector (its one output)
