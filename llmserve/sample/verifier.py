"""The model runner's side of speculative decoding: target logits at every draft position -> new tokens.

A request verifying k drafts had logits computed at its last known token and at each draft (k + 1
rows, in order); requests without drafts in the same step have one row and get an ordinary sample
(their bonus token), so one pass serves the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llmserve.sample.logits_processors import needs_processing
from llmserve.sample.metadata import SamplingRequest
from llmserve.sample.rejection_sampler import RejectionSampler, RejectionSamplerOutput
from llmserve.sample.sampler import greedy_token_ids
from llmserve.sample.speculative import build_row_metadata, expand_rows

TokenLogprobs = dict[int, float]


def _plain_greedy(request: SamplingRequest) -> bool:
    """Greedy, no penalties, past min_tokens, no logits processor, no logprobs: its next token is the
    plain argmax (the per-request form of `sampler.leaves_logits_unchanged`, decided before any
    metadata is built)."""
    params = request.sampling_params
    return (
        params.is_greedy
        and not params.has_penalties
        and not needs_processing(params)
        and params.logprobs is None
        and len(request.output_token_ids) >= params.min_tokens
    )


class DraftVerifier:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.rejection_sampler = RejectionSampler()

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplingRequest],
        draft_probs: dict[str, torch.Tensor],
        failed: list[str] | None = None,
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        """New tokens per request (accepted drafts, then the recovered or bonus token) and their logprobs.

        `draft_probs` holds each request's [k, V] q when its drafts were sampled from a distribution;
        empty means one-hot q (n-gram drafts, or greedy drafts that only greedy requests verify).
        `failed`: given, a logits processor that raises fails only its requests, whose ids are added
        to it (the caller fails them; their tokens here mean nothing); else it raises.
        """
        num_drafts = [len(r.spec_token_ids) for r in requests]
        if not draft_probs and all(_plain_greedy(r) for r in requests):
            return self._verify_plain_greedy(logits, requests, num_drafts), {}
        rows, drafts_before = expand_rows(requests, [k + 1 for k in num_drafts])
        metadata = build_row_metadata(rows, drafts_before, self.vocab_size, self.device)
        processing = metadata.logits_processing
        if processing is not None and failed is not None:
            processing.isolate_failures = True
        draft_ids = [t for r in requests for t in r.spec_token_ids]
        q = None
        if draft_probs:
            q = torch.cat([self._draft_q(r, draft_probs) for r in requests if r.spec_token_ids])
        output = self.rejection_sampler(
            logits, num_drafts, torch.tensor(draft_ids, dtype=torch.int64, device=self.device), q, metadata
        )
        accepted, next_ids = output.num_accepted.tolist(), output.next_token_ids.tolist()  # the host sync
        if processing is not None and processing.failed_rows and failed is not None:
            failed.extend(dict.fromkeys(rows[row].request_id for row in sorted(processing.failed_rows)))
        token_ids = [r.spec_token_ids[:a] + [t] for r, a, t in zip(requests, accepted, next_ids, strict=True)]
        new_tokens = {r.request_id: ids for r, ids in zip(requests, token_ids, strict=True)}
        if metadata.max_num_logprobs is None:
            return new_tokens, {}
        return new_tokens, self._logprobs(requests, token_ids, output, metadata.max_num_logprobs)

    def _draft_q(self, request: SamplingRequest, draft_probs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[k, V] the q of a request's drafts: as proposed, or one-hot (prompt lookup drafts beside a
        draft head's sampled ones in the same step)."""
        q = draft_probs.get(request.request_id)
        if q is not None:
            return q
        ids = torch.tensor(request.spec_token_ids, dtype=torch.int64, device=self.device)
        return torch.nn.functional.one_hot(ids, self.vocab_size).to(torch.float32)

    @staticmethod
    def _verify_plain_greedy(
        logits: torch.Tensor, requests: Sequence[SamplingRequest], num_drafts: list[int]
    ) -> dict[str, list[int]]:
        """Greedy requests with nothing that changes their logits: one argmax over every row and a host
        comparison, instead of the rejection sampler's per-row processing (a float32 copy of the
        logits plus sampling metadata for every row and a dozen small tensor ops). Same tokens as the
        rejection sampler's greedy case."""
        argmax = greedy_token_ids(logits).cpu().numpy()  # the Sampler's argmax; the host sync
        counts = np.asarray(num_drafts, dtype=np.int64)
        starts = np.cumsum(counts + 1) - (counts + 1)
        drafts = np.fromiter(
            (t for r in requests for t in r.spec_token_ids), dtype=np.int64, count=int(counts.sum())
        )
        draft_request = np.repeat(np.arange(len(counts)), counts)
        draft_position = np.arange(len(drafts)) - (np.cumsum(counts) - counts)[draft_request]
        wrong = drafts != argmax[starts[draft_request] + draft_position]
        # each request's accepted count: the position of its first wrong draft, else all of them
        first_wrong = counts.copy()
        np.minimum.at(first_wrong, draft_request[wrong], draft_position[wrong])
        next_ids = argmax[starts + first_wrong].tolist()
        return {
            r.request_id: r.spec_token_ids[:a] + [t]
            for r, a, t in zip(requests, first_wrong.tolist(), next_ids, strict=True)
        }

    def _logprobs(
        self,
        requests: Sequence[SamplingRequest],
        token_ids: list[list[int]],
        output: RejectionSamplerOutput,
        max_num: int,
    ) -> dict[str, list[TokenLogprobs]]:
        """Per new token: the top-N log-probs of the target's processed distribution at its position,
        plus the emitted token's own (the Sampler's format)."""
        logprobs = output.processed_logits.log_softmax(dim=-1)
        rows, chosen, start = [], [], 0
        for request, ids in zip(requests, token_ids, strict=True):
            rows.extend(range(start, start + len(ids)))
            chosen.extend(ids)
            start += len(request.spec_token_ids) + 1
        rows_t = torch.tensor(rows, dtype=torch.int64, device=logprobs.device)
        chosen_t = torch.tensor(chosen, dtype=torch.int64, device=logprobs.device)
        top = logprobs[rows_t].topk(min(max_num, logprobs.shape[-1]), dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
        chosen_values = logprobs[rows_t, chosen_t].tolist()
        result, index = {}, 0
        for request, ids in zip(requests, token_ids, strict=True):
            num = request.sampling_params.logprobs
            if num is not None:
                result[request.request_id] = [
                    {
                        **dict(zip(top_ids[i][:num], top_values[i][:num], strict=True)),
                        ids[i - index]: chosen_values[i],
                    }
                    for i in range(index, index + len(ids))
                ]
            index += len(ids)
        return result
