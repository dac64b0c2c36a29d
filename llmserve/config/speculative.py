"""Speculative decoding settings, resolved from EngineArgs and frozen like the other configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from llmserve.sampling_params import SamplingParams

SpeculativeMethod = Literal["ngram", "draft", "early_exit", "draft_head", "suffix", "medusa", "eagle"]
METHODS: tuple[str, ...] = get_args(SpeculativeMethod)
TREE_METHODS = ("medusa", "eagle")  # methods that propose token trees (sample/token_tree.py)
# K when none is given. N-gram drafts are free and adapt to the match (a match of n tokens proposes at
# most 2 ** n, see proposers/ngram.py), so its K is only a cap: 7 keeps the verify pass at 8 rows, the
# small-batch linear kernel's limit. A model proposer pays a draft forward per draft, hence 3. The
# draft head drafts by prompt lookup where the context repeats (K caps those) and with its own
# network elsewhere, where `draft_head_tokens` caps it. Suffix decoding's drafts, free like n-gram's,
# adapt to the match and its counts, so its K is a cap too.
# Medusa's and eagle's K is the size of the token tree (nodes verified per pass), 7: an 8-row pass.
DEFAULT_NUM_SPECULATIVE_TOKENS = {
    "ngram": 7,
    "draft": 3,
    "early_exit": 3,
    "draft_head": 7,
    "suffix": 7,
    "medusa": 7,
    "eagle": 7,
}
DEFAULT_DRAFT_HEAD_TOKENS = 3
# --speculative-disable-batch-size unset: where a step's verify rows are dear (EngineArgs resolves it)
DEFAULT_DISABLE_BATCH_SIZE = 4
LIGHT_PROPOSERS = ("ngram", "suffix", "draft_head")  # proposers that run no model of their own per request
# Auto mode also shares drafts so that a step's decodes verify at most this many rows in all: the
# small-batch linear kernels' limit, below which a step is bound by reading the weights and extra rows
# cost little. Past it (4 requests x 4 rows) a step leaves the small-batch kernels (the planner drafts
# nothing where the share is a single draft).
DEFAULT_MAX_VERIFY_ROWS = 8  # kernels/small_batch_linear.py: MAX_ROWS (tests/test_config.py keeps them equal)


@dataclass(frozen=True)
class SuffixDecodingConfig:
    """`--speculative-method suffix` (spec_decode/proposers/suffix.py), with vLLM's option names."""

    max_tree_depth: int = 24  # longest matched suffix plus the drafts that follow it
    # finished requests whose outputs the global structure keeps, oldest dropped first (0: none); each
    # draft searches the occurrences of its last token in them, so this bounds its time and memory
    max_cached_requests: int = 1000
    max_spec_factor: float = 1.0  # drafts per matched suffix token at most
    min_token_prob: float = 0.1  # stop where a path's estimated probability (from its counts) falls below

    def __post_init__(self) -> None:
        if self.max_tree_depth < 2:
            raise ValueError(f"suffix_decoding_max_tree_depth must be >= 2, got {self.max_tree_depth}")
        if self.max_cached_requests < 0:
            raise ValueError(
                f"suffix_decoding_max_cached_requests must be >= 0, got {self.max_cached_requests}"
            )
        if self.max_spec_factor <= 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be > 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got {self.min_token_prob}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many; `create` returns None when speculation is off."""

    # "ngram" (prompt lookup), "draft" (a smaller model), "early_exit" (the target's first layers) or
    # "draft_head" (prompt lookup, else a head trained on the target's outputs) or "suffix" (the most
    # frequent continuation of the context's suffix in its own text and in recent requests' outputs)
    method: SpeculativeMethod
    num_speculative_tokens: int  # K: drafts proposed per step for a request (SamplingParams may override)
    prompt_lookup_min: int = 2  # ngram, draft_head: shortest suffix that may match
    prompt_lookup_max: int = 4  # ngram, draft_head: longest suffix tried first (draft_head: 0 = no lookup)
    draft_model: str | None = None  # draft: GGUF file or HF directory sharing the target's tokenizer
    draft_layers: int | None = None  # early_exit: leading target layers in the draft (None: the default)
    draft_head: str | None = None  # draft_head: the head's file (None: the one shipped for the default model)
    draft_head_tokens: int = DEFAULT_DRAFT_HEAD_TOKENS  # draft_head: drafts per step from the head at most
    disable_batch_size: int = 0  # propose nothing while more requests than this run (0: never disable)
    max_verify_rows: int = DEFAULT_MAX_VERIFY_ROWS  # auto (disable_batch_size > 0): rows of a step's decodes
    adaptive_k: bool = True  # each request's K follows its acceptance (core/draft_planner.py), up to K
    suffix: SuffixDecodingConfig | None = None  # suffix: its options (None for the other methods)

    @property
    def writes_draft_kv(self) -> bool:
        """Whether the proposer runs a model with a KV cache (draft, early_exit), which needs KV slots
        for the drafts it proposes after a step (the scheduler reserves them: lookahead)."""
        return self.method in ("draft", "early_exit")

    def drafts_for(self, params: SamplingParams) -> int:
        """K for one request: its `num_speculative_tokens` when set (0: it does not speculate), else
        the engine's."""
        k = params.num_speculative_tokens
        return self.num_speculative_tokens if k is None else k

    @classmethod
    def create(
        cls,
        method: str | None,
        num_speculative_tokens: int | None,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        draft_model: str | None,
        draft_layers: int | None,
        disable_batch_size: int,
        draft_head: str | None = None,
        draft_head_tokens: int | None = None,
        adaptive_k: bool = True,
        suffix: SuffixDecodingConfig | None = None,
    ) -> SpeculativeConfig | None:
        """Validate the flags (K None: the method's default); ValueError names the offending one."""
        if method is None or method == "none":
            return None
        if method not in METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(METHODS)}; got {method!r}")
        if num_speculative_tokens is None:
            num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS[method]
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        lookup_off = method == "draft_head" and prompt_lookup_max == 0
        if not lookup_off and not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {prompt_lookup_min} and {prompt_lookup_max}"
            )
        if method == "draft" and not draft_model:
            raise ValueError("speculative_method draft needs --speculative-draft-model")
        if method == "medusa" and not draft_head:
            raise ValueError(
                "speculative_method medusa needs --speculative-draft-head FILE (Medusa heads: "
                "`llmserve train-draft-head --medusa-heads K`, or a published medusa_lm_head file)"
            )
        if draft_layers is not None and draft_layers < 1:
            raise ValueError(f"speculative_draft_layers must be >= 1, got {draft_layers}")
        if draft_head_tokens is None or method != "draft_head":
            draft_head_tokens = min(DEFAULT_DRAFT_HEAD_TOKENS, num_speculative_tokens)
        if not 1 <= draft_head_tokens <= num_speculative_tokens:
            raise ValueError(
                f"speculative_draft_head_tokens must be in [1, num_speculative_tokens = "
                f"{num_speculative_tokens}], got {draft_head_tokens}"
            )
        if disable_batch_size < 0:
            raise ValueError(f"speculative_disable_batch_size must be >= 0, got {disable_batch_size}")
        return cls(
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_min=prompt_lookup_min,
            prompt_lookup_max=prompt_lookup_max,
            draft_model=draft_model if method == "draft" else None,
            draft_layers=draft_layers if method == "early_exit" else None,
            draft_head=draft_head if method in ("draft_head", *TREE_METHODS) else None,
            draft_head_tokens=draft_head_tokens,
            disable_batch_size=disable_batch_size,
            adaptive_k=adaptive_k,
            suffix=(suffix or SuffixDecodingConfig()) if method == "suffix" else None,
        )
