"""`--speculative-method eagle`: the draft head (draft_head.py) expanded as a token tree by its top-k.

EAGLE's drafting in the draft head's terms: from the target's final hidden state f_t and the token
x_{t+1} just sampled, the head guesses the next feature g; its logits over the vocabulary subset give
candidates for x_{t+2}. Where the draft head keeps only the best candidate and feeds it back (a
chain), this proposer keeps the ranks a static tree asks for (`medusa.DEFAULT_TREE`'s shape: node
(r_1, ..., r_d) is the r_d-th best token under node (r_1, ..., r_{d-1})) and feeds each kept node's
token back from its parent's feature, so every branch has its own continuation (unlike Medusa's
heads, which read one feature). One head call per depth serves every node of that depth in the batch.

The tree is verified by sample/tree_verifier.py as any tree (one-hot q: the candidates are not
samples), so greedy tokens are the target's and sampled ones distributed as the target's. Not done:
EAGLE-2's dynamic tree (expanding the nodes of highest chained confidence), EAGLE's attention layer
(the draft head has none), and prompt lookup before the head (draft_head's first rule).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmserve.config import EngineConfig
from llmserve.request import DraftProposal
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.spec_decode.proposers.draft_head import (
    DraftHead,
    load_draft_head,
    packaged_draft_head,
    subset_lm_head_weight,
)
from llmserve.spec_decode.proposers.medusa import DEFAULT_TREE, tree_parents

logger = logging.getLogger("llmserve")


class EagleTreeProposer:
    def __init__(self, head: DraftHead, target: nn.Module, k: int, tree=DEFAULT_TREE) -> None:
        self.head = head
        self.embed_tokens = target.model.embed_tokens
        self.tree = tuple(tree[: min(k, len(tree))])  # the first K nodes: a tree (parents come first)
        self.parents = tree_parents(self.tree)
        self.top = 1 + max(max(choice) for choice in self.tree)
        self.depth = max(len(choice) for choice in self.tree)
        self.subset_weight = subset_lm_head_weight(target, head.vocab_ids).to(head.fc_in.weight.dtype)

    @torch.inference_mode()
    def propose(self, batch: SampledBatch) -> dict[str, DraftProposal | None]:
        limits = [batch.draft_limit(i, len(self.tree)) for i in range(len(batch.requests))]
        active = [i for i, limit in enumerate(limits) if limit > 0]
        proposals: dict[str, DraftProposal | None] = {r.request_id: None for r in batch.requests}
        if not active:
            return proposals
        hidden = batch.last_hidden()[torch.tensor(active, device=batch.hidden.device)]
        last = [batch.new_token_ids[i][-1] for i in active]
        tokens = self._expand(hidden.to(self.subset_weight.dtype), last)  # [A, nodes] on the host
        for row, i in enumerate(active):
            request, limit = batch.requests[i], limits[i]
            if request.sampling_params.structured_outputs is not None:  # one path: the top-1 chain
                chain = [n for n, choice in enumerate(self.tree) if not any(choice)][:limit]
                proposals[request.request_id] = DraftProposal(
                    batch.num_tokens(i), [tokens[row][n] for n in chain]
                )
                continue
            proposals[request.request_id] = DraftProposal(
                batch.num_tokens(i), tokens[row][:limit], parents=self.parents[:limit]
            )
        return proposals

    def _expand(self, hidden: torch.Tensor, last: list[int]) -> list[list[int]]:
        """Each request's token per tree node: depth by depth, a head step from every node that has
        children (the root first: f_t and the sampled token), its top candidates for them."""
        rows = len(last)
        device = hidden.device
        # the features and tokens the head steps from, per (request, node): the root is node -1
        features = {-1: hidden}
        step_tokens = {-1: torch.tensor(last, dtype=torch.int64, device=device)}
        node_tokens = torch.zeros(rows, len(self.tree), dtype=torch.int64, device=device)
        index = {choice: n for n, choice in enumerate(self.tree)}
        for depth in range(1, self.depth + 1):
            parents = sorted({self.parents[n] for n, c in enumerate(self.tree) if len(c) == depth})
            feature = self.head(
                torch.cat([features[p] for p in parents]),
                self.embed_tokens(torch.cat([step_tokens[p] for p in parents])),
            )
            top = (feature @ self.subset_weight.T).topk(self.top, dim=-1).indices
            top = self.head.vocab_ids[top].view(len(parents), rows, self.top)
            for position, parent in enumerate(parents):
                features[parent] = feature[position * rows : (position + 1) * rows]  # the parent's guess
                prefix = () if parent < 0 else self.tree[parent]
                for rank in range(self.top):
                    node = index.get((*prefix, rank))
                    if node is not None:
                        node_tokens[:, node] = top[position, :, rank]
                        step_tokens[node] = top[position, :, rank]
            # a node's children step from the feature the head guessed at its parent, fed its token
            for n, choice in enumerate(self.tree):
                if len(choice) == depth:
                    features[n] = features[self.parents[n]]
        return node_tokens.tolist()  # the host sync


def create_eagle_proposer(config: EngineConfig, target: nn.Module) -> EagleTreeProposer:
    """The draft head of `--speculative-draft-head` (default: the one shipped for the default model)."""
    spec = config.speculative
    path = spec.draft_head or packaged_draft_head()
    head = load_draft_head(path, target, config.model.dtype, config.model.device)
    logger.info(
        "speculative decoding: eagle, draft head %s expanded as a tree of up to %d nodes",
        path,
        spec.num_speculative_tokens,
    )
    return EagleTreeProposer(head, target, spec.num_speculative_tokens)
