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

Greedy requests are verified together as tensors (`accept_greedy`: one copy to the host per step),
each tree's structure cached per shape (`token_tree.tree_shape`) and the step's padded layout per
batch of shapes (`GreedyTreeLayout`); `walk_greedy` is the same rule for one request, node by node.
The sampled walk runs on the host, a few scalar draws per node it visits (its draws, and so a seeded
request's tokens, depend on the order it visits nodes in). Seeded requests draw from their own generator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.sample.metadata import SamplingRequest
from llmserve.sample.speculative import build_row_metadata, process_logits
from llmserve.sample.token_tree import TreeShape, children, path_tokens, tree_shape

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


@dataclass(frozen=True)
class GreedyTreeLayout:
    """A step's greedy trees as one padded batch, B trees by N nodes (the largest tree's, at least 1);
    padding is no node (not `valid`, no ancestor, no sibling). Built once per (shapes, root rows)."""

    starts: torch.Tensor  # [B] long: each tree's root row in the logits
    parent_rows: torch.Tensor  # [B, N] long: the logits row of each node's parent (padding: the root's)
    ancestors: torch.Tensor  # [B, N, N] bool: token_tree.ancestor_mask per tree
    earlier_siblings: torch.Tensor  # [B, N, N] bool: TreeShape.earlier_siblings per tree
    valid: torch.Tensor  # [B, N] bool: a node, not padding
    ranks: torch.Tensor  # [N] long: 1 + each node's index (its row after the root)

    @property
    def width(self) -> int:
        return len(self.ranks)

    @classmethod
    def build(
        cls, shapes: Sequence[TreeShape], starts: Sequence[int], device: torch.device
    ) -> GreedyTreeLayout:
        width = max([1] + [shape.num_drafts for shape in shapes])
        parent_rows = np.zeros((len(shapes), width), dtype=np.int64)
        ancestors = np.zeros((len(shapes), width, width), dtype=bool)
        siblings = np.zeros_like(ancestors)
        valid = np.zeros((len(shapes), width), dtype=bool)
        for row, (shape, start) in enumerate(zip(shapes, starts, strict=True)):
            n = shape.num_drafts
            parent_rows[row] = start
            parent_rows[row, :n] += shape.parents + 1
            ancestors[row, :n, :n] = shape.ancestors
            siblings[row, :n, :n] = shape.earlier_siblings
            valid[row, :n] = True
        tensors = (np.asarray(starts, dtype=np.int64), parent_rows, ancestors, siblings, valid)
        ranks = torch.arange(1, width + 1, device=device)
        return cls(*(torch.from_numpy(t).to(device) for t in tensors), ranks=ranks)


def accept_greedy(layout: GreedyTreeLayout, token_ids: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """[B, 1 + N] long: each tree's final token, then 1 for each of its drafts on the accepted path.

    `token_ids` [B, N] the drafts (padding any), `argmax` the target's argmax per logits row. A draft is
    accepted iff its parent is (the root always is), its token is the argmax at its parent's row, and
    no earlier sibling has its token (`walk_greedy` takes the first such child). So an accepted node
    has at most one accepted child: the accepted drafts are `walk_greedy`'s path, the deepest of
    them the one of highest index (parents come first), and the final token the argmax at its row."""
    matches = token_ids == argmax[layout.parent_rows]
    shadowed = (layout.earlier_siblings & (token_ids[:, :, None] == token_ids[:, None, :])).any(dim=-1)
    rejected = ~matches | shadowed
    accepted = ~(layout.ancestors & rejected[:, None, :]).any(dim=-1) & layout.valid
    leaf_rows = (accepted * layout.ranks).amax(dim=-1)  # 0 (the root) where nothing is accepted
    final = argmax[layout.starts + leaf_rows]
    return torch.cat([final[:, None], accepted.long()], dim=1)


class TreeVerifier:
    MAX_LAYOUTS = 64  # cached step layouts: batches of a proposer's few shapes repeat step after step

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._layouts: OrderedDict[tuple, GreedyTreeLayout] = OrderedDict()  # least recently used first

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
        starts = np.cumsum([0] + [1 + len(r.spec_token_ids) for r in requests])
        greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        paths = self._greedy_paths([requests[i] for i in greedy], starts[greedy], argmax)
        walks = dict(zip(greedy, paths, strict=True))
        probs = None if metadata.all_greedy else processed.softmax(dim=-1)
        result, final_rows = TreeVerification({}, {}), []
        for index, request in enumerate(requests):
            start, count = int(starts[index]), 1 + len(request.spec_token_ids)
            if index in walks:
                path, token = walks[index]
            else:
                path, token = walk_sampled(
                    children(request.spec_tree_parents),
                    request.spec_token_ids,
                    probs[start : start + count],
                    request.generator,
                )
            result.paths[request.request_id] = path
            result.token_ids[request.request_id] = [request.spec_token_ids[i] for i in path] + [token]
            final_rows.append([start] + [start + 1 + i for i in path])
        if processing is not None and processing.failed_rows and failed is not None:
            failed.extend(dict.fromkeys(rows[row].request_id for row in sorted(processing.failed_rows)))
        if metadata.max_num_logprobs is not None:
            result.logprobs = _logprobs(requests, result.token_ids, final_rows, processed)
        return result

    def _greedy_paths(
        self, requests: Sequence[SamplingRequest], starts: np.ndarray, argmax: torch.Tensor
    ) -> list[tuple[list[int], int]]:
        """Each greedy tree's (accepted drafts, final token), all at once (`accept_greedy`)."""
        if not requests:
            return []
        layout = self._layout(
            tuple(tree_shape(r.spec_tree_parents) for r in requests), tuple(starts.tolist())
        )
        token_ids = np.zeros((len(requests), layout.width), dtype=np.int64)
        for row, request in enumerate(requests):
            token_ids[row, : len(request.spec_token_ids)] = request.spec_token_ids
        packed = accept_greedy(layout, torch.from_numpy(token_ids).to(argmax.device), argmax)
        packed = packed.cpu().numpy()  # the step's one copy to the host for greedy trees
        return [(np.flatnonzero(row[1:]).tolist(), int(row[0])) for row in packed]

    def _layout(self, shapes: tuple[TreeShape, ...], starts: tuple[int, ...]) -> GreedyTreeLayout:
        """The cached layout of these shapes at these root rows (least recently used dropped first)."""
        key = (shapes, starts)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = GreedyTreeLayout.build(shapes, starts, self.device)
            if len(self._layouts) > self.MAX_LAYOUTS:
                self._layouts.popitem(last=False)
        self._layouts.move_to_end(key)
        return layout


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
