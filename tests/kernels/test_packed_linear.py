"""float32 linear layers on the CPU run oneDNN on a packed copy of their weight (PackedLinear)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels.small_batch_linear import PackedLinear, use_small_batch_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def _swapped_model() -> nn.ModuleDict:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"embed": nn.Embedding(100, 64), "proj": nn.Linear(64, 96), "head": nn.Linear(64, 100)}
    )
    model["head"].weight = model["embed"].weight  # tied, as SmolLM2's lm_head
    assert use_small_batch_linear(model) == 2
    assert type(model["proj"]) is PackedLinear and type(model["head"]) is PackedLinear
    return model


@torch.no_grad()
def test_matches_f_linear_and_keeps_tied_weights():
    model = _swapped_model()
    assert model["head"].weight is model["embed"].weight
    for rows in (1, 3, 8, 40):
        x = torch.randn(rows, 64)
        for name in ("proj", "head"):
            module = model[name]
            torch.testing.assert_close(
                module(x), F.linear(x, module.weight, module.bias), atol=1e-5, rtol=1e-5
            )


@torch.no_grad()
def test_a_row_does_not_depend_on_the_others():
    """Verifying drafts (several rows) must give each row the bits that decoding it alone gives."""
    proj = _swapped_model()["proj"]
    x = torch.randn(16, 64)
    together = proj(x)
    for row in range(16):
        assert torch.equal(proj(x[row : row + 1])[0], together[row])


@torch.no_grad()
def test_a_weight_written_or_replaced_after_the_swap_is_packed_again():
    proj = _swapped_model()["proj"]
    x = torch.randn(4, 64)
    proj.weight.mul_(2)
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight, proj.bias), atol=1e-5, rtol=1e-5)
    proj.weight = nn.Parameter(torch.zeros(96, 64))
    torch.testing.assert_close(proj(x), proj.bias.expand(4, 96))


@torch.no_grad()
def test_other_dtypes_fall_back_to_f_linear():
    proj = _swapped_model()["proj"]
    x = torch.randn(2, 64, dtype=torch.float64)
    out = proj.double()(x)
    torch.testing.assert_close(out, F.linear(x, proj.weight, proj.bias))
