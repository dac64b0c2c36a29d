"""Verifying drafts by speculative sampling (Leviathan et al., 2023; Chen et al., 2023).

A request proposes drafts x_1..x_k. p_j is the target's processed distribution after the first j
drafts (k + 1 rows: j = 0..k) and q_j the distribution x_{j+1} was drawn from. In the paper's terms:

- accepted: x_{j+1} is kept with probability min(1, p_j(x_{j+1}) / q_j(x_{j+1})), in order, until the
  first rejection;
- recovered: at the first rejection, at position j, a token is drawn from norm(max(0, p_j - q_j));
- bonus: when all k drafts are accepted, one more token is drawn from p_k.

Every emitted token is then distributed exactly as p: P(x) = min(p(x), q(x)) + (1 - sum_y min(p, q))
* max(0, p(x) - q(x)) / sum_y max(0, p - q) = p(x), since sum_y max(0, p - q) = 1 - sum_y min(p, q).
Speculation changes how many target forwards a sequence takes, never what is sampled. Greedy
requests are the limit case: accept while the draft is the target's argmax, then emit the argmax. A
proposer without a distribution (n-gram) has a one-hot q: x is accepted with probability p(x), and the
recovered token is drawn from p without x.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.sample.metadata import SamplingMetadata
from llmserve.sample.speculative import exponential_race, greedy_rows, process_logits, uniform_rows


@dataclass
class RejectionSamplerOutput:
    num_accepted: torch.Tensor  # [B] int64: leading drafts accepted
    next_token_ids: torch.Tensor  # [B] int64: the recovered (after a rejection) or bonus (all accepted) token
    processed_logits: torch.Tensor  # [N, V] float32: the target distribution of each row, for logprobs


@dataclass
class _Layout:
    """Where request i's rows lie: target rows starts[i]..starts[i] + k_i, drafts from draft_starts[i]."""

    num_drafts: torch.Tensor  # [B] k_i
    starts: torch.Tensor  # [B] first target row
    draft_starts: torch.Tensor  # [B] first draft row
    draft_request: torch.Tensor  # [D] request of each draft
    draft_position: torch.Tensor  # [D] j of each draft within its request
    draft_rows: torch.Tensor  # [D] target row judging each draft (starts + j)
    max_drafts: int

    @classmethod
    def build(cls, num_drafts: Sequence[int], device: torch.device) -> _Layout:
        counts = np.asarray(num_drafts, dtype=np.int64)
        starts = np.cumsum(counts + 1) - (counts + 1)
        draft_starts = np.cumsum(counts) - counts
        draft_request = np.repeat(np.arange(len(counts)), counts)
        draft_position = np.arange(int(counts.sum())) - draft_starts[draft_request]
        tensors = [
            torch.from_numpy(a).to(device)
            for a in (
                counts,
                starts,
                draft_starts,
                draft_request,
                draft_position,
                starts[draft_request] + draft_position,
            )
        ]
        return cls(*tensors, max_drafts=int(counts.max(initial=0)))

    def count_leading(self, accepted: torch.Tensor) -> torch.Tensor:
        """[B] length of each request's leading run of accepted drafts."""
        grid = torch.zeros(len(self.num_drafts), self.max_drafts, dtype=torch.int64, device=accepted.device)
        grid[self.draft_request, self.draft_position] = accepted.long()
        return grid.cumprod(dim=1).sum(dim=1)


class RejectionSampler:
    """Vectorized over the whole batch: no loop over tokens, no host sync."""

    @torch.inference_mode()
    def __call__(
        self,
        target_logits: torch.Tensor,
        num_drafts: Sequence[int],
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        metadata: SamplingMetadata,
    ) -> RejectionSamplerOutput:
        """target_logits: [N, V] rows per request: one per draft, then the bonus row (N = sum(k_i + 1));
        draft_token_ids: [D] (D = sum(k_i)); draft_probs: [D, V] the q each draft was drawn from, or None
        for one-hot q; metadata: one row per target row (see speculative.expand_rows)."""
        layout = _Layout.build(num_drafts, target_logits.device)
        greedy_ids, logits = process_logits(target_logits, metadata)
        greedy_request = greedy_rows(metadata, len(logits), logits.device)[layout.starts]
        matches_argmax = draft_token_ids == greedy_ids[layout.draft_rows]
        if metadata.all_greedy:
            num_accepted = layout.count_leading(matches_argmax)
            return RejectionSamplerOutput(num_accepted, greedy_ids[layout.starts + num_accepted], logits)
        probs = logits.softmax(dim=-1)
        generators = [metadata.generators[row] for row in layout.starts.tolist()]
        is_random = (~greedy_request).tolist()
        accepted = self._accept(probs, draft_token_ids, draft_probs, layout, generators, is_random)
        num_accepted = layout.count_leading(
            torch.where(greedy_request[layout.draft_request], matches_argmax, accepted)
        )
        final_rows = layout.starts + num_accepted
        sampled = self._recover_or_bonus(
            probs, final_rows, num_accepted, draft_token_ids, draft_probs, layout
        )
        noise = uniform_rows([1] * len(is_random), generators, is_random, probs.device, width=probs.shape[-1])
        next_ids = torch.where(greedy_request, greedy_ids[final_rows], exponential_race(sampled, noise))
        return RejectionSamplerOutput(num_accepted, next_ids, logits)

    @staticmethod
    def _accept(probs, draft_token_ids, draft_probs, layout: _Layout, generators, is_random) -> torch.Tensor:
        """[D] u < p(x) / q(x), compared as u * q(x) < p(x) (q(x) > 0 for a drawn x; one-hot q is 1)."""
        p = probs[layout.draft_rows, draft_token_ids]
        q = 1.0
        if draft_probs is not None:
            q = draft_probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
        counts = layout.num_drafts.tolist()
        return uniform_rows(counts, generators, is_random, probs.device) * q < p

    @staticmethod
    def _recover_or_bonus(
        probs, final_rows, num_accepted, draft_token_ids, draft_probs, layout
    ) -> torch.Tensor:
        """[B, V] weights to draw each request's last token from: max(0, p - q) after a rejection, else p."""
        final = probs[final_rows]
        if len(draft_token_ids) == 0:
            return final
        rejected = num_accepted < layout.num_drafts
        rejected_draft = (layout.draft_starts + num_accepted).clamp(max=len(draft_token_ids) - 1)
        if draft_probs is not None:
            q = draft_probs[rejected_draft]
        else:
            q = torch.nn.functional.one_hot(draft_token_ids[rejected_draft], probs.shape[-1]).to(probs.dtype)
        residual = (final - q).clamp_min_(0.0)
        # p == q up to rounding leaves no residual mass; a rejection is then (almost) impossible anyway.
        use_residual = rejected & (residual.sum(dim=-1) > 0)
        return torch.where(use_residual.unsqueeze(1), residual, final)


def rejection_sample_reference(
    target_probs: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The algorithm as the papers state it, one draft at a time: the test oracle (the engine never calls it).

    target_probs: [k + 1, V] p_0..p_k; draft_probs: [k, V] q_0..q_{k-1}, or None for one-hot q.
    """
    output: list[int] = []
    for j, token in enumerate(draft_token_ids):
        p = target_probs[j]
        if greedy:
            if token != int(p.argmax()):
                return output + [int(p.argmax())]
        else:
            q = (
                draft_probs[j]
                if draft_probs is not None
                else torch.nn.functional.one_hot(torch.tensor(token), len(p)).to(p.dtype)
            )
            if float(torch.rand((), generator=generator)) >= min(1.0, float(p[token] / q[token])):
                residual = (p - q).clamp(min=0.0)
                return output + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
        output.append(token)
    bonus = target_probs[len(draft_token_ids)]
    return output + [int(bonus.argmax()) if greedy else int(torch.multinomial(bonus, 1, generator=generator))]
