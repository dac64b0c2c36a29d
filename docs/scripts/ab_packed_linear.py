"""Linear layers above 8 rows: oneDNN GEMM on the packed weight copy vs F.linear, alternating in one process.

Measures the offline mixed-100 workload (prompts + outputs, ignore_eos) with the packed copies in
place and with them removed (SmallBatchLinear then calls F.linear), in rounds that alternate.

Usage: python docs/scripts/ab_packed_linear.py [ROUNDS]
(repository root; needs bench_results/mixed-100.jsonl)
"""

import json
import sys

from ab_prefill_attention import workload_tokens_per_s  # the same timed run of mixed-100 (this folder)

from llmserve import LLM, SamplingParams
from llmserve.kernels.small_batch_linear import SmallBatchLinear


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with open("bench_results/mixed-100.jsonl") as file:
        requests = [json.loads(line) for line in file]
    llm = LLM(prefix_caching=False)
    llm.engine.model_runner.model.model.decode_stack = None  # it holds the packed copies itself
    layers = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, SmallBatchLinear)]
    packed = {id(layer): layer.packed_weight for layer in layers}
    assert all(w is not None for w in packed.values()), "no packed weights in this build"
    results: dict[str, list[float]] = {"packed": [], "f_linear": []}
    llm.generate([requests[0]["prompt_token_ids"]], SamplingParams(max_tokens=8), use_tqdm=False)
    for round_index in range(rounds):
        order = ("packed", "f_linear") if round_index % 2 == 0 else ("f_linear", "packed")
        for name in order:
            for layer in layers:
                layer.packed_weight = packed[id(layer)] if name == "packed" else None
            results[name].append(round(workload_tokens_per_s(llm, requests), 1))
            print(name, results[name], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
