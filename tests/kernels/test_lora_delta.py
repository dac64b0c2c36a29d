"""The compiled LoRA delta (kernels/csrc/lora.cpp): every row's adapter by its slot, in one call, equal
to the per-adapter matmuls in a wider type (bf16 adapters: the shrink's output rounded to bf16), each
row the same whatever else the call holds."""

import pytest
import torch

from llmserve.kernels.cpu_ops import load_cpu_ops
from tests.kernels.lora_stacks import random_stacks, reference

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels("avx2")
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize(
    "shard_sizes",
    [(24,), (16, 8, 8), (48, 16, 16), (136, 16, 24)],
    ids=["one-shard", "qkv-like", "wide", "wider"],
)
# 8 lanes; 16 where the level has AVX-512; bf16 pairs of 32 (vdpbf16ps) where it has AVX-512 BF16
@pytest.mark.parametrize("in_features", [40, 64])
def test_each_row_gets_its_slots_delta(dtype, rows, shard_sizes, in_features):
    """Rows of three slots and none, a slot of width 0 (an adapter without this layer), a rank short
    of the stack's (a smaller adapter), one layer and three fused shards (only B's blocks read)."""
    a, bt, widths, starts = random_stacks(shard_sizes, in_features=in_features, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    out = torch.randn(rows, sum(shard_sizes), generator=gen).to(dtype)
    token_slots = torch.randint(-1, 3, (rows,), generator=gen)
    expected = reference(x, out, a, bt, token_slots, widths, starts, round_hidden=dtype == torch.bfloat16)
    ops.lora_delta(x, out, a, bt, token_slots, widths, starts)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])
    untouched = (token_slots < 0) | (token_slots == 2)
    assert torch.equal(out[untouched].double(), expected[untouched])  # no delta, not even a rounding


def test_rows_of_wider_tensors():
    """x and out as column slices of wider rows (a fused projection's part, an output the stack
    narrowed): rows read and written through their strides, the rest of each row untouched."""
    a, bt, widths, starts = random_stacks((16, 8, 8))
    gen = torch.Generator().manual_seed(3)
    wide_x, wide_out = torch.randn(6, 56, generator=gen), torch.randn(6, 48, generator=gen)
    x, out = wide_x[:, 8:48], wide_out[:, 16:48]
    token_slots = torch.tensor([0, 1, -1, 0, 2, 1])
    expected = reference(x, out, a, bt, token_slots, widths, starts)
    before = wide_out.clone()
    ops.lora_delta(x, out, a, bt, token_slots, widths, starts)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[torch.float32])
    assert torch.equal(wide_out[:, :16], before[:, :16])


# 296: a lone row's tile is past the split's work gate, its shrink 8 lanes wide at every level
@pytest.mark.parametrize("in_features", [40, 64, 296])
def test_a_rows_result_does_not_depend_on_the_rest_of_the_call(in_features):
    """Rows tiled with their slot's other rows (tiles dealt to the threads), or alone to up to eight (a
    call's only tile, split among the threads by columns and output rows), on one thread or all, with
    8 lanes, 16 or bf16 pairs (in_features 64 where the level has AVX-512, AVX-512 BF16): the same
    bits."""
    a, bt, widths, starts = random_stacks((136, 16, 24), ranks=(12, 4, 3), in_features=in_features)
    a, bt = a.bfloat16(), bt.bfloat16()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, in_features, generator=gen).bfloat16()
    base = torch.randn(300, 176, generator=gen).bfloat16()
    token_slots = torch.randint(0, 3, (300,), generator=gen)
    together = base.clone()
    ops.lora_delta(x, together, a, bt, token_slots, widths, starts)
    all_slot_0 = base.clone()  # every row under slot 0 (the widest): tiles of the most rows
    ops.lora_delta(x, all_slot_0, a, bt, torch.zeros_like(token_slots), widths, starts)
    threads = torch.get_num_threads()
    try:
        for num_threads in {1, threads}:
            torch.set_num_threads(num_threads)
            for rows in (
                [0],
                [137],
                [299],
                [5, 9],
                [5, 9, 11],
                [1, 2, 3, 4],
                [7, 8, 9, 10, 11, 12],
                list(range(200, 208)),
            ):
                alone = base[rows].clone()
                ops.lora_delta(
                    x[rows], alone, a, bt, torch.zeros(len(rows), dtype=torch.int64), widths, starts
                )
                assert torch.equal(alone, all_slot_0[rows])
            alone = base[[137]].clone()
            ops.lora_delta(x[[137]], alone, a, bt, token_slots[[137]], widths, starts)
            assert torch.equal(alone, together[[137]])
    finally:
        torch.set_num_threads(threads)


def test_rejects_bad_input():
    a, bt, widths, starts = random_stacks()
    x, out = torch.randn(2, 40), torch.randn(2, 24)
    slots = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.lora_delta(x, out, a, bt, torch.tensor([0, 3]), widths, starts)
    with pytest.raises(RuntimeError, match="one width per slot"):
        ops.lora_delta(x, out, a, bt, slots, widths[:2], starts)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.lora_delta(x.bfloat16(), out, a, bt, slots, widths, starts)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        ops.lora_delta(torch.randn(2, 36), out, a[..., :36].contiguous(), bt, slots, widths, starts)
    with pytest.raises(RuntimeError, match="from 0 to out_features"):
        ops.lora_delta(x, out, a, bt, slots, widths, torch.tensor([0, 16]))
