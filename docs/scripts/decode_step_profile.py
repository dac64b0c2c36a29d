"""Decode step time with 64 requests of mixed-100 running (bf16 defaults), and the attention kernel's share.

Usage: python docs/scripts/decode_step_profile.py  (from the repository root)
"""

import json
import time

from llmserve import LLM, SamplingParams
from llmserve.attention.backends.cpu_paged import CPUPagedBackend


def main() -> None:
    with open("bench_results/mixed-100.jsonl") as file:
        requests = [json.loads(line) for line in file][:64]
    engine = LLM().engine
    spent = [0.0]
    decode = CPUPagedBackend._decode

    def timed_decode(self, *args, **kwargs):
        start = time.perf_counter()
        out = decode(self, *args, **kwargs)
        spent[0] += time.perf_counter() - start
        return out

    CPUPagedBackend._decode = timed_decode
    params = SamplingParams(max_tokens=512, ignore_eos=True, temperature=0)
    for index, request in enumerate(requests):
        engine.add_request(f"r{index}", request["prompt_token_ids"], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    spent[0] = 0.0
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    step_ms = (time.perf_counter() - start) / 10 * 1e3
    running = engine.scheduler.running
    context = sum(r.num_tokens for r in running) / len(running)
    print(
        f"step {step_ms:.1f} ms, decode attention {spent[0] * 1e3 / 10:.1f} ms/step (30 layers), "
        f"batch {len(running)}, mean context {context:.0f}"
    )


if __name__ == "__main__":
    main()
