"""Decode step with the fused CPU ops vs the PyTorch formulations, alternating in one process.

Usage: python docs/scripts/ab_fused.py BATCH  (from the repository root; needs bench_results/mixed-100.jsonl)
"""

import json
import sys
import time

import llmserve.attention.kv_format as kv_format
import llmserve.models.layers.norm as norm
import llmserve.models.layers.rotary as rotary
import llmserve.models.llama as llama
from llmserve import LLM, SamplingParams

MODULES = (norm, rotary, llama, kv_format)


def median_step_ms(engine, steps: int = 20) -> float:
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    batch = int(sys.argv[1])
    with open("bench_results/mixed-100.jsonl") as file:
        requests = [json.loads(line) for line in file][:batch]
    engine = LLM().engine
    params = SamplingParams(max_tokens=2048, ignore_eos=True, temperature=0)
    for index, request in enumerate(requests):
        engine.add_request(f"r{index}", request["prompt_token_ids"][:256], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    fused = {module: module.cpu_ops_for for module in MODULES}
    results: dict[str, list[float]] = {"fused": [], "torch": []}
    for _ in range(3):
        for module in MODULES:
            module.cpu_ops_for = fused[module]
        results["fused"].append(median_step_ms(engine))
        for module in MODULES:
            module.cpu_ops_for = lambda *tensors: None
        results["torch"].append(median_step_ms(engine))
    fused_ms, torch_ms = sorted(results["fused"]), sorted(results["torch"])
    print(f"batch {batch}: median decode step ms, fused {fused_ms}, torch {torch_ms}")


if __name__ == "__main__":
    main()
