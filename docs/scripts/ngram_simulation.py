"""What n-gram prompt lookup could reach, without timing anything: greedy outputs of the grounded and
chat prompts of `bench spec-decode` (16 and 8 prompts, 128 tokens), then each proposer setting replayed
over them offline: tokens gained per verify step (accepted drafts + 1), rows per step (drafts + 1) and
the share of steps that draft at all. Tokens per step bounds the speedup a setting can give.

Usage: python docs/scripts/ngram_simulation.py
"""

import numpy as np

import llmserve.spec_decode.proposers.ngram as ngram
from llmserve import LLM, SamplingParams
from llmserve.benchmarks.spec_decode import chat_prompts, grounded_prompts
from llmserve.benchmarks.workload import TokenCorpus

# (prompt_lookup_min, prompt_lookup_max, drafts per match base: 2 ** n after an n-token match)
SETTINGS = [(2, 4, 2), (1, 4, 2), (1, 4, 3), (2, 8, 100), (1, 8, 100), (3, 8, 100)]
K = 7


def replay(proposer, pairs) -> tuple[float, float, float]:
    steps = tokens = rows = drafted = 0
    for prompt, output in pairs:
        done = 0
        while done < len(output):
            drafts = proposer.propose(np.asarray(prompt + output[:done], dtype=np.int64), K).tolist()
            accepted = 0
            while accepted < len(drafts) and done + accepted < len(output):
                if drafts[accepted] != output[done + accepted]:
                    break
                accepted += 1
            gained = min(accepted + 1, len(output) - done)
            done += gained
            steps, tokens, rows, drafted = (
                steps + 1,
                tokens + gained,
                rows + len(drafts) + 1,
                drafted + bool(drafts),
            )
    return tokens / steps, rows / steps, drafted / steps


def main() -> None:
    llm = LLM(prefix_caching=False)
    tokenizer = llm.tokenizer
    workloads = {
        "grounded": grounded_prompts(tokenizer, TokenCorpus(tokenizer), 16, 400, 0),
        "chat": chat_prompts(tokenizer, 8),
    }
    params = SamplingParams(temperature=0.0, max_tokens=128)
    outputs = {}
    for name, prompts in workloads.items():
        generated = llm.generate(prompts, params, use_tqdm=False)
        outputs[name] = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, generated, strict=True)]
    for lookup_min, lookup_max, base in SETTINGS:
        ngram._DRAFTS_PER_MATCH_BASE = base
        proposer = ngram.NgramProposer(lookup_min, lookup_max)
        cells = []
        for name, pairs in outputs.items():
            per_step, rows, drafted = replay(proposer, pairs)
            cells.append(f"{name}: {per_step:.2f} tokens/step, {rows:.2f} rows/step, drafts on {drafted:.0%}")
        print(f"min {lookup_min} max {lookup_max} base {base}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
