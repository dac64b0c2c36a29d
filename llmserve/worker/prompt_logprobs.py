"""Log-probabilities of prompt tokens (vLLM's `prompt_logprobs`), for the requests that ask.

A prompt chunk's final hidden states at positions p (whose next token is prompt token p + 1) go
through the LM head in float32; each row gives the log-prob and rank of the real next token and the
top-N alternatives. Only rows of requests that asked are computed, in slices of at most
`ROWS_PER_SLICE` so a long prompt never holds a [prompt, vocabulary] tensor at once; the results
cross to the host in one `.tolist()` per slice. The log-probs are the model's own distribution (no
temperature, penalties or logit bias), as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.outputs import PromptLogprobs

ROWS_PER_SLICE = 512  # [512, 49152] float32 logits: 96 MiB


@dataclass
class PromptLogprobRows:
    """Which of a step's flat token rows need prompt log-probs, and of which request."""

    request_ids: list[str]
    first_positions: list[int]
    counts: list[int]
    num_top: list[int]
    indices: torch.Tensor  # flat token index of each row
    targets: torch.Tensor  # the prompt token each row predicts


def select_rows(
    requests: Sequence, computed: np.ndarray, num_new: np.ndarray, starts: np.ndarray, device: torch.device
) -> PromptLogprobRows | None:
    """The rows of requests with `prompt_logprobs` whose scheduled tokens include prompt positions
    that predict a prompt token; None when no request in the step asks (the usual case)."""
    chosen = [
        i
        for i, r in enumerate(requests)
        if getattr(r, "sampling_params", None) is not None and r.sampling_params.prompt_logprobs is not None
    ]
    ids, firsts, counts, tops, indices, targets = [], [], [], [], [], []
    for i in chosen:
        request, first = requests[i], int(computed[i])
        last = min(first + int(num_new[i]), request.num_prompt_tokens - 1)  # positions first .. last - 1
        if last <= first:
            continue
        ids.append(request.request_id)
        firsts.append(first)
        counts.append(last - first)
        tops.append(request.sampling_params.prompt_logprobs)
        indices.append(np.arange(starts[i], starts[i] + last - first))
        targets.append(np.asarray(request.prompt_token_ids[first + 1 : last + 1], dtype=np.int64))
    if not ids:
        return None
    return PromptLogprobRows(
        ids,
        firsts,
        counts,
        tops,
        torch.from_numpy(np.concatenate(indices)).to(device),
        torch.from_numpy(np.concatenate(targets)).to(device),
    )


def compute(
    rows: PromptLogprobRows,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
) -> dict[str, PromptLogprobs]:
    """Each request's prompt log-probs for the step; {} on a tensor-parallel rank other than 0 (which
    still joins every slice's logits gather)."""
    num_top = max(rows.num_top)
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, len(rows.indices), ROWS_PER_SLICE):
        stop = start + ROWS_PER_SLICE
        logits = compute_logits(hidden[rows.indices[start:stop]])
        if logits is None:
            continue
        logprobs = logits.float().log_softmax(dim=-1)
        target = logprobs.gather(1, rows.targets[start:stop, None])
        ranks = (logprobs > target).sum(dim=-1) + 1
        top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
        parts.append((target[:, 0], ranks, top.indices, top.values))
    if not parts:
        return {}
    target, ranks, top_ids, top_values = (torch.cat(column).cpu() for column in zip(*parts, strict=True))
    result, offset = {}, 0
    for request_id, first, count, n in zip(
        rows.request_ids, rows.first_positions, rows.counts, rows.num_top, strict=True
    ):
        part = slice(offset, offset + count)
        result[request_id] = PromptLogprobs(
            first,
            target[part].tolist(),
            ranks[part].tolist(),
            top_ids[part, :n].tolist(),
            top_values[part, :n].tolist(),
        )
        offset += count
    return result
