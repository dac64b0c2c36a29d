"""The compiled LoRA delta (kernels/csrc/lora.cpp): every row's adapter by its slot, in one call, equal
to the per-adapter matmuls in a wider type, each row the same whatever else the call holds."""

import pytest
import torch

from llmserve.kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels("avx2")
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}}


def random_stacks(slots=3, width=12, in_features=40, out_features=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, width, in_features, generator=gen).to(dtype)
    bt = torch.randn(slots, width, out_features, generator=gen).to(dtype)
    return a, bt


def reference(x, out, a, bt, token_slots, widths):
    """out[t] + (A[s] x[t]) Bt[s] in float64, columns past the slot's width left out."""
    expected = out.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        used = int(widths[slot])
        hidden = a[slot, :used].double() @ x[t].double()
        expected[t] += hidden @ bt[slot, :used].double()
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_each_row_gets_its_slots_delta(dtype, rows):
    """Rows of three slots and none, a slot of width 0 (an adapter without this layer), widths short
    of W (a smaller rank), feature counts of 8 and of 16 lanes."""
    a, bt = random_stacks(dtype=dtype)
    widths = torch.tensor([12, 5, 0])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    out = torch.randn(rows, 24, generator=gen).to(dtype)
    token_slots = torch.randint(-1, 3, (rows,), generator=gen)
    expected = reference(x, out, a, bt, token_slots, widths)
    ops.lora_delta(x, out, a, bt, token_slots, widths)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])
    untouched = (token_slots < 0) | (token_slots == 2)
    assert torch.equal(out[untouched].double(), expected[untouched])  # no delta, not even a rounding


def test_a_rows_result_does_not_depend_on_the_rest_of_the_call():
    a, bt = random_stacks(dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 40, generator=gen).bfloat16()
    base = torch.randn(300, 24, generator=gen).bfloat16()
    token_slots = torch.randint(0, 3, (300,), generator=gen)
    together = base.clone()
    ops.lora_delta(x, together, a, bt, token_slots, torch.tensor([12, 12, 12]))
    for t in (0, 137, 299):
        alone = base[t : t + 1].clone()
        ops.lora_delta(x[t : t + 1], alone, a, bt, token_slots[t : t + 1], torch.tensor([12, 12, 12]))
        assert torch.equal(alone, together[t : t + 1])


def test_rejects_bad_input():
    a, bt = random_stacks()
    x, out = torch.randn(2, 40), torch.randn(2, 24)
    slots = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.lora_delta(x, out, a, bt, torch.tensor([0, 3]), torch.tensor([12, 12, 12]))
    with pytest.raises(RuntimeError, match="one width per slot"):
        ops.lora_delta(x, out, a, bt, slots, torch.tensor([12, 12]))
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.lora_delta(x.bfloat16(), out, a, bt, slots, torch.tensor([12, 12, 12]))
    with pytest.raises(RuntimeError, match="multiples of 8"):
        ops.lora_delta(
            torch.randn(2, 36), out, a[..., :36].contiguous(), bt, slots, torch.tensor([12, 12, 12])
        )
