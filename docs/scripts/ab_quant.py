"""Batch-1 decode ms/token of several weight formats in one process, interleaved (median of rounds).

Usage: python docs/scripts/ab_quant.py none,int8,int4,gguf
"""

import statistics
import sys

from llmserve import LLM
from llmserve.evaluation.perplexity import decode_ms_per_token


def main() -> None:
    methods = sys.argv[1].split(",")
    engines = {
        m: LLM(quantization=None if m == "none" else m, kv_cache_memory="256MiB", prefix_caching=False).engine
        for m in methods
    }
    prompt = list(range(1000, 1016))
    times: dict[str, list[float]] = {m: [] for m in methods}
    for round_index in range(5):
        for m in methods if round_index % 2 == 0 else methods[::-1]:
            times[m].append(decode_ms_per_token(engines[m], prompt, 64))
    base = statistics.median(times[methods[0]])
    for m in methods:
        median = statistics.median(times[m])
        rounds = [round(t, 2) for t in times[m]]
        print(f"{m:6s} median {median:6.2f} ms/token, {base / median:4.2f}x the first; rounds {rounds}")


if __name__ == "__main__":
    main()
