"""The output projection: float32 logits whatever dtype the model runs in.

A bf16 output would round each logit to 8 bits of mantissa, enough to turn two near-tied tokens
into an exact tie (SmolLM2's first answer token to "What is the capital of France?": -1.883 and
-1.965 in float32, both -1.886 in bf16), so the head keeps its float32 sums. On a CPU with the
compiled kernels the loaded model's head becomes a `LogitsLinear` (kernels/small_batch_linear.py),
which writes those sums directly; this module's forward is the path everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LMHead(nn.Linear):
    float_logits = True  # kernels/small_batch_linear.py swaps it for a kernel that keeps this
    # False once torch.mm(out_dtype=float32) has been refused on this device (an older CUDA build)
    _mm_out_dtype = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype == torch.float32:
            return F.linear(hidden, self.weight, self.bias)
        if hidden.device.type == "cuda" and LMHead._mm_out_dtype:
            try:  # the GEMM's float32 accumulators, written unrounded
                logits = torch.mm(
                    hidden.reshape(-1, self.in_features), self.weight.t(), out_dtype=torch.float32
                )
                logits = logits.view(*hidden.shape[:-1], self.out_features)
                return logits if self.bias is None else logits + self.bias.float()
            except (RuntimeError, TypeError):
                LMHead._mm_out_dtype = False
        # no float32-output GEMM for this dtype and device: multiply in float32
        bias = None if self.bias is None else self.bias.float()
        return F.linear(hidden.float(), self.weight.float(), bias)
