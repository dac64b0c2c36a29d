"""Medusa heads (Cai et al., 2024): K residual heads on the target's last hidden state, drafting a tree.

The target's forward already computes the final hidden state h_t that the next token x_{t+1} is
sampled from. Head k (0-based) maps h_t to logits for x_{t+2+k}:

    logits_k = W_k (h_t + silu(A_k h_t + b_k))      (a residual block, then a vocabulary projection)

All heads read the same h_t, so a head's top candidates do not depend on the drafts before them:
the proposal is a static tree (`DEFAULT_TREE`) whose node (r_1, ..., r_d) is the r_d-th best token of
head d - 1 under the node (r_1, ..., r_{d-1}). Nodes are listed parents first, most likely first, so
the K a request may verify are the first K nodes (a prefix of a tree is a tree). The tree is verified
in one pass (sample/tree_verifier.py): greedy requests keep the target's argmax path, sampling
requests go through recursive rejection with one-hot q, so the output is the target's in both.
Structured-output requests get the top-1 chain only (their grammar follows one path).

Files: the published Medusa layout (FasterDecoding/Medusa, one residual block per head):
`medusa_head.{k}.0.linear.weight` [H, H], `medusa_head.{k}.0.linear.bias` [H] and
`medusa_head.{k}.1.weight` [V, H], in a safetensors file or a PyTorch state dict; `llmserve
train-draft-head --medusa-heads K` writes one for any target (self-distillation, medusa_training.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from llmserve.config import EngineConfig
from llmserve.request import DraftProposal
from llmserve.spec_decode.proposer import SampledBatch

# Medusa's static tree by top-k ranks per depth, parents first and most likely first (a prefix is a
# good smaller tree): top-3 at depth 1, top-3 under the best depth-1 token, then depth 3 and 4.
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0), (3,), (0, 2), (2, 0),
    (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (4,),
)  # fmt: skip


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + F.silu(self.linear(hidden))


class MedusaHeads(nn.Module):
    """K heads, named as in the published checkpoints (`medusa_head.{k}.0` the block, `.1` the projection)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int) -> None:
        super().__init__()
        self.medusa_head = nn.ModuleList(
            nn.Sequential(ResBlock(hidden_size), nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads)
        )

    @property
    def num_heads(self) -> int:
        return len(self.medusa_head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[K, B, V] each head's logits for the B hidden states."""
        return torch.stack([head(hidden) for head in self.medusa_head])


def tree_parents(choices: tuple[tuple[int, ...], ...]) -> list[int]:
    """Each node's parent index (-1: the root); ValueError unless parents come first."""
    index = {choice: i for i, choice in enumerate(choices)}
    parents = []
    for i, choice in enumerate(choices):
        parent = index.get(choice[:-1], -1) if len(choice) > 1 else -1
        if len(choice) > 1 and not 0 <= parent < i:
            raise ValueError(f"tree node {choice} comes before its parent")
        parents.append(parent)
    return parents


def load_medusa_heads(path: str, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Heads from a file in the published layout; a one-line ValueError where it does not fit."""
    state = load_file(path) if path.endswith(".safetensors") else torch.load(path, map_location="cpu")
    state = {name: tensor for name, tensor in state.items() if name.startswith("medusa_head.")}
    if any(".1.linear." in name for name in state):
        raise ValueError(f"{path}: Medusa heads of more than one residual block are not supported")
    num_heads = len({name.split(".")[1] for name in state})
    if num_heads == 0:
        raise ValueError(f"{path} holds no medusa_head.* tensors")
    heads = MedusaHeads(hidden_size, vocab_size, num_heads)
    expected = {name: tuple(t.shape) for name, t in heads.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in state.items()}
    if found != expected:
        raise ValueError(
            f"{path}: Medusa heads do not fit this target: its heads need [{hidden_size}, {hidden_size}] "
            f"blocks and [{vocab_size}, {hidden_size}] projections"
        )
    heads.load_state_dict({name: t.float() for name, t in state.items()})
    return heads.eval()


def save_medusa_heads(path: str, heads: MedusaHeads, metadata: dict[str, str] | None = None) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in heads.state_dict().items()}
    save_file(state, path, metadata=metadata)


class MedusaProposer:
    def __init__(self, heads: MedusaHeads, k: int, dtype: torch.dtype, tree=DEFAULT_TREE) -> None:
        self.tree = tuple(choice for choice in tree if len(choice) <= heads.num_heads)
        self.parents = tree_parents(self.tree)
        self.heads = heads.to(dtype)
        self.k = min(k, len(self.tree))
        self.top = 1 + max(max(choice) for choice in self.tree)  # candidates per head

    @torch.inference_mode()
    def propose(self, batch: SampledBatch) -> dict[str, DraftProposal | None]:
        limits = [batch.draft_limit(i, self.k) for i in range(len(batch.requests))]
        active = [i for i, limit in enumerate(limits) if limit > 0]
        proposals: dict[str, DraftProposal | None] = {r.request_id: None for r in batch.requests}
        if not active:
            return proposals
        hidden = batch.last_hidden()[torch.tensor(active, device=batch.hidden.device)]
        hidden = hidden.to(next(self.heads.parameters()).device, self.heads.medusa_head[0][1].weight.dtype)
        candidates = self.heads(hidden).topk(self.top, dim=-1).indices.permute(1, 0, 2).tolist()  # host sync
        for row, i in enumerate(active):
            request = batch.requests[i]
            tokens = [candidates[row][len(choice) - 1][choice[-1]] for choice in self.tree]
            if request.sampling_params.structured_outputs is not None:  # one path: the top-1 chain
                chain = [n for n, choice in enumerate(self.tree) if not any(choice)]
                proposals[request.request_id] = DraftProposal(
                    batch.num_tokens(i), [tokens[n] for n in chain][: limits[i]]
                )
                continue
            proposals[request.request_id] = DraftProposal(
                batch.num_tokens(i), tokens[: limits[i]], parents=self.parents[: limits[i]]
            )
        return proposals


def create_medusa_proposer(config: EngineConfig, target: nn.Module) -> MedusaProposer:
    """The heads of `--speculative-draft-head` for `target`, on its device, in its dtype."""
    path = config.speculative.draft_head
    arch = config.model.arch
    heads = load_medusa_heads(path, arch.hidden_size, arch.vocab_size).to(config.model.device)
    return MedusaProposer(heads, config.speculative.num_speculative_tokens, config.model.dtype)
