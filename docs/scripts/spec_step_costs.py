"""Engine step time by the number of drafts it verified (batch 1, n-gram speculation, grounded prompts):
what a draft row costs the verify pass. Medians per draft count.

Usage: python docs/scripts/spec_step_costs.py [prompt_lookup_min]
"""

import collections
import statistics
import sys
import time

from llmserve import LLM, SamplingParams
from llmserve.benchmarks.spec_decode import grounded_prompts
from llmserve.benchmarks.workload import TokenCorpus


def main() -> None:
    lookup_min = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    llm = LLM(
        prefix_caching=False, speculative_method="ngram", prompt_lookup_min=lookup_min, prompt_lookup_max=8
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=128)
    step_ms: dict[int, list[float]] = collections.defaultdict(list)
    for index, prompt in enumerate(grounded_prompts(llm.tokenizer, TokenCorpus(llm.tokenizer), 8, 400, 0)):
        engine.add_request(f"r{index}", prompt, params)
        engine.step()  # the prefill
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            step_ms[engine.last_step.num_draft_tokens].append(1e3 * (time.perf_counter() - start))
    for drafts in sorted(step_ms):
        values = step_ms[drafts]
        print(f"{drafts} drafts: {len(values):4d} steps, median {statistics.median(values):6.2f} ms")


if __name__ == "__main__":
    main()
