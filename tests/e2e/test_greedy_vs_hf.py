"""Greedy tokens equal HF transformers token for token, on the real default model."""

import copy

import pytest
import torch

from llmserve import LLM, SamplingParams

from .conftest import hf_greedy, teacher_forced_logits

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


@pytest.mark.full
def test_bfloat16_matches_hf_or_diverges_within_each_others_top_5(hf_model_fp32, prompts_5_to_600):
    """vLLM's check_logprobs_close: equal, or at the first divergence each side's token is among the
    other's five most likely. bfloat16 greedy paths are chaotic on this model (its outlier activations
    reach ~2,600, where a bf16 step is 16): any change in float32 summation order flips some ties, so
    token equality is not the bar; closeness to float32 is (the next test)."""
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory="256MiB")
    hf_bf16 = copy.deepcopy(hf_model_fp32).to(torch.bfloat16)
    prompts = prompts_5_to_600[:6]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0]
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
        for step, (a, b) in enumerate(zip(ours.token_ids, theirs, strict=False)):
            if a != b:
                hf_top5 = result.scores[step][0].float().topk(5).indices.tolist()
                assert a in hf_top5, f"step {step}: our token {a} is not in HF's top 5 {hf_top5}"
                assert b in ours.logprobs[step], f"step {step}: HF's token {b} is not in our top 5"
                break


@pytest.mark.full
def test_bfloat16_is_as_close_to_float32_as_hf_bfloat16(hf_model_fp32, prompts_5_to_600):
    """Teacher-forced over ~600 tokens of real text: the log-probability our bf16 engine gives each
    next token is no further from HF's float32 than HF's own bf16 model is (mean absolute error).
    This is the accuracy bar for the fused kernels; a real bug is orders of magnitude off."""
    text = prompts_5_to_600[-1]
    ids = torch.tensor([text])

    def next_token_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]

    with torch.inference_mode():
        reference = next_token_logprobs(hf_model_fp32(ids).logits[0, :-1])
        hf_bf16 = next_token_logprobs(copy.deepcopy(hf_model_fp32).to(torch.bfloat16)(ids).logits[0, :-1])
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory="256MiB", prefix_caching=False)
    ours = next_token_logprobs(teacher_forced_logits(llm, text)[:-1])
    our_error = (ours - reference).abs().mean().item()
    hf_error = (hf_bf16 - reference).abs().mean().item()
    assert our_error <= 1.2 * hf_error, (our_error, hf_error)
