"""How many more tokens a KV pool holds when sliding layers keep only their window (a computed figure).

    python -m benchmarks.tools.kv_capacity [--layers 26] [--global-every 6] [--window 512] \
        [--block-size 16] [--lengths 1024 4096 32768]

For a model whose every `global-every`-th layer is global and the others slide over `window`
positions, it splits the layers into KV-cache groups as the engine does (config/kv_groups.py) and
counts the layer-blocks (a block of one layer) a decoding sequence of each length holds: with full KV,
every layer keeps every block; bounded, global groups keep every block and sliding groups only their
window's, each block sized for the group's layers (a shorter last group wastes the difference). The
ratio is how many more such sequences, or tokens, one pool holds. Pure arithmetic: no timing.
"""

from __future__ import annotations

import argparse
import json

from llmserve.config.kv_groups import SLIDING, group_size, kv_cache_groups


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sequence_blocks(length: int, window: int, block_size: int) -> int:
    """Blocks one group holds for a decoding sequence of `length` tokens (its query at length - 1)."""
    if not window:
        return cdiv(length, block_size)
    return (length - 1) // block_size - max(length - window, 0) // block_size + 1


def capacity(layer_types: tuple[str, ...], window: int, block_size: int, length: int) -> dict:
    groups = kv_cache_groups(layer_types, window)
    bounded = group_size(groups) * sum(sequence_blocks(length, g.window, block_size) for g in groups)
    full = len(layer_types) * cdiv(length, block_size)
    return dict(
        length=length,
        groups=len(groups),
        layers_per_block=group_size(groups),
        layer_blocks_full=full,
        layer_blocks_bounded=bounded,
        capacity_ratio=round(full / bounded, 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--global-every", type=int, default=6, help="every k-th layer is global (Gemma 3: 6)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 32768])
    args = parser.parse_args()
    types = tuple(
        "full_attention" if (i + 1) % args.global_every == 0 else SLIDING for i in range(args.layers)
    )
    for length in args.lengths:
        print(json.dumps(capacity(types, args.window, args.block_size, length)))


if __name__ == "__main__":
    main()
