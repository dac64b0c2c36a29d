"""The causal prefill attention of one prompt, per kernel: ms per layer at SmolLM2-135M's head shapes.

    python -m benchmarks.tools.prefill_attention_micro [--lengths 128,256,650,1300] [--repeats 20]

For each prompt length (the whole prompt, no cached prefix): the compiled kernel on bf16 inputs by the
path this CPU takes (`prefill_attention_path`: AVX-512 BF16, or float32 arithmetic on AVX2), on AMX's
tile products too where the CPU has them, and PyTorch's bf16 SDPA on the same inputs for reference.
Median of --repeats, with the largest difference between the kernels' outputs.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from benchmarks.tools.timing import median_seconds
from llmserve.kernels.cpu_ops import load_cpu_ops


def run(
    lengths: Sequence[int], heads: int = 9, kv_heads: int = 3, head_dim: int = 64, repeats: int = 20
) -> list[dict]:
    ops = load_cpu_ops()
    if ops is None or not ops.prefill_attention_supported(torch.bfloat16):
        raise SystemExit("the prefill attention kernel needs the compiled kernels (AVX2 and FMA)")
    path = ops.prefill_attention_path(torch.bfloat16)
    kernels = {"amx": True, "avx512_bf16": False} if path == "amx" else {path: False}
    generator = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    results = []
    for length in lengths:
        query = torch.randn(length, heads, head_dim, generator=generator).bfloat16()
        key_cache = torch.randn(length, kv_heads, head_dim, generator=generator).bfloat16()
        value_cache = torch.randn(length, kv_heads, head_dim, generator=generator).bfloat16()
        slots = torch.arange(length)
        outputs, row = {}, {"tokens": length}
        for name, use_amx in kernels.items():
            call = functools.partial(
                ops.prefill_attention, query, key_cache, value_cache, slots, scale, use_amx
            )
            row[f"{name}_ms"] = 1e3 * median_seconds(call, repeats)
            outputs[name] = call().float()
        sdpa = functools.partial(
            F.scaled_dot_product_attention,
            query.transpose(0, 1),
            key_cache.transpose(0, 1),
            value_cache.transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        row["torch_sdpa_ms"] = 1e3 * median_seconds(sdpa, repeats)
        if "amx" in outputs:
            row["amx_speedup"] = row["avx512_bf16_ms"] / row["amx_ms"]
            row["max_abs_diff"] = (outputs["amx"] - outputs["avx512_bf16"]).abs().max().item()
        results.append(row)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="128,256,650,1300", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    lengths = [int(length) for length in args.lengths.split(",")]
    print(f"threads {torch.get_num_threads()}; ms per layer (9 query heads, 3 KV heads, head_dim 64)")
    for row in run(lengths, repeats=args.repeats):
        cells = (
            f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
            for key, value in row.items()
        )
        print("  ".join(cells))


if __name__ == "__main__":
    main()
