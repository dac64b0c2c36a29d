"""Replay greedy decoding with the draft head (and prompt lookup) on held-out training answers: tokens
per verify step and a modelled batch-1 speedup for each confidence threshold and head depth.

    python docs/scripts/draft_head_simulation.py TEXT_CACHE HEAD [--base-ms 7 --row-ms 0.3 --head-ms 0.35]

TEXT_CACHE is `llmserve train-draft-head --text-cache`'s file, HEAD the trained head. The held-out
answers are the training run's (same seed, same split). The head runs on the target's prefill
hidden states; a step costs base + row x drafts + head x head steps computed (measure the three with
`spec_step_costs.py` and the head microbenchmark; defaults are this machine's fast-phase figures).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from llmserve import LLM
from llmserve.spec_decode.head_training import HeadTrainingConfig, TrainingText
from llmserve.spec_decode.proposers.draft_head import load_draft_head
from llmserve.spec_decode.proposers.ngram import NgramProposer


def held_out(text: TrainingText, config: HeadTrainingConfig) -> list[int]:
    order = torch.randperm(len(text.sequences), generator=torch.Generator().manual_seed(config.seed)).tolist()
    greedy_order = [i for i in order if text.greedy[i]]
    return sorted(greedy_order[: max(1, int(len(greedy_order) * config.held_out))])


@torch.inference_mode()
def chains(head, target, feature, tokens, depth):
    """Greedy head drafts and chained confidences from each position: [N, depth] each."""
    embed = target.model.embed_tokens
    subset = target.lm_head.weight[head.vocab_ids]
    drafts, confidence = [], []
    chained = torch.ones(len(feature))
    for _ in range(depth):
        feature = head(feature, embed(tokens))
        probs = (feature @ subset.T).float().softmax(dim=-1)
        top, index = probs.max(dim=-1)
        chained = chained * top
        tokens = head.vocab_ids[index]
        drafts.append(tokens)
        confidence.append(chained)
    return torch.stack(drafts, 1).numpy(), torch.stack(confidence, 1).numpy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("text_cache")
    parser.add_argument("head")
    parser.add_argument("--base-ms", type=float, default=7.0)
    parser.add_argument("--row-ms", type=float, default=0.3)
    parser.add_argument("--head-ms", type=float, default=0.35)
    parser.add_argument("--max-sequences", type=int, default=150)
    args = parser.parse_args()

    cached = torch.load(args.text_cache)
    text, features = TrainingText(**cached["text"]), cached["features"]
    llm = LLM(dtype="bfloat16")
    target = llm.engine.model_runner.model
    head = load_draft_head(args.head, target, torch.bfloat16, torch.device("cpu"))
    depth = 6
    lookup = NgramProposer(2, 4)
    records = []  # per sequence: answer tokens, head drafts/confidence at each position, lookup drafts
    for i in held_out(text, HeadTrainingConfig())[: args.max_sequences]:
        sequence, start = np.asarray(text.sequences[i]), text.num_prompt_tokens[i]
        if len(sequence) - start < 8:
            continue
        # position p (a token index >= start): the head drafts the tokens after p from feature p - 1
        positions = np.arange(start, len(sequence))
        drafts, confidence = chains(
            head, target, features[i][positions - 1], torch.from_numpy(sequence[positions]), depth
        )
        records.append((sequence, start, drafts, confidence))
    print(f"{len(records)} held-out greedy answers, {sum(len(r[0]) - r[1] for r in records)} tokens")
    print("lookup  tau   depth  tokens/step  drafts/step  head steps/step  modelled speedup")
    for use_lookup in (True, False):
        for tau in (0.0, 0.02, 0.05, 0.1, 0.2, 0.3):
            for max_depth in (2, 3, 4, 6):
                steps = tokens = drafted = head_steps = 0
                for sequence, start, drafts, confidence in records:
                    p = start  # the last known token's index
                    while p < len(sequence) - 1:
                        proposal = lookup.propose(sequence[: p + 1], 7) if use_lookup else []
                        if len(proposal) == 0:
                            keep = confidence[p - start, :max_depth] >= tau
                            k = int(np.cumprod(keep).sum())
                            proposal = drafts[p - start, :k]
                            head_steps += min(k + 1, max_depth)
                        truth = sequence[p + 1 : p + 1 + len(proposal)]
                        accepted = int(np.cumprod(proposal[: len(truth)] == truth).sum())
                        step_tokens = min(accepted + 1, len(sequence) - 1 - p)
                        p += step_tokens
                        steps += 1
                        tokens += step_tokens
                        drafted += len(proposal)
                cost = steps * args.base_ms + drafted * args.row_ms + head_steps * args.head_ms
                speedup = tokens * args.base_ms / cost
                print(
                    f"{use_lookup!s:6}  {tau:4.2f}  {max_depth:5d}  {tokens / steps:11.2f}  "
                    f"{drafted / steps:11.2f}  {head_steps / steps:15.2f}  {speedup:16.2f}"
                )


if __name__ == "__main__":
    main()
