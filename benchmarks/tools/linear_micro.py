"""The small-batch linear kernels over one decode step's shapes: ms per step and the GB/s they stream.

    python -m benchmarks.tools.linear_micro [--rows 1,4,8] [--layers 30] [--repeats 5]
    python -m benchmarks.tools.linear_micro --amx [--rows 16,64,128,256,650,1024,2048]
    python -m benchmarks.tools.linear_micro --tiled [--rows 16,48,96,128,256,512]
    python -m benchmarks.tools.linear_micro --logits [--rows 8,32,96]
    python -m benchmarks.tools.linear_micro --streamed [--rows 32,96] [--layers 30]

Every layer gets its own weights (qkv, o, gate_up, down of SmolLM2-135M, then the lm_head), so they
come from memory as in a real step, for each format this build has (bf16; int8 per channel and int4
in groups of 64: AVX-512 VNNI or AVX2). Next to it, the machine's copy bandwidth (read + write of 512
MiB): a kernel near that rate is bound by memory, not by its arithmetic. Median of --repeats.

`--amx` compares the kernels for rows above 8 instead, one layer shape at a time (microseconds and
GFLOP/s): oneDNN's GEMM on its blocked copy against the AMX kernel on the small-batch copy, and for the
lm_head (float32 out) the small-batch kernel against the AMX kernel. `--tiled` compares, without AMX,
oneDNN's GEMM on its blocked copy against the small-batch kernel in tiles of 8 rows (bf16 out), per
layer shape and over one decoder layer's four (kernels/small_batch_linear.py: KERNEL_MAX_ROWS).
`--logits` times the output projection on the small-batch kernel with its float32 output (as the
engine runs it) and with bf16 output, beside gate_up's shape, whose output stays in cache (TFLOP/s).
`--streamed` times one decoder layer's four projections with one layer's weights reused (in cache)
and with `--layers` layers' weights in turn (from memory, as in a model's step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from benchmarks.tools.timing import median_seconds
from llmserve.kernels.cpu_ops import load_cpu_ops

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
VOCAB = 49152
INT4_GROUP = 64


def copy_bandwidth(mebibytes: int = 512, repeats: int = 3) -> float:
    """GB/s of a large tensor copy, read and write counted, best of `repeats`."""
    source = torch.ones(mebibytes * 2**20, dtype=torch.uint8)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best / 1e9


def packed_layers(ops, shapes: Sequence[tuple[int, int]], fmt: str) -> list[tuple[Callable, int]]:
    """Per weight: a call taking the input, and the bytes of weight it reads."""
    layers = []
    for out_features, in_features in shapes:
        if fmt == "bf16":
            packed = ops.small_batch_pack(torch.randn(out_features, in_features).bfloat16())
            call = _bind(ops.small_batch_linear, packed, out_features)
            layers.append((call, out_features * in_features * 2))
        elif fmt == "int8":
            codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
            packed, scales = ops.small_batch_pack_int8(codes), torch.rand(out_features)
            layers.append((_bind(ops.small_batch_linear_int8, packed, scales, out_features), codes.numel()))
        else:
            nibbles = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
            groups = in_features // INT4_GROUP
            scales, offsets = torch.rand(out_features, groups), torch.rand(out_features, groups)
            packed, params = ops.small_batch_pack_int4(nibbles, scales, offsets)
            call = _bind(ops.small_batch_linear_int4, packed, params, out_features)
            layers.append((call, nibbles.numel() // 2))
    return layers


def _bind(kernel: Callable, *weights) -> Callable:
    return lambda x: kernel(x, *weights)


def formats(ops) -> list[str]:
    """The formats whose kernels this build has on this CPU."""
    available = ["bf16"] if ops.small_batch_linear_supported() else []
    return available + (["int8", "int4"] if ops.small_batch_linear_int8_supported() else [])


def time_step(layers: Sequence[tuple[Callable, int]], shapes, rows: int, repeats: int) -> tuple[float, float]:
    """Median seconds for one pass over every layer at `rows` rows, and the GB/s of weight read."""
    inputs = {width: torch.randn(rows, width).bfloat16() for _, width in shapes}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for (call, _), (_, width) in zip(layers, shapes, strict=True):
            call(inputs[width])
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return seconds, sum(size for _, size in layers) / seconds / 1e9


def run(rows: Sequence[int], num_layers: int, vocab: int, repeats: int, copy_mib: int) -> list[dict]:
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the compiled CPU kernels did not build here")
    torch.manual_seed(0)
    print(f"copy bandwidth (read + write) {copy_bandwidth(copy_mib):.1f} GB/s")
    shapes = LAYER_SHAPES * num_layers + [(vocab, LAYER_SHAPES[0][1])]
    results = []
    for fmt in formats(ops):
        layers = packed_layers(ops, shapes, fmt)
        for count in rows:
            seconds, rate = time_step(layers, shapes, count, repeats)
            results.append({"format": fmt, "rows": count, "ms": 1e3 * seconds, "GB/s": rate})
            print(f"{fmt:5s} {count} rows: {1e3 * seconds:7.2f} ms per step, {rate:5.1f} GB/s", flush=True)
    return results


def _bf16_kernel_ops():
    """The compiled kernels, or exit where this CPU (or build) has no bf16 small-batch kernel."""
    ops = load_cpu_ops()
    if ops is None or not ops.small_batch_linear_supported():
        raise SystemExit("this CPU (or build) has no bf16 small-batch kernel")
    return ops


def compare_amx(rows: Sequence[int], vocab: int, repeats: int) -> list[dict]:
    """Per layer shape and row count: the kernel rows above 8 took before AMX, and AMX's."""
    from llmserve.kernels.small_batch_linear import onednn_linear, pack_for_onednn

    ops = load_cpu_ops()
    if ops is None or not ops.amx_linear_supported():
        raise SystemExit("this CPU (or build) has no AMX kernel")
    torch.manual_seed(0)
    names = ["qkv", "o", "gate_up", "down", "lm_head"]
    results = []
    for name, (out_features, in_features) in zip(names, [*LAYER_SHAPES, (vocab, 576)], strict=True):
        weight = torch.randn(out_features, in_features).bfloat16()
        packed = ops.small_batch_pack(weight)
        logits = name == "lm_head"
        onednn = None if logits else pack_for_onednn(weight)
        before_name = "small-batch" if logits else "oneDNN"
        for count in rows:
            x = torch.randn(count, in_features).bfloat16()
            if logits:
                old = median_seconds(
                    partial(ops.small_batch_linear_float_out, x, packed, out_features), repeats
                )
            else:
                old = median_seconds(partial(onednn_linear, x, onednn, None), repeats)
            new = median_seconds(partial(ops.amx_linear, x, packed, None, out_features, logits), repeats)
            flops = 2 * count * out_features * in_features
            row = {"layer": name, "rows": count, "before": before_name, "before_us": old * 1e6}
            row |= {"amx_us": new * 1e6, "before_GFLOPs": flops / old / 1e9, "amx_GFLOPs": flops / new / 1e9}
            results.append(row)
            print(
                f"{name:8s} {count:5d} rows: {before_name} {old * 1e6:9.1f} us "
                f"({row['before_GFLOPs']:5.0f} GFLOP/s), AMX {new * 1e6:9.1f} us "
                f"({row['amx_GFLOPs']:5.0f} GFLOP/s), x{old / new:.2f}",
                flush=True,
            )
    return results


def compare_tiled(rows: Sequence[int], repeats: int) -> list[dict]:
    """Per row count: each layer shape's microseconds on oneDNN and on the small-batch kernel, and
    their sums over one decoder layer."""
    from llmserve.kernels.small_batch_linear import onednn_linear, pack_for_onednn

    ops = _bf16_kernel_ops()
    torch.manual_seed(0)
    layers = []
    for out_features, in_features in LAYER_SHAPES:
        weight = torch.randn(out_features, in_features).bfloat16()
        layers.append((out_features, in_features, pack_for_onednn(weight), ops.small_batch_pack(weight)))
    results = []
    for count in rows:
        row = {"rows": count, "onednn_us": [], "kernel_us": []}
        for out_features, in_features, onednn, packed in layers:
            x = torch.randn(count, in_features).bfloat16()
            row["onednn_us"].append(1e6 * median_seconds(partial(onednn_linear, x, onednn, None), repeats))
            kernel = partial(ops.small_batch_linear, x, packed, out_features)
            row["kernel_us"].append(1e6 * median_seconds(kernel, repeats))
        old, new = sum(row["onednn_us"]), sum(row["kernel_us"])
        results.append(row)
        shapes = ", ".join(
            f"{a:.0f}/{b:.0f}" for a, b in zip(row["onednn_us"], row["kernel_us"], strict=True)
        )
        print(
            f"{count:5d} rows: one layer oneDNN {old:7.0f} us, small-batch {new:7.0f} us, x{old / new:.2f} "
            f"(qkv, o, gate_up, down: {shapes})",
            flush=True,
        )
    return results


def compare_logits(rows: Sequence[int], vocab: int, repeats: int) -> list[dict]:
    """Per row count: microseconds and TFLOP/s of the output projection (float32 out, then bf16 out)
    and of gate_up's shape."""
    ops = _bf16_kernel_ops()
    torch.manual_seed(0)
    hidden = LAYER_SHAPES[0][1]
    lm_head = ops.small_batch_pack((torch.randn(vocab, hidden) * 0.05).bfloat16())
    gate_up = ops.small_batch_pack((torch.randn(LAYER_SHAPES[2][0], hidden) * 0.05).bfloat16())
    cases = [
        ("lm_head float32", ops.small_batch_linear_float_out, lm_head, vocab),
        ("lm_head bf16", ops.small_batch_linear, lm_head, vocab),
        ("gate_up bf16", ops.small_batch_linear, gate_up, LAYER_SHAPES[2][0]),
    ]
    results = []
    for count in rows:
        x = torch.randn(count, hidden).bfloat16()
        parts = []
        for name, kernel, packed, out_features in cases:
            seconds = median_seconds(partial(kernel, x, packed, out_features), repeats)
            tflops = 2 * count * out_features * hidden / seconds / 1e12
            results.append({"case": name, "rows": count, "us": seconds * 1e6, "TFLOP/s": tflops})
            parts.append(f"{name} {seconds * 1e6:8.0f} us ({tflops:.2f} TFLOP/s)")
        print(f"{count:5d} rows: " + ", ".join(parts), flush=True)
    return results


def compare_streamed(rows: Sequence[int], num_layers: int, repeats: int) -> list[dict]:
    """Per row count: microseconds per decoder layer (its four projections) with one layer's weights
    reused and with `num_layers` layers' weights in turn."""
    ops = _bf16_kernel_ops()
    torch.manual_seed(0)
    stack = [
        [ops.small_batch_pack((torch.randn(n, k) * 0.05).bfloat16()) for n, k in LAYER_SHAPES]
        for _ in range(num_layers)
    ]
    results = []
    for count in rows:
        inputs = [torch.randn(count, k).bfloat16() for _, k in LAYER_SHAPES]

        def one_pass(layers: Sequence[Sequence[torch.Tensor]], inputs=inputs) -> None:
            for weights in layers:
                for (out_features, _), packed, x in zip(LAYER_SHAPES, weights, inputs, strict=True):
                    ops.small_batch_linear(x, packed, out_features)

        cached = median_seconds(partial(one_pass, stack[:1] * num_layers), repeats) / num_layers
        streamed = median_seconds(partial(one_pass, stack), repeats) / num_layers
        results.append({"rows": count, "cached_us": cached * 1e6, "streamed_us": streamed * 1e6})
        print(
            f"{count:5d} rows: a layer {cached * 1e6:6.0f} us with its weights in cache, "
            f"{streamed * 1e6:6.0f} us with {num_layers} layers' from memory ({streamed / cached - 1:+.0%})",
            flush=True,
        )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", help="comma-separated row counts (default 1,4,8; with --amx 16 to 2048)")
    parser.add_argument("--amx", action="store_true", help="rows above 8: oneDNN or small-batch against AMX")
    parser.add_argument(
        "--tiled", action="store_true", help="rows above 8: oneDNN against the small-batch kernel"
    )
    parser.add_argument(
        "--logits", action="store_true", help="the output projection's float32 and bf16 output, per row count"
    )
    parser.add_argument(
        "--streamed", action="store_true", help="a decoder layer with its weights in cache and from memory"
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=VOCAB, help="lm_head rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copy-mib", type=int, default=512)
    args = parser.parse_args(argv)
    if args.amx:
        default = "16,64,128,256,650,1024,2048"
    elif args.tiled:
        default = "16,48,96,128,256,512"
    elif args.logits:
        default = "8,32,96"
    elif args.streamed:
        default = "32,96"
    else:
        default = "1,4,8"
    rows = [int(item) for item in (args.rows or default).split(",") if item]
    if args.amx:
        compare_amx(rows, args.vocab, args.repeats)
    elif args.logits:
        compare_logits(rows, args.vocab, args.repeats)
    elif args.streamed:
        compare_streamed(rows, args.layers, args.repeats)
    elif args.tiled:
        compare_tiled(rows, args.repeats)
    else:
        run(rows, args.layers, args.vocab, args.repeats, args.copy_mib)


if __name__ == "__main__":
    main()
