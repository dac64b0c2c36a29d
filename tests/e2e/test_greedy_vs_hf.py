"""Greedy tokens equal HF transformers token for token, on the real default model."""

import pytest
import torch

from llmserve import LLM, SamplingParams

from .conftest import hf_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 32


def test_batch_of_mixed_length_prompts_matches_hf_float32(llm_fp32, hf_model_fp32, prompts_5_to_600):
    lengths = [len(p) for p in prompts_5_to_600]
    assert min(lengths) >= 5 and max(lengths) >= 590 and len(lengths) >= 8
    outputs = llm_fp32.generate(
        prompts_5_to_600, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False
    )
    for prompt, output in zip(prompts_5_to_600, outputs, strict=True):
        expected = hf_greedy(hf_model_fp32, prompt, MAX_NEW)
        assert output.outputs[0].token_ids == expected[: len(output.outputs[0].token_ids)]
        assert len(output.outputs[0].token_ids) == len(expected) or output.outputs[0].finish_reason == "stop"


def test_bfloat16_matches_hf_or_diverges_only_at_a_near_tie(hf_model_fp32, prompts_5_to_600):
    """As vLLM's check_logprobs_close: equal, or the first divergence is where HF's top two
    tokens are within 0.05 nats of each other."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="256MiB")
    hf_bf16 = hf_model_fp32.to(torch.bfloat16)
    try:
        prompts = prompts_5_to_600[:6]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            ours = output.outputs[0].token_ids
            with torch.inference_mode():
                result = hf_bf16.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=16,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=2,
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                )
            theirs = result.sequences[0, len(prompt) :].tolist()
            for step, (a, b) in enumerate(zip(ours, theirs, strict=False)):
                if a != b:
                    logprobs = torch.log_softmax(result.scores[step][0].float(), dim=-1)
                    top2 = logprobs.topk(2).values
                    assert (top2[0] - top2[1]).item() < 0.05, f"diverged at step {step} without a near-tie"
                    break
    finally:
        hf_model_fp32.to(torch.float32)
