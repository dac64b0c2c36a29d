"""Training Medusa heads (proposers/medusa.py) by self-distillation: `train-draft-head --medusa-heads K`.

The text and the features are the draft head's (head_training.py, steps 1 and 2: the target's own
answers and its final hidden state at every position); the labels are the target's greedy tokens.
Head k learns, from the feature f_t that predicts y_{t+1}, the greedy token y_{t+2+k}: cross-entropy
weighted 0.8^k (Medusa-1's decay: later heads are right less often and matter less), the target
frozen. Each head starts as the identity block (zero weights) under a copy of the target's lm_head,
so it starts by predicting y_{t+1}, and learns the shift from there.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmserve.spec_decode.head_training import HeadTrainingConfig, TrainingText, _answer_arrays
from llmserve.spec_decode.proposers.draft_head import subset_lm_head_weight
from llmserve.spec_decode.proposers.medusa import MedusaHeads

HEAD_LOSS_DECAY = 0.8


def _examples(arrays, indices, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, H], labels [N, K]): every answer position with all K heads' labels inside the answer."""
    features, labels = [], []
    for i in indices:
        _, before, greedy = arrays[i]
        anchors = len(greedy) - num_heads - 1
        if anchors <= 0:
            continue
        features.append(before[:anchors])
        labels.append(torch.stack([greedy[1 + k : 1 + k + anchors] for k in range(num_heads)], dim=1))
    if not features:
        raise ValueError(f"too little training text: no answer of at least {num_heads + 2} tokens")
    return torch.cat(features).float(), torch.cat(labels)


def train_medusa_heads(
    target,
    text: TrainingText,
    features: list[torch.Tensor],
    config: HeadTrainingConfig,
    progress: Callable[[str], None] = print,
) -> tuple[MedusaHeads, dict]:
    """(heads in float32, report with the held-out acceptance of each head's top-1, chained)."""
    torch.manual_seed(config.seed)
    num_heads = config.medusa_heads
    arrays = _answer_arrays(target, text, features)
    order = torch.randperm(len(arrays), generator=torch.Generator().manual_seed(config.seed)).tolist()
    greedy_order = [i for i in order if text.greedy[i]]
    held = set(greedy_order[: max(1, int(len(greedy_order) * config.held_out))])
    train_x, train_y = _examples(arrays, [i for i in range(len(arrays)) if i not in held], num_heads)
    test_x, test_y = _examples(arrays, sorted(held), num_heads)
    arch = target.arch
    heads = MedusaHeads(arch.hidden_size, arch.vocab_size, num_heads)
    lm_head = subset_lm_head_weight(target, torch.arange(arch.vocab_size)).float().cpu()
    with torch.no_grad():
        for head in heads.medusa_head:
            head[0].linear.weight.zero_()
            head[0].linear.bias.zero_()
            head[1].weight.copy_(lm_head)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.learning_rate, weight_decay=0.0)
    weights = [HEAD_LOSS_DECAY**k for k in range(num_heads)]
    start, acceptance = time.monotonic(), []
    steps = max(1, len(train_x) // config.batch_size)
    for epoch in range(config.epochs):
        heads.train()
        permutation = torch.randperm(len(train_x))
        total = 0.0
        for step in range(steps):
            index = permutation[step * config.batch_size : (step + 1) * config.batch_size]
            logits = heads(train_x[index])  # [K, B, V]
            loss = sum(w * F.cross_entropy(logits[k], train_y[index, k]) for k, w in enumerate(weights))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        heads.eval()
        with torch.no_grad():
            correct = (test_y == heads(test_x).argmax(dim=-1).T).cumprod(dim=1).float().mean(dim=0)
        acceptance = correct.tolist()
        progress(
            f"epoch {epoch + 1}/{config.epochs}: loss {total / steps:.3f}, held-out top-1 of heads "
            f"1..{num_heads} all right: {', '.join(f'{a:.3f}' for a in acceptance)}"
        )
    report = {
        "medusa_heads": num_heads,
        "held_out_acceptance": [round(a, 4) for a in acceptance],
        "train_seconds": round(time.monotonic() - start, 1),
    }
    return heads, report
