"""Verifying a token tree (sample/token_tree.py) in one pass: the longest accepted root-to-leaf path.

Row 0 of a request's rows is the target's processed distribution p after its last token (the root);
row 1 + i the distribution after draft i's path (its ancestors' tokens and its own), processed with
those tokens as output, as the chain verifier does for a prefix of drafts. Tree drafts are fixed
candidates (one-hot q: a proposer's top-k, not samples), so verification walks down from the root:

- greedy: move to the child whose token is the target's argmax at the node, while there is one;
  then emit that argmax (the same tokens as decoding without speculation);
- sampling (multi-candidate speculative sampling, SpecInfer's and EAGLE's recursive rejection with
  one-hot q): at a node with distribution p, try its children in order; child x is accepted with
  probability p(x) / sum(p), else p(x) is set to 0 (the residual max(0, p - onehot(x))) and the next
  child is tried against that residual; if none is accepted the token is drawn from the residual.
  Each step is a single-draft speculative sampling step against the current residual, so the token
  that leaves a node is distributed exactly as the node's p: the output is the target's.

The walk runs on the host, a few scalar draws per node it visits (correctness first: the chain
sampler's vectorized form is not repeated here). Seeded requests draw from their own generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llmserve.sample.metadata import SamplingRequest
from llmserve.sample.speculative import build_row_metadata, greedy_rows, process_logits
from llmserve.sample.token_tree import children, path_tokens

TokenLogprobs = dict[int, float]


@dataclass
class TreeVerification:
    token_ids: dict[str, list[int]]  # request id -> the accepted path's drafts, then the final token
    paths: dict[str, list[int]]  # request id -> the accepted drafts' indices, root to leaf
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def walk_greedy(
    kids: list[list[int]], token_ids: Sequence[int], argmax: Sequence[int]
) -> tuple[list[int], int]:
    """(accepted drafts, final token): follow the child equal to the argmax of each node's row
    (`argmax[0]` the root's, `argmax[1 + i]` draft i's)."""
    path, node = [], -1
    while True:
        target = argmax[node + 1]
        node = next((c for c in kids[node + 1] if token_ids[c] == target), None)
        if node is None:
            return path, target
        path.append(node)


def walk_sampled(
    kids: list[list[int]],
    token_ids: Sequence[int],
    probs: torch.Tensor,  # [1 + n, V] each node's p (rows need not be normalized)
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """(accepted drafts, final token) by recursive rejection with one-hot q (module docstring)."""
    path, node = [], -1
    while True:
        residual = probs[node + 1].double().clone()
        for child in kids[node + 1]:
            token = token_ids[child]
            draw = float(torch.rand((), dtype=torch.float64, generator=generator, device=residual.device))
            if draw * float(residual.sum()) < float(residual[token]):
                path.append(child)
                node = child
                break
            residual[token] = 0.0
        else:
            return path, int(torch.multinomial(residual, 1, generator=generator))


class TreeVerifier:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[SamplingRequest], failed: list[str] | None = None
    ) -> TreeVerification:
        """`logits`: 1 + n rows per request, in order; each request's `spec_tree_parents` shapes its
        drafts. `failed` as for DraftVerifier: a raising logits processor fails only its requests."""
        rows, drafts_before = [], []
        for request in requests:
            rows.extend([request] * (1 + len(request.spec_token_ids)))
            drafts_before.append([])
            drafts_before.extend(path_tokens(request.spec_tree_parents, request.spec_token_ids))
        metadata = build_row_metadata(rows, drafts_before, self.vocab_size, self.device)
        processing = metadata.logits_processing
        if processing is not None and failed is not None:
            processing.isolate_failures = True
        argmax, processed = process_logits(logits, metadata)
        greedy = greedy_rows(metadata, len(processed), processed.device).tolist()
        argmax = argmax.tolist()
        probs = None if metadata.all_greedy else processed.softmax(dim=-1)
        result, start, final_rows = TreeVerification({}, {}), 0, []
        for request in requests:
            count = 1 + len(request.spec_token_ids)
            kids = children(request.spec_tree_parents)
            if greedy[start]:
                path, token = walk_greedy(kids, request.spec_token_ids, argmax[start : start + count])
            else:
                path, token = walk_sampled(
                    kids, request.spec_token_ids, probs[start : start + count], request.generator
                )
            result.paths[request.request_id] = path
            result.token_ids[request.request_id] = [request.spec_token_ids[i] for i in path] + [token]
            final_rows.append([start] + [start + 1 + i for i in path])
            start += count
        if processing is not None and processing.failed_rows and failed is not None:
            failed.extend(dict.fromkeys(rows[row].request_id for row in sorted(processing.failed_rows)))
        if metadata.max_num_logprobs is not None:
            result.logprobs = _logprobs(requests, result.token_ids, final_rows, processed)
        return result


def _logprobs(
    requests: Sequence[SamplingRequest],
    token_ids: dict[str, list[int]],
    rows: list[list[int]],
    processed: torch.Tensor,
) -> dict[str, list[TokenLogprobs]]:
    """Per new token: the top-N log-probs of the processed distribution at the row it was chosen
    at, plus its own (the Sampler's format)."""
    logprobs = processed.log_softmax(dim=-1)
    result = {}
    for request, request_rows in zip(requests, rows, strict=True):
        num = request.sampling_params.logprobs
        if num is None:
            continue
        entries = []
        for row, token in zip(request_rows, token_ids[request.request_id], strict=True):
            top = logprobs[row].topk(min(num, logprobs.shape[-1]))
            entry = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            entry[token] = float(logprobs[row, token])
            entries.append(entry)
        result[request.request_id] = entries
    return result
