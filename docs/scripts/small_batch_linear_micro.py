"""The small-batch linear kernels over one SmolLM2 decode step's shapes (30 layers + lm_head, each
layer's weights distinct, so they stream from memory), at 1, 4 and 8 rows: ms per step and GB/s,
with the machine's streaming read and copy bandwidth measured alongside. bf16, int8 and int4 (g64).

Usage: python docs/scripts/small_batch_linear_micro.py
"""

import statistics
import time

import torch

from llmserve.kernels.cpu_ops import load_cpu_ops

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LAYERS = 30


def main() -> None:
    ops = load_cpu_ops()
    torch.manual_seed(0)
    big = torch.ones(512 * 2**20, dtype=torch.uint8)
    copy = torch.empty_like(big)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        copy.copy_(big)
        rates.append(2 * big.numel() / (time.perf_counter() - start) / 1e9)
    print(f"copy bandwidth (read + write) {max(rates):.1f} GB/s")
    weights = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    weights.append([torch.randn(49152, 576).bfloat16()])
    formats = {"bf16": [], "int8": [], "int4": []}
    for layer in weights:
        for w in layer:
            n = w.shape[0]
            formats["bf16"].append((n, w.numel() * 2, ops.small_batch_pack(w)))
            codes = torch.randint(-127, 128, w.shape, dtype=torch.int8)
            formats["int8"].append((n, w.numel(), (ops.small_batch_pack_int8(codes), torch.rand(n))))
            nibbles = torch.randint(0, 16, w.shape, dtype=torch.uint8)
            groups = w.shape[1] // 64
            packed = ops.small_batch_pack_int4(nibbles, torch.rand(n, groups), torch.rand(n, groups))
            formats["int4"].append((n, w.numel() // 2, packed))
    calls = {
        "bf16": lambda x, n, p: ops.small_batch_linear(x, p, n),
        "int8": lambda x, n, p: ops.small_batch_linear_int8(x, *p),
        "int4": lambda x, n, p: ops.small_batch_linear_int4(x, *p, n),
    }
    inputs = {(m, k): torch.randn(m, k).bfloat16() for m in (1, 4, 8) for k in (576, 1536)}
    for m in (1, 4, 8):
        for name, layers in formats.items():
            total_bytes = sum(b for _, b, _ in layers)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for n, _, packed in layers:
                    width = (
                        packed.shape[1]
                        if name == "bf16"
                        else packed[0].shape[1] * (2 if name == "int4" else 1)
                    )
                    calls[name](inputs[m, width], n, packed)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            print(
                f"{m} rows {name}: {1e3 * seconds:6.2f} ms per step, {total_bytes / seconds / 1e9:5.1f} GB/s"
            )


if __name__ == "__main__":
    main()
