"""The output projection: float32 logits whatever dtype the model runs in.

A bf16 output would round each logit to 8 bits of mantissa, enough to turn two near-tied tokens
into an exact tie (SmolLM2's first answer token to "What is the capital of France?": -1.883 and
-1.965 in float32, both -1.886 in bf16), so the head keeps its float32 sums. On a CPU with the
compiled kernels the loaded model's head becomes a `LogitsLinear` (kernels/small_batch_linear.py),
which writes those sums directly; this module's forward is the path everywhere else.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.kernels.logits import float32_logits


class LMHead(nn.Linear):
    float_logits = True  # kernels/small_batch_linear.py swaps it for a kernel that keeps this

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return float32_logits(hidden, self.weight, self.bias)
