"""Our Llama on a flat, chunked, mixed batch gives HF transformers' logits, position by position."""

from types import SimpleNamespace

import pytest
import torch
import transformers

from llmserve.config import CacheConfig, EngineConfig, ModelArchConfig, ModelConfig, SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.forward_context import set_forward_context
from llmserve.models.registry import build_model
from llmserve.request import Request
from llmserve.sampling_params import SamplingParams
from llmserve.worker.model_runner import ModelRunner

VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

CASES = {
    "llama-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=True, rope_theta=10000.0),
    ),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen2-qkv-bias": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=False, rope_theta=1000000.0),
    ),
}


def build_pair(case: str):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf_config = config_cls(**COMMON, **extra)
    hf = model_cls(hf_config).eval()
    with torch.no_grad():  # make the q/k/v biases visible: HF initializes them to zero
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    rope = dict(hf_config.rope_parameters)  # transformers 5 keeps theta and scaling together here
    theta = rope.pop("rope_theta")
    assert theta == extra["rope_theta"]
    arch = ModelArchConfig(
        architecture="qwen2" if "qwen2" in case else "llama",
        head_dim=16,
        rope_theta=theta,
        attention_bias="qwen2" in case,
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        tie_word_embeddings=extra["tie_word_embeddings"],
        **COMMON,
    )
    model_config = ModelConfig(path="", arch=arch, dtype=torch.float32, max_model_len=256)
    ours = build_model(model_config, hf.state_dict())
    return hf, ours, model_config


def make_runner(model_config, model, block_size=4):
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    config = EngineConfig(
        model=model_config,
        cache=CacheConfig(block_size=block_size, num_blocks=64, kv_cache_memory=0),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256),
    )
    return ModelRunner(config, model), kv


def run_step(runner, kv, plan: list[tuple[Request, int]]) -> list[torch.Tensor]:
    """Run a step and return each request's logits for its scheduled tokens, in plan order."""
    rows = []
    for request, count in plan:
        assert kv.allocate_slots(request, count)
        row = SimpleNamespace(  # what the runner's input preparation reads of a request
            request_id=request.request_id,
            all_token_ids=request.all_token_ids,
            num_tokens=request.num_tokens,
            num_computed_tokens=request.num_computed_tokens,
            spec_token_ids=[],
            block_ids=kv.get_block_table(request.request_id),
        )
        rows.append((row, count))
    inputs = runner.input_builder.build(rows)
    with torch.inference_mode(), set_forward_context(inputs.attention):
        logits = runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions))
    per_request, start = {}, 0
    for request in inputs.requests:  # the runner's batch order
        count = dict((r.request_id, c) for r, c in plan)[request.request_id]
        per_request[request.request_id] = logits[start : start + count]
        start += count
    for request, count in plan:
        request.num_computed_tokens += count
    return [per_request[r.request_id] for r, _ in plan]


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_and_decode_in_one_flat_batch_match_hf(case):
    hf, ours, model_config = build_pair(case)
    runner, kv = make_runner(model_config, ours)
    generator = torch.Generator().manual_seed(1)
    tokens = {n: torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (7, 13, 3)}
    a, b, c = (Request(f"r{n}", t, SamplingParams()) for n, t in tokens.items())

    # Step 1: a whole, b's first chunk (crossing a block boundary), c whole.
    logits_a, logits_b1, logits_c = run_step(runner, kv, [(a, 7), (b, 5), (c, 3)])
    # Step 2: a decodes one new token, b finishes its prompt, c decodes.
    a.append_output_token(11)
    c.append_output_token(5)
    logits_a2, logits_b2, logits_c2 = run_step(runner, kv, [(a, 1), (b, 8), (c, 1)])

    atol = 1e-4
    torch.testing.assert_close(logits_a, hf_logits(hf, a.prompt_token_ids), atol=atol, rtol=1e-4)
    torch.testing.assert_close(logits_c, hf_logits(hf, c.prompt_token_ids), atol=atol, rtol=1e-4)
    full_b = hf_logits(hf, b.prompt_token_ids)
    torch.testing.assert_close(torch.cat([logits_b1, logits_b2]), full_b, atol=atol, rtol=1e-4)
    torch.testing.assert_close(logits_a2[0], hf_logits(hf, a.all_token_ids)[-1], atol=atol, rtol=1e-4)
    torch.testing.assert_close(logits_c2[0], hf_logits(hf, c.all_token_ids)[-1], atol=atol, rtol=1e-4)
