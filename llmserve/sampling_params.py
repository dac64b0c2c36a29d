"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from llmserve.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the previous output (streams)
    FINAL_ONLY = 2  # one output, when the request finishes, with everything


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError naming the field."""

    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = -1  # keep the k most likely tokens; -1 (or 0) keeps all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    presence_penalty: float = 0.0  # subtracted once from the logit of every generated token
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of seen tokens
    seed: int | None = None  # same seed, same output, whatever else is in the batch
    max_tokens: int = 16  # tokens to generate at most
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many tokens exist
    stop: list[str] = field(default_factory=list)  # strings that end generation (never in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # token ids that end generation
    ignore_eos: bool = False  # keep generating past the end-of-sequence token
    logprobs: int | None = None  # return the top-N log-probabilities for each generated token
    skip_special_tokens: bool = True  # leave special tokens out of the text
    num_speculative_tokens: int | None = None  # drafts per step if the engine speculates; None: its K; 0: off
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each output holds
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    prompt_logprobs: int | None = None  # log-probs of the prompt's tokens (and their top-N), vLLM's field
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text in it
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    ttft_target_ms: float | None = None  # the scheduler's time-to-first-token target; None: the server's
    tpot_target_ms: float | None = None  # its time-per-output-token target; None: the server's
    lora_name: str | None = None  # the LoRA adapter to run under, by its served name; None: the base model

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} if self.logit_bias else None
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 (disabled) or >= 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be >= 0"),
            (
                "logit_bias",
                all(t >= 0 and -100.0 <= b <= 100.0 for t, b in (self.logit_bias or {}).items()),
                "must map token ids >= 0 to biases in [-100, 100]",
            ),
            (
                "num_speculative_tokens",
                self.num_speculative_tokens is None or self.num_speculative_tokens >= 0,
                "must be None or >= 0",
            ),
            *(
                (name, value is None or 0 < value < float("inf"), "must be None or > 0")
                for name, value in (
                    ("ttft_target_ms", self.ttft_target_ms),
                    ("tpot_target_ms", self.tpot_target_ms),
                )
            ),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")

    def with_output_kind(self, kind: RequestOutputKind) -> SamplingParams:
        return self if self.output_kind is kind else replace(self, output_kind=kind)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def child(self, index: int) -> SamplingParams:
        """Parameters for the index-th of n parallel samples: n=1 and a distinct derived seed."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
