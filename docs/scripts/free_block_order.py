"""Offline mixed-100 passes on one engine, the KV free queue put in a given order before each pass.

  BS=16 python docs/scripts/free_block_order.py sorted,shuffled,left,left+

sorted: as a fresh pool (each prompt's blocks one run of memory); shuffled: random; left: as the
previous pass left it (blocks in the order requests finished); a trailing + sorts each allocation's
blocks. BS sets the block size (default 16). Prefix caching off. Prints total tok/s and the seconds
spent in steps with prompt tokens and in decode-only steps by batch size. Needs
bench_results/mixed-100.jsonl.
"""

import collections
import json
import os
import random
import sys
import time
from collections import OrderedDict

from llmserve import LLM, SamplingParams


def main() -> None:
    with open("bench_results/mixed-100.jsonl") as file:
        requests = [json.loads(line) for line in file]
    llm = LLM(prefix_caching=False, block_size=int(os.environ.get("BS", "16")))
    engine = llm.engine
    engine.model_runner.wait_for_kv_prefault()
    pool = engine.kv_cache_manager.pool
    prompts = [r["prompt_token_ids"] for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0) for r in requests]
    tokens = sum(map(len, prompts)) + sum(r["max_tokens"] for r in requests)

    spent: collections.Counter = collections.Counter()
    plain_step = engine.step

    def timed_step():
        outputs = plain_step()
        stats = engine.last_step
        if stats is not None:
            batch = stats.num_batched_seqs
            if stats.num_prompt_tokens:
                kind = "prefill"
            else:
                kind = "dec<16" if batch < 16 else "dec16-79" if batch < 80 else "dec80+"
            spent[kind] += stats.step_seconds
        return outputs

    engine.step = timed_step
    plain_allocate = pool.allocate
    rng = random.Random(0)
    for mode in sys.argv[1].split(","):
        sort_each = mode.endswith("+")
        pool.allocate = (lambda count: sorted(plain_allocate(count))) if sort_each else plain_allocate
        blocks = list(pool._free)
        if mode.startswith("sorted"):
            blocks.sort()
        elif mode.startswith("shuffled"):
            rng.shuffle(blocks)
        pool._free = OrderedDict.fromkeys(blocks)
        spent.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        parts = "  ".join(f"{kind} {seconds:.2f}" for kind, seconds in sorted(spent.items()))
        print(f"{mode:9s} {wall:.2f} s {tokens / wall:8.1f} tok/s  {parts}", flush=True)


if __name__ == "__main__":
    main()
