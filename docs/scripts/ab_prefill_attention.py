"""Prefill attention: the blocked bf16 kernel vs PyTorch's SDPA, alternating in one process.

Measures (1) one 512-token prompt's prefill (median of 5) and (2) the whole offline mixed-100
workload (prompts + outputs, ignore_eos), each with the kernel on and off, in rounds that alternate
so machine drift hits both alike.

Usage: python docs/scripts/ab_prefill_attention.py [ROUNDS]  (repository root; needs
bench_results/mixed-100.jsonl from `llmserve bench throughput`)
"""

import json
import sys
import time

import torch

from llmserve import LLM, SamplingParams


def set_fast_prefill(llm: LLM, on: bool) -> None:
    for module in llm.engine.model_runner.model.modules():
        backend = getattr(module, "backend", None)
        if backend is not None and hasattr(backend, "fast_prefill_dtypes"):
            backend.fast_prefill_dtypes = {torch.bfloat16} if on else set()


def prefill_ms(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[2]


def workload_tokens_per_s(llm: LLM, requests: list[dict]) -> float:
    prompts = [r["prompt_token_ids"] for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0) for r in requests]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    return tokens / elapsed


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with open("bench_results/mixed-100.jsonl") as file:
        requests = [json.loads(line) for line in file]
    llm = LLM(prefix_caching=False)
    prompt = [t for r in requests for t in r["prompt_token_ids"]][:512]
    results: dict[str, dict[str, list[float]]] = {
        "kernel": {"prefill_ms": [], "tok_s": []},
        "sdpa": {"prefill_ms": [], "tok_s": []},
    }
    for round_index in range(rounds):
        order = ("kernel", "sdpa") if round_index % 2 == 0 else ("sdpa", "kernel")
        for name in order:
            set_fast_prefill(llm, name == "kernel")
            results[name]["prefill_ms"].append(round(prefill_ms(llm, prompt), 1))
            results[name]["tok_s"].append(round(workload_tokens_per_s(llm, requests), 1))
            print(name, results[name], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
