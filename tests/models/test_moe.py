"""The experts layer runs each expert over only its routed tokens, and equals the per-token sum."""

import torch

from llmserve.models.layers.moe import MoEExperts


def test_experts_no_token_chose_are_never_read():
    """Sparse cost: unrouted experts' weights are NaN, and the output is still finite and equal to
    the per-token reference."""
    torch.manual_seed(0)
    experts = MoEExperts(num_experts=8, hidden_size=16, intermediate_size=24)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
        hidden = torch.randn(5, 16)
        chosen = torch.tensor([[1, 3], [3, 1], [6, 1], [3, 6], [1, 6]])
        weights = torch.rand(5, 2)
        unused = [e for e in range(8) if e not in chosen]
        experts.gate_up_proj[unused] = float("nan")
        experts.down_proj[unused] = float("nan")
        out = experts(hidden, weights, chosen)
        expected = torch.zeros_like(hidden)
        for token in range(5):
            for slot in range(2):
                e = chosen[token, slot]
                gate, up = (experts.gate_up_proj[e] @ hidden[token]).chunk(2)
                expected[token] += weights[token, slot] * (
                    experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)
                )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_grouped_experts_equal_one_matmul_pair_per_expert():
    torch.manual_seed(1)
    experts = MoEExperts(num_experts=6, hidden_size=16, intermediate_size=24)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
        routed = torch.randn(7, 16)
        ends = torch.tensor([2, 2, 5, 5, 5, 7], dtype=torch.int32)  # experts 1, 3 and 4 have no tokens
        gate_up = torch._grouped_mm(routed, experts.gate_up_proj.transpose(1, 2), offs=ends)
        grouped = torch._grouped_mm(experts.act_fn(gate_up), experts.down_proj.transpose(1, 2), offs=ends)
        torch.testing.assert_close(experts.per_expert(routed, ends), grouped, atol=1e-5, rtol=1e-5)


def test_a_run_of_the_experts_computes_only_their_pairs():
    """Expert parallelism's rank holds experts 2-4 of the router's 8: it computes the pairs routed
    there (the other experts' weights are not even held), and tokens with none get zeros."""
    torch.manual_seed(2)
    whole = MoEExperts(num_experts=8, hidden_size=16, intermediate_size=24)
    run = MoEExperts(num_experts=3, hidden_size=16, intermediate_size=24, first_expert=2, router_experts=8)
    with torch.no_grad():
        whole.gate_up_proj.normal_()
        whole.down_proj.normal_()
        run.gate_up_proj.copy_(whole.gate_up_proj[2:5])
        run.down_proj.copy_(whole.down_proj[2:5])
        hidden = torch.randn(6, 16)
        chosen = torch.tensor([[2, 7], [4, 3], [0, 1], [7, 2], [3, 4], [6, 5]])
        weights = torch.rand(6, 2)
        mine = (chosen >= 2) & (chosen < 5)
        out = run(hidden, weights, chosen)
        expected = whole(hidden, weights * mine, chosen)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros(16)) and torch.equal(out[5], torch.zeros(16))
