"""A mixture-of-experts MLP: top-k routing, then every expert over only the tokens routed to it.

The (token, expert) pairs are sorted by expert, so each expert's tokens form one contiguous slice,
and one grouped matmul (`torch._grouped_mm`: one matmul per group of rows, groups given by their end
offsets) runs every expert's gate/up projection over its slice, another its down projection. An
expert no token chose costs an empty group; nothing is computed densely over all experts, there is no
Python loop over experts and no host sync (but where a rank holds only some of the experts: expert
parallelism), so at batch 1 the cost follows top-k, not the expert count.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.distributed.expert_parallel import held_pairs
from llmserve.models.layers.activation import SiluAndMul


class MoEExperts(nn.Module):
    """Every held expert's SwiGLU MLP, stacked: gate_up_proj [E, 2 * I, H] ([gate; up] rows, HF's
    layout), down_proj [E, H, I]. It holds the router's experts first_expert .. first_expert + E - 1
    of `router_experts` (all of them but under expert parallelism)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        first_expert: int = 0,
        router_experts: int | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act_fn = SiluAndMul()
        self.held = range(first_expert, first_expert + num_experts)
        self.router_experts = router_experts or num_experts

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts (those held) of weight * expert(token); weights, experts:
        [tokens, k], experts numbered as the router numbers them."""
        order, counts = held_pairs(experts, self.held, self.router_experts)
        tokens = order // experts.shape[1]
        ends = counts.cumsum(0).to(torch.int32)
        routed = hidden[tokens]
        if hidden.is_cuda and hidden.dtype != torch.bfloat16:  # CUDA's grouped GEMM is bf16 only
            out = self.per_expert(routed, ends)
        else:
            gate_up = torch._grouped_mm(routed, self.gate_up_proj.transpose(1, 2), offs=ends)
            out = torch._grouped_mm(self.act_fn(gate_up), self.down_proj.transpose(1, 2), offs=ends)
        out = out * weights.flatten()[order].unsqueeze(1).to(out.dtype)
        return torch.zeros_like(hidden).index_add_(0, tokens, out)

    def per_expert(self, routed: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The grouped matmuls as one matmul pair per expert that has tokens (one host sync for the
        slice bounds): what CUDA runs outside bf16, and the grouped path's test oracle."""
        out = torch.empty_like(routed)
        bounds = [0, *ends.tolist()]
        for expert in torch.nonzero(ends.diff(prepend=ends.new_zeros(1))).flatten().tolist():
            rows = slice(bounds[expert], bounds[expert + 1])
            gate_up = routed[rows] @ self.gate_up_proj[expert].T
            out[rows] = self.act_fn(gate_up) @ self.down_proj[expert].T
        return out


class SparseMoE(nn.Module):
    """A router (`gate`), softmax over all experts, the top k; Mixtral renormalizes them to sum 1,
    Qwen3-MoE where `norm_topk_prob` says so."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool = True
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, *self.route(hidden))

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each [tokens, top_k]: the chosen experts and their float32 weights."""
        probs = self.gate(hidden).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts
