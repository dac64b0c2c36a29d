"""Slot stacks laid out as lora/weights.py writes them, and the float64 delta they must add: the
compiled CPU kernel's tests and the Triton kernel's."""

import torch


def random_stacks(shard_sizes=(24,), ranks=(4, 2, 0), in_features=40, dtype=torch.float32, seed=0):
    """A [slots, W, in], Bt [slots, W, out] and the widths, W = shards * the largest rank, laid out as
    lora/weights.py writes an adapter of rank r: shard p's A rows and Bt columns at p * r, its Bt block
    feeding only the shard's output rows; NaN everywhere else in Bt, which must never be read."""
    gen = torch.Generator().manual_seed(seed)
    shards, out_features = len(shard_sizes), sum(shard_sizes)
    width = shards * max(ranks)
    a = torch.full((len(ranks), width, in_features), float("nan"), dtype=dtype)  # rows past a rank: NaN
    bt = torch.full((len(ranks), width, out_features), float("nan"), dtype=dtype)
    starts = [0, *torch.tensor(shard_sizes).cumsum(0).tolist()]
    for slot, rank in enumerate(ranks):
        a[slot, : shards * rank] = torch.randn(shards * rank, in_features, generator=gen).to(dtype)
        for p in range(shards):
            block = torch.randn(rank, shard_sizes[p], generator=gen).to(dtype)
            bt[slot, p * rank : (p + 1) * rank, starts[p] : starts[p + 1]] = block
    return a, bt, torch.tensor([shards * rank for rank in ranks]), torch.tensor(starts)


def reference(x, out, a, bt, token_slots, widths, starts, round_hidden=False):
    """out[t] + (A[s] x[t]) Bt[s] in float64, block by block, columns past the slot's width left out;
    `round_hidden`: A[s] x[t] rounded to bf16 first (the CPU kernel's bf16 adapters, as PEFT's bf16
    modules round lora_A's output)."""
    expected = out.double().clone()
    shards = len(starts) - 1
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        rank = int(widths[slot]) // shards
        for p in range(shards):
            columns, rows = slice(p * rank, (p + 1) * rank), slice(int(starts[p]), int(starts[p + 1]))
            hidden = a[slot, columns].double() @ x[t].double()
            if round_hidden:
                hidden = hidden.to(torch.bfloat16).double()
            expected[t, rows] += hidden @ bt[slot, columns, rows].double()
    return expected
