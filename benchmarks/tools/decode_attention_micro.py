"""The paged decode attention of one step, with its KV cache in memory or in cache: ms per step and GB/s.

    python -m benchmarks.tools.decode_attention_micro [--batches 96x270,32x500,8x1000]

For each batch (sequences x context tokens, one query token each) at SmolLM2-135M's head shapes (9
query heads, 3 KV heads, head_dim 64, bf16, blocks of 16 in a shuffled order) the compiled kernel runs
over 30 layers, each with its own slice of a pool advised into huge pages as the engine's is
(`memory`: the K and V it reads come from DRAM), and over one layer's slice 30 times (`cached`: once
that slice fits in the last-level cache, the kernel's own compute and overheads). Bytes per second
count the K and V rows read. Beside them, a streaming read (a float32 sum over 512 MiB): what the
memory system gives a simple loop. Best of --repeats; `--threads 1`: what one core reaches.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from llmserve.benchmarks.latency import best_seconds, measure_read_bandwidth
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.worker.prefault import advise_huge_pages, populate

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def run(batches: Sequence[tuple[int, int]], layers: int = LAYERS, repeats: int = 5) -> list[dict]:
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the decode attention kernel needs the compiled CPU kernels")
    generator = torch.Generator().manual_seed(0)
    return [measure(ops, sequences, context, layers, repeats, generator) for sequences, context in batches]


def measure(ops, sequences: int, context: int, layers: int, repeats: int, generator: torch.Generator) -> dict:
    """One batch's row of `run`: `sequences` decodes over `context` tokens each."""
    blocks_per_sequence = -(-context // BLOCK)
    num_blocks = sequences * blocks_per_sequence
    pool = torch.empty(layers, 2, num_blocks * BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    advise_huge_pages(pool)
    populate(pool)
    pool.copy_(torch.randn(pool.shape, generator=generator))
    tables = torch.randperm(num_blocks, generator=generator).view(sequences, blocks_per_sequence)
    seq_lens = torch.full((sequences,), context, dtype=torch.int64)
    query_starts = torch.arange(sequences + 1, dtype=torch.int64)
    query = torch.randn(sequences, HEADS, HEAD_DIM, generator=generator).bfloat16()

    def step(distinct_layers: bool) -> None:
        for index in range(layers):
            layer = index if distinct_layers else 0
            ops.paged_attention(
                query, pool[layer, 0], pool[layer, 1], tables, seq_lens, query_starts,
                BLOCK, HEAD_DIM**-0.5, 0, 0, 0,
            )  # fmt: skip

    read = layers * 2 * sequences * context * KV_HEADS * HEAD_DIM * 2
    cpu = torch.device("cpu")
    memory = best_seconds(lambda: step(True), cpu, repeats)
    cached = best_seconds(lambda: step(False), cpu, repeats)
    return {
        "sequences": sequences,
        "context": context,
        "memory_ms": memory * 1e3,
        "memory_gbs": read / memory / 1e9,
        "cached_ms": cached * 1e3,
        "cached_gbs": read / cached / 1e9,
    }


def parse_batches(text: str) -> list[tuple[int, int]]:
    """`96x270,8x1000` -> [(96, 270), (8, 1000)]; argparse's type for --batches."""
    batches = []
    for item in text.split(","):
        sequences, _, context = item.partition("x")
        if not (sequences.isdigit() and context.isdigit() and int(sequences) > 0 and int(context) > 0):
            raise argparse.ArgumentTypeError(f"{item!r} is not SEQUENCESxCONTEXT (e.g. 96x270)")
        batches.append((int(sequences), int(context)))
    return batches


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batches",
        type=parse_batches,
        default="96x270,32x500,8x1000",
        help="SEQUENCESxCONTEXT, comma-separated",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    read_gbs = measure_read_bandwidth(torch.device("cpu")) / 1e9
    print(f"threads {torch.get_num_threads()}; streaming read {read_gbs:.1f} GB/s")
    print(f"one decode step's attention over {LAYERS} layers (9 query heads, 3 KV heads, head_dim 64, bf16)")
    for row in run(args.batches, repeats=args.repeats):
        print(
            f"{row['sequences']} x {row['context']}: from memory {row['memory_ms']:.2f} ms "
            f"({row['memory_gbs']:.1f} GB/s), one layer's cache {row['cached_ms']:.2f} ms "
            f"({row['cached_gbs']:.1f} GB/s)"
        )


if __name__ == "__main__":
    main()
