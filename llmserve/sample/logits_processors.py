"""The one hook that changes logits before sampling: logits processors.

A processor is engine-wide (as vLLM v1's): each step it gets the batch's float32 logits and, for the
rows it applies to, their requests' parameters and the tokens each row follows (a speculative verify
row j follows the output plus the first j drafts), and changes those rows in place. Every path that
picks a token from logits calls `LogitsProcessing.apply` at the same point of the Sampler's order
(after min_tokens and penalties, before the greedy argmax): the sampler, its greedy fast path (which
steps aside when a row has a processor), the speculative verifier and the draft head. A new kind of
constraint is one more class in `PROCESSORS`; a grammar's token mask (`GrammarMask`) is bound per
step to the rows' grammar states, which live on the runner's requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from llmserve.sample.transfer import to_device
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger("llmserve")

if TYPE_CHECKING:
    from llmserve.structured.matcher import GrammarState


class LogitsProcessor(Protocol):
    def applies_to(self, params: SamplingParams) -> bool:
        """Whether rows of a request with these parameters need this processor."""
        ...

    def apply(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
    ) -> None:
        """Change logits[rows[i]] in place for the request with params[i] after output_token_ids[i].
        One that raises must have left the logits unchanged (it is run again on each row alone)."""
        ...


class LogitBias:
    """OpenAI's `logit_bias`: a per-request bias added to chosen tokens' logits (-100 bans, 100 forces)."""

    def applies_to(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits, rows, params, output_token_ids) -> None:
        row_ids = [row for row, p in zip(rows, params, strict=True) for _ in p.logit_bias]
        token_ids = [token for p in params for token in p.logit_bias]
        biases = [bias for p in params for bias in p.logit_bias.values()]
        device = logits.device
        index = (to_device(torch.tensor(row_ids), device), to_device(torch.tensor(token_ids), device))
        logits.index_put_(index, to_device(torch.tensor(biases, dtype=logits.dtype), device), accumulate=True)


class GrammarMask:
    """Structured outputs: each grammar row's allowed tokens as a bitmask, applied to all of them in one
    call (llmserve/structured/). Built per step with the rows' GrammarStates; the Python loop is over
    requests (bringing each matcher to its row's tokens and filling its bitmask row), never tokens."""

    def __init__(self, grammars: Sequence[GrammarState | None]) -> None:
        self.grammars = grammars

    @staticmethod
    def applies_to(params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    def apply(self, logits, rows, params, output_token_ids) -> None:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[-1])  # all allowed
        masked = []
        for row, tokens in zip(rows, output_token_ids, strict=True):
            state = self.grammars[row]
            if state is None:
                raise RuntimeError("a structured-output row has no grammar state")
            if state.sync(tokens) and state.fill(bitmask, row):  # else a moot row (a refused draft before it)
                masked.append(row)
        if masked:
            xgrammar.apply_token_bitmask_inplace(logits, to_device(bitmask, logits.device), indices=masked)


PROCESSORS: tuple[LogitsProcessor, ...] = (LogitBias(),)


def needs_processing(params: SamplingParams) -> bool:
    return GrammarMask.applies_to(params) or any(processor.applies_to(params) for processor in PROCESSORS)


@dataclass
class LogitsProcessing:
    """The processors a batch needs and the rows each applies to (None from `build`: no row needs any)."""

    work: list[tuple[LogitsProcessor, list[int]]]
    params: list[SamplingParams]
    output_token_ids: list[list[int]]
    # The caller fails the requests of `failed_rows` (the sampler's and the verifier's paths); otherwise
    # a raising processor raises, so no path goes on with a row left unprocessed.
    isolate_failures: bool = False
    failed_rows: set[int] = field(default_factory=set)  # rows whose processor raised (after `apply`)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[list[int]],
        grammars: Sequence[GrammarState | None] | None = None,
    ) -> LogitsProcessing | None:
        """`grammars`: each row's request's grammar state (None: no row has a grammar)."""
        if grammars is None and any(GrammarMask.applies_to(p) for p in params):
            raise RuntimeError("structured-output rows need their grammar states")
        work = []
        processors = PROCESSORS if grammars is None else (*PROCESSORS, GrammarMask(grammars))
        for processor in processors:
            rows = [row for row, p in enumerate(params) if processor.applies_to(p)]
            if rows:
                work.append((processor, rows))
        return cls(work, list(params), list(output_token_ids)) if work else None

    def apply(self, logits: torch.Tensor) -> None:
        """In place, on float32 logits whose rows are the batch's rows. With `isolate_failures`, a
        processor that raises is run again one row at a time: the rows that raise alone go to
        `failed_rows` (the caller fails their requests) and the others get their processing."""
        for processor, rows in self.work:
            try:
                self._apply(processor, logits, rows)
            except Exception:  # noqa: BLE001 - one request's processor must not fail the batch
                if not self.isolate_failures:
                    raise
                logger.exception(
                    "logits processor %s raised; retrying its %d rows one by one", processor, len(rows)
                )
                for row in rows:
                    try:
                        self._apply(processor, logits, [row])
                    except Exception:  # noqa: BLE001 - this row's request fails alone
                        self.failed_rows.add(row)

    def _apply(self, processor: LogitsProcessor, logits: torch.Tensor, rows: list[int]) -> None:
        params = [self.params[row] for row in rows]
        processor.apply(logits, rows, params, [self.output_token_ids[row] for row in rows])
