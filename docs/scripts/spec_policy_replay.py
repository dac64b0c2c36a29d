"""Replay batch-1 greedy speculation (prompt lookup, else the draft head) on the spec-decode bench's
prompts under a step-cost model, to compare drafting policies without timing each one.

    python docs/scripts/spec_policy_replay.py [--seed 0] [--num-prompts 32] [--row-cost 0.06,0.08,0.10]

The target answers each grounded prompt greedily (as `llmserve bench spec-decode` does), one prefill
over prompt + answer gives the final hidden state at every position, and from each position the
draft head's greedy chain (with its chained confidence) and prompt lookup's proposal are scored
against the real continuation. A policy is then walked over every answer: a step verifying d drafts
costs 1 + row_cost x d plain steps, a head chain 0.022 + 0.019 per head step computed (session 14's
profile: a 4-row step 30.6 ms against 22.9 plain, the compiled chain 1.8 ms for three drafts). The
modelled speedup is tokens x plain step / total cost. Per-prompt speedups spread from below 1x (short
answers) to over 3.5x, which is why the bench's default is 32 prompts rather than 8.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from draft_head_simulation import chains  # this folder's script (the head's greedy chain)

from llmserve import LLM, SamplingParams
from llmserve.benchmarks.spec_decode import grounded_prompts
from llmserve.benchmarks.workload import TokenCorpus
from llmserve.spec_decode.head_training import TrainingText, collect_features
from llmserve.spec_decode.proposers.draft_head import load_draft_head, packaged_draft_head
from llmserve.spec_decode.proposers.ngram import NgramProposer

HEAD_DEPTH, HEAD_TAU = 3, 0.2
HEAD_FIXED, HEAD_PER_STEP = 0.022, 0.019  # a head chain's cost in plain steps


@torch.inference_mode()
def collect(llm: LLM, seed: int, count: int) -> list[dict]:
    """Per answer: its tokens, where it starts, and the head's greedy chain from each position."""
    prompts = grounded_prompts(llm.tokenizer, TokenCorpus(llm.tokenizer), count, 400, seed)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=128))
    sequences = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    text = TrainingText(sequences, [len(p) for p in prompts], [True] * len(prompts))
    features = collect_features(llm, text)
    target = llm.engine.model_runner.model
    head = load_draft_head(packaged_draft_head(), target, torch.float32, torch.device("cpu"))
    records = []
    for sequence, start, feature in zip(sequences, text.num_prompt_tokens, features, strict=True):
        sequence = np.asarray(sequence)
        known = np.arange(start, len(sequence))  # the last known token's index at each decode step
        drafts, confidence = chains(
            head, target, feature[known - 1].float(), torch.from_numpy(sequence[known]), HEAD_DEPTH
        )
        records.append({"sequence": sequence, "start": start, "drafts": drafts, "confidence": confidence})
    return records


def positions(record: dict, max_n: int, horizon: int = 7) -> list[tuple]:
    """From each position: lookup's match length and how many of its drafts are right, the head's
    confidences and how many of its drafts are right, and the tokens left in the answer."""
    sequence, start = record["sequence"], record["start"]
    lookup = NgramProposer(1, max_n)
    result = []
    for p in range(start, len(sequence)):
        truth = sequence[p + 1 : p + 1 + horizon]
        length, end = lookup._longest_match(sequence[: p + 1])
        right = 0
        if length:
            continuation = sequence[end + 1 + np.arange(horizon) % (p - end)]
            right = int(np.cumprod(continuation[: len(truth)] == truth).sum())
        head = record["drafts"][p - start]
        head_right = int(np.cumprod(head[: len(truth)] == truth[:HEAD_DEPTH]).sum())
        result.append((length, right, record["confidence"][p - start], head_right, len(sequence) - 1 - p))
    return result


def modelled_speedup(
    answers: list[list[tuple]], row_cost: float, min_n: int = 2, use_head: bool = True
) -> float:
    """Tokens per plain-step cost, walking each answer with lookup (2 ** n drafts after an n-token
    match, at most 7) where it matches and the head elsewhere."""
    tokens = cost = 0.0
    for answer in answers:
        p = 0
        while p < len(answer):
            length, right, confidence, head_right, remaining = answer[p]
            if length >= min_n:
                drafts = min(2**length, 7)  # NgramProposer's rule, written out here to be varied
                accepted = min(right, drafts)
            elif use_head:
                drafts = int(np.cumprod(confidence >= HEAD_TAU).sum())
                accepted = min(head_right, drafts)
                cost += HEAD_FIXED + HEAD_PER_STEP * min(drafts + 1, HEAD_DEPTH)
            else:
                drafts = accepted = 0
            cost += 1 + row_cost * drafts
            step = max(1, min(accepted + 1, remaining))
            tokens += step
            p += step
    return tokens / cost


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--row-cost", default="0.06,0.08,0.10", help="a verify row's cost in plain steps")
    args = parser.parse_args()
    records = collect(LLM(prefix_caching=False), args.seed, args.num_prompts)
    row_costs = [float(x) for x in args.row_cost.split(",")]
    print("prompt lookup max n, then per row cost: draft_head (lookup, else head) and ngram alone")
    for max_n in (4, 5, 6, 8, 12):
        answers = [positions(record, max_n) for record in records]
        cells = [
            f"row {row}: {modelled_speedup(answers, row):.3f} / "
            f"{modelled_speedup(answers, row, use_head=False):.3f}"
            for row in row_costs
        ]
        print(f"max n {max_n:2d}  " + "  ".join(cells))
    answers = [positions(record, 6) for record in records]
    per_prompt = [modelled_speedup([answer], row_costs[len(row_costs) // 2]) for answer in answers]
    print("per prompt (max n 6):", " ".join(f"{s:.2f}" for s in per_prompt))
    for size in (8, 16):
        blocks = [answers[i : i + size] for i in range(0, len(answers) - size + 1, size)]
        pooled = [modelled_speedup(block, row_costs[len(row_costs) // 2]) for block in blocks]
        if pooled:
            print(f"blocks of {size} prompts:", " ".join(f"{s:.3f}" for s in pooled))


if __name__ == "__main__":
    main()
