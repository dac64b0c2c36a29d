"""Batch-1 decode ms/token with the fused decode stack and without it (the module path), one engine,
interleaved rounds (medians): grounded prompts of ~450 tokens, 96 greedy tokens each.

Usage: python docs/scripts/ab_decode_stack.py [none|ngram]
"""

import statistics
import sys

from llmserve import LLM, SamplingParams
from llmserve.benchmarks.spec_decode import grounded_prompts
from llmserve.benchmarks.workload import TokenCorpus


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "none"
    llm = LLM(prefix_caching=False, speculative_method=None if method == "none" else method)
    inner = llm.engine.model_runner.model.model
    stack = inner.decode_stack
    prompts = grounded_prompts(llm.tokenizer, TokenCorpus(llm.tokenizer), 4, 400, 0)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    llm.generate([prompts[0][:32]], params, use_tqdm=False)  # warm-up
    times: dict[str, list[float]] = {"stack": [], "modules": []}
    for round_index in range(4):
        for name in ("stack", "modules") if round_index % 2 == 0 else ("modules", "stack"):
            inner.decode_stack = stack if name == "stack" else None
            seconds = tokens = 0
            for prompt in prompts:
                (output,) = llm.generate([prompt], params, use_tqdm=False)
                seconds += output.metrics.finished_time - output.metrics.first_token_time
                tokens += len(output.outputs[0].token_ids) - 1
            times[name].append(round(1e3 * seconds / tokens, 2))
    for name, values in times.items():
        print(f"{name:8s} median {statistics.median(values):6.2f} ms/token; rounds {values}")
    print(f"modules / stack: {statistics.median(times['modules']) / statistics.median(times['stack']):.3f}")


if __name__ == "__main__":
    main()
