"""The Triton LoRA delta (the CUDA path, kernels/triton/lora.py) against the float64 reference the compiled
CPU kernel is held to: run by the Triton interpreter on CPU tensors, or compiled on a GPU with
LLMSERVE_TEST_DEVICE=cuda (the values drawn on the CPU alike). The stacks hold NaN wherever a slot's
adapter does not reach (A's rows past its width, Bt outside its shard blocks): a read of any fails."""

import pytest

from tests.triton_interpreter import TEST_DEVICE, triton_loop_bounds, use_interpreter  # noqa: F401

use_interpreter()  # before the kernels are imported: on the CPU they run interpreted

pytest.importorskip("triton", reason="the Triton kernels need triton")

import torch  # noqa: E402

from llmserve.kernels.triton import lora  # noqa: E402
from tests.kernels.lora_stacks import random_stacks, reference  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("LLMSERVE_TEST_DEVICE=cuda but this machine has no CUDA device", allow_module_level=True)

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-2, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2},
}


def run(x, out, a, bt, token_slots, widths, starts):
    """lora_delta on copies on DEVICE (the arguments untouched); out's rows as they come back."""
    moved = [t.to(DEVICE, copy=True) for t in (x, out, a, bt, token_slots, widths, starts)]
    lora.lora_delta(*moved)
    return moved[1].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("shard_sizes", "ranks", "in_features"),
    [
        ((24,), (4, 2, 0), 40),
        ((16, 8, 8), (4, 2, 0), 40),
        ((136, 16, 24), (4, 2, 0), 40),
        ((256, 64, 72), (12, 5, 0), 200),
    ],
    ids=["one-shard", "qkv-like", "uneven", "many-blocks"],
)
def test_each_row_gets_its_slots_delta(dtype, shard_sizes, ranks, in_features):
    """Rows of three slots and none, a slot of width 0 (an adapter without this layer), a rank short of
    the stack's, one layer and three fused shards, and a layer of several blocks of A's rows, inputs
    and outputs: as the reference, rows without a delta untouched."""
    a, bt, widths, starts = random_stacks(shard_sizes, ranks=ranks, in_features=in_features, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, in_features, generator=gen).to(dtype)
    out = torch.randn(7, sum(shard_sizes), generator=gen).to(dtype)
    token_slots = torch.tensor([0, -1, 1, 2, 0, 1, -1])
    expected = reference(x, out, a, bt, token_slots, widths, starts)
    result = run(x, out, a, bt, token_slots, widths, starts)
    torch.testing.assert_close(result.double(), expected, **TOLERANCE[dtype])
    untouched = (token_slots < 0) | (token_slots == 2)
    assert torch.equal(result[untouched].double(), expected[untouched])


def test_rows_of_wider_tensors_and_a_rows_result_alone():
    """x and out as column slices of wider rows (read and written through their strides, the rest of
    each row untouched); a row alone gets the bits it gets among the others."""
    a, bt, widths, starts = random_stacks((16, 8, 8), ranks=(4, 3, 2))
    gen = torch.Generator().manual_seed(3)
    wide_x, wide_out = torch.randn(6, 56, generator=gen), torch.randn(6, 48, generator=gen)
    token_slots = torch.tensor([0, 1, -1, 0, 2, 1])
    x, out = wide_x[:, 8:48], wide_out[:, 16:48]
    expected = reference(x, out, a, bt, token_slots, widths, starts)
    moved_x, moved_out = wide_x.to(DEVICE, copy=True), wide_out.to(DEVICE, copy=True)
    stacks = [t.to(DEVICE) for t in (a, bt, token_slots, widths, starts)]
    lora.lora_delta(moved_x[:, 8:48], moved_out[:, 16:48], *stacks)
    together = moved_out.cpu()
    torch.testing.assert_close(together[:, 16:48].double(), expected, **TOLERANCE[torch.float32])
    assert torch.equal(together[:, :16], wide_out[:, :16])
    for row in (0, 4, 5):
        alone = run(x[[row]], out[[row]], a, bt, token_slots[[row]], widths, starts)
        assert torch.equal(alone, together[[row], 16:48])


def test_refuses_what_it_does_not_take():
    a, bt, widths, starts = random_stacks()
    x, out = torch.randn(2, 40, device=DEVICE), torch.randn(2, 24, device=DEVICE)
    rest = [t.to(DEVICE) for t in (a, bt, torch.tensor([0, 1]), widths, starts)]
    with pytest.raises(ValueError, match="one float dtype"):
        lora.lora_delta(x.bfloat16(), out, *rest)
    with pytest.raises(ValueError, match="one float dtype"):
        lora.lora_delta(x[:, :32], out, *rest)
    with pytest.raises(ValueError, match="one slot per row"):
        lora.lora_delta(x, out, rest[0], rest[1], rest[2][:1], *rest[3:])
    with pytest.raises(ValueError, match="a width per slot"):
        lora.lora_delta(x, out, *rest[:3], rest[3][:2], rest[4])
    lora.lora_delta(x[:0], out[:0], rest[0], rest[1], rest[2][:0], *rest[3:])  # no rows: nothing to do
