"""Decode attention kernel alone: 64 sequences, block 16, random block tables in a 45,000-block pool.

Prints the median ms per call (one layer) at contexts 100, 300 and 1,000. To compare two builds, run
it alternately from two checkouts: PYTHONPATH=<checkout> python docs/scripts/decode_attention_micro.py TAG
"""

import functools
import sys
import time

import torch

from llmserve.kernels.cpu_ops import load_cpu_ops

BATCH, BLOCK, POOL_BLOCKS = 64, 16, 45_000


def median_ms(function, repeats: int = 60) -> float:
    for _ in range(5):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    ops = load_cpu_ops()
    results = []
    for context in (100, 300, 1000):
        gen = torch.Generator().manual_seed(0)
        key_cache, value_cache = (
            torch.randn(POOL_BLOCKS * BLOCK, 3, 64, generator=gen).bfloat16() for _ in range(2)
        )
        blocks = -(-context // BLOCK)
        tables = torch.randperm(POOL_BLOCKS, generator=gen)[: BATCH * blocks].view(BATCH, blocks)
        lens = torch.full((BATCH,), context, dtype=torch.int64)
        query = torch.randn(BATCH, 9, 64, generator=gen).bfloat16()
        call = functools.partial(
            ops.paged_attention, query, key_cache, value_cache, tables, lens, torch.arange(BATCH + 1),
            BLOCK, 0.125, 0, 0, 0,
        )  # fmt: skip
        results.append(f"{context}:{median_ms(call):.3f}")
    print(sys.argv[1] if len(sys.argv) > 1 else "", " ".join(results))


if __name__ == "__main__":
    main()
