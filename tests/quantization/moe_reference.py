"""The float oracle of a model with quantized experts: its dequantized weights, its layers' inputs
rounded where the quantized kernels round theirs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve import LLM, SamplingParams
from llmserve.quantization.embedding import lookup_blocks
from llmserve.quantization.kernels import QuantizedLinear, RoundedInputKernel
from llmserve.quantization.moe import QuantizedMoEExperts
from tests.helpers import round_inputs_as_the_small_batch_kernels, rounding_hook

# The log-probability gap at which the reference may pick the other token: float sums in another
# order; where the kernels round their inputs, also one input code that such a difference moved
# across a rounding boundary in a later layer (an exact oracle of that cascade cannot exist)
NEAR_TIE = 1e-4
NEAR_TIE_ROUNDED = 0.05


def _round_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the compiled kernels read it: 8 bits per 32 columns, a step of max|x| / 127 per block."""
    return rounding_hook()(None, (x,))


class RoundingExperts(torch.nn.Module):
    """The float oracle of experts whose kernels take float32 rows (the AVX2 level): each expert's
    rows have their inputs rounded as the kernel rounds them."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, hidden, weights, experts):
        out = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            token, slot = torch.nonzero(experts == expert, as_tuple=True)
            gate, up = (_round_rows(hidden[token]) @ self.gate_up[expert].T).chunk(2, dim=-1)
            y = _round_rows(F.silu(gate) * up) @ self.down[expert].T
            out.index_add_(0, token, y * weights[token, slot].unsqueeze(1))
        return out


def dequantized_reference(quantized: LLM, reference: LLM) -> bool:
    """Give the float engine's model the weights the quantized engine's kernels multiply by, and
    round its layers' inputs where the quantized kernels round theirs (float32 at the AVX2 level);
    returns whether any layer rounds."""
    quantized_model, float_model = quantized.engine.model_runner.model, reference.engine.model_runner.model
    float_modules = dict(float_model.named_modules())
    lookups = lookup_blocks(quantized_model)  # an untied embedding's blocks: its rows are the float table's
    rounding = 0
    with torch.no_grad():
        for name, module in quantized_model.named_modules():
            if isinstance(module, QuantizedLinear) and id(module) not in lookups:
                float_modules[name].weight.copy_(module.kernel.dequantize(torch.float32))
            elif isinstance(module, QuantizedMoEExperts):
                gate_up, down = module.dequantize(torch.float32)
                float_modules[name].gate_up_proj.copy_(gate_up)
                float_modules[name].down_proj.copy_(down)
                kernel = module.gate_up[0]
                if isinstance(kernel, RoundedInputKernel) and kernel.takes(torch.float32):
                    parent, _, child = name.rpartition(".")
                    setattr(float_model.get_submodule(parent), child, RoundingExperts(gate_up, down))
                    rounding += 1
    return rounding + round_inputs_as_the_small_batch_kernels(float_model, quantized_model) > 0


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 12, logprobs: int | None = None):
    """Each prompt's greedy tokens (with `logprobs`: (tokens, per-token top logprobs) pairs)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outputs = [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=False)]
    return [o.token_ids if logprobs is None else (o.token_ids, o.logprobs) for o in outputs]


def assert_greedy_equal_but_at_near_ties(
    quantized: LLM, reference: LLM, prompts: list[list[int]], rounded: bool
) -> None:
    """The quantized engine's greedy tokens equal the reference's, except that a sequence may part
    from it where the reference's own step scored the two tokens nearly alike (NEAR_TIE; `rounded`:
    the kernels round their inputs, NEAR_TIE_ROUNDED)."""
    tie = NEAR_TIE_ROUNDED if rounded else NEAR_TIE
    ours = greedy(quantized, prompts)
    for tokens, (theirs, logprobs) in zip(ours, greedy(reference, prompts, logprobs=5), strict=True):
        split = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)) if a != b), None)
        if split is not None:
            scores = logprobs[split]
            assert tokens[split] in scores, (split, tokens, theirs)
            assert scores[theirs[split]] - scores[tokens[split]] <= tie, (split, tokens, theirs, scores)
