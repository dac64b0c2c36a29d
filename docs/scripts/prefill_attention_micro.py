"""Prefill attention alone: the compiled kernel vs PyTorch's SDPA (flash) at 128-2,048 tokens.

9 query heads, 3 KV heads, head_dim 64, the whole prompt causal; prints ms per call (one layer) and
GFLOP/s counting the causal half. Usage: python docs/scripts/prefill_attention_micro.py [DTYPE]
(bfloat16, the default, needs AVX-512 BF16; float32 needs AVX2).
"""

import functools
import sys
import time

import torch
import torch.nn.functional as F

from llmserve.kernels.cpu_ops import load_cpu_ops


def per_call_ms(function, repeats: int = 10) -> float:
    function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    ops = load_cpu_ops()
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    heads, kv_heads, head_dim = 9, 3, 64
    for length in (128, 512, 1024, 2048):
        query = torch.randn(length, heads, head_dim).to(dtype)
        keys = torch.randn(length, kv_heads, head_dim).to(dtype)
        values = torch.randn(length, kv_heads, head_dim).to(dtype)
        slots = torch.arange(length)
        ours = per_call_ms(functools.partial(ops.prefill_attention, query, keys, values, slots, 0.125))
        q, k, v = (t.transpose(0, 1)[None] for t in (query, keys, values))
        sdpa = per_call_ms(
            functools.partial(
                F.scaled_dot_product_attention, q, k, v, is_causal=True, scale=0.125, enable_gqa=True
            )
        )
        flops = 4 * length * length * head_dim * heads / 2
        print(
            f"{length}: kernel {ours:.2f} ms ({flops / ours / 1e6:.0f} GFLOP/s), "
            f"SDPA {sdpa:.2f} ms ({flops / sdpa / 1e6:.0f} GFLOP/s)"
        )


if __name__ == "__main__":
    main()
