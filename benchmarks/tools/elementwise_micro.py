"""The decoder layer's elementwise kernels at prefill and decode row counts: SwiGLU and RMSNorm.

    python -m benchmarks.tools.elementwise_micro [--rows 96,256,2048] [--repeats 50]

SwiGLU (`silu_and_mul`) over rows of SmolLM2-135M's gate_up output (2 x 1,536 bf16) and RMSNorm
(`rms_norm`) over rows of its hidden size (576 bf16), median microseconds of --repeats calls each.
Run it in alternated processes against another build to compare (the VM's speed swings between runs).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from benchmarks.tools.timing import median_seconds
from llmserve.kernels.cpu_ops import load_cpu_ops

INTERMEDIATE = 1536
HIDDEN = 576


def run(rows: Sequence[int], repeats: int) -> list[dict]:
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the compiled CPU kernels did not build here")
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN).bfloat16()
    results = []
    for count in rows:
        gate_up = torch.randn(count, 2 * INTERMEDIATE).bfloat16()
        hidden = torch.randn(count, HIDDEN).bfloat16()
        swiglu = 1e6 * median_seconds(lambda gate_up=gate_up: ops.silu_and_mul(gate_up), repeats)
        norm = 1e6 * median_seconds(lambda hidden=hidden: ops.rms_norm(hidden, weight, 1e-5), repeats)
        results.append({"rows": count, "swiglu_us": swiglu, "rms_norm_us": norm})
        print(f"{count:5d} rows: SwiGLU {swiglu:7.1f} us, RMSNorm {norm:7.1f} us", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="96,256,2048", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    run([int(item) for item in args.rows.split(",") if item], args.repeats)


if __name__ == "__main__":
    main()
