"""Quantized experts (quantization/moe.py): each expert's weights packed once, only the routed experts
run, the router in float; against the same experts dequantized, in the layer and through the engine."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.config import EngineArgs
from llmserve.model_loader import default_model_path, load_tokenizer
from llmserve.models.layers.moe import MoEExperts
from llmserve.quantization.formats import quantize_int4, quantize_int8
from llmserve.quantization.kernels import QuantizedLinear
from llmserve.quantization.moe import ExpertKernel, QuantizedMoEExperts
from llmserve.worker.memory_report import weights_memory_bytes
from tests.e2e.conftest import teacher_forced_logits
from tests.quantization.moe_reference import dequantized_reference

pytestmark = pytest.mark.cpu_kernels

EXPERTS, HIDDEN, UNITS = 8, 64, 96
QUANTIZERS = {"int8": quantize_int8, "int4": lambda weight: quantize_int4(weight, 32)}


def _quantized_layer(kind: str, dtype: torch.dtype) -> tuple[QuantizedMoEExperts, MoEExperts]:
    """A quantized experts layer and the float layer of its dequantized weights."""
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * UNITS, HIDDEN) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, UNITS) * 0.2
    quantize = QUANTIZERS[kind]
    layer = QuantizedMoEExperts(
        [quantize(w) for w in gate_up], [quantize(w) for w in down], dtype, torch.device("cpu")
    )
    reference = MoEExperts(EXPERTS, HIDDEN, UNITS)
    with torch.no_grad():
        dequantized = layer.dequantize(torch.float32)
        reference.gate_up_proj.copy_(dequantized[0])
        reference.down_proj.copy_(dequantized[1])
    return layer, reference.to(dtype)


def _unbalanced_routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert 0 takes every token (more than the kernels' 8 rows), expert 5 one, 2 a few, the others
    none; renormalized weights."""
    chosen = torch.zeros(tokens, 2, dtype=torch.long)
    chosen[:, 1] = 2
    chosen[0, 1] = 5
    weights = torch.rand(tokens, 2, generator=torch.Generator().manual_seed(1))
    return weights / weights.sum(-1, keepdim=True), chosen


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_quantized_experts_equal_their_dequantized_weights(kind, dtype, tokens):
    """Unbalanced routing, experts no token chose never run; float32 rows where the kernels take
    none multiply by the dequantized weights exactly, kernel rows (input rounded to 8 bits per 32
    columns) within that rounding."""
    layer, reference = _quantized_layer(kind, dtype)
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, chosen = _unbalanced_routing(tokens)
    calls: list[int] = []
    for index, kernel in enumerate(layer.gate_up):
        kernel.register_forward_pre_hook(lambda _m, _a, index=index: calls.append(index))
    with torch.no_grad():
        out = layer(hidden, weights, chosen)
        expected = reference(hidden, weights, chosen)
    assert sorted(set(calls)) == sorted(set(chosen.flatten().tolist())) and len(calls) == len(set(calls))
    rounded = any(isinstance(k, ExpertKernel) and dtype in k._takes for k in layer.gate_up)  # noqa: SLF001
    scale = expected.abs().max().item()
    tolerance = 3e-2 if rounded or dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance * scale, rtol=0)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_experts_hold_only_their_packed_bytes(kind):
    """Resident bytes (every unique storage of the layer) within 1.15x the quantized weights' bytes
    (codes at their bits, float32 scales and offsets): no float copy and no second packed copy."""
    layer, _ = _quantized_layer(kind, torch.bfloat16)
    assert all(isinstance(kernel, ExpertKernel) for kernel in [*layer.gate_up, *layer.down])
    quantize = QUANTIZERS[kind]
    weight = quantize(torch.randn(2 * UNITS, HIDDEN))
    bits = 4 if kind == "int4" else 8
    per_expert = [(2 * UNITS, HIDDEN), (HIDDEN, UNITS)]
    codes = sum(rows * cols * bits // 8 for rows, cols in per_expert)
    params = sum(
        rows * cols // weight.group_size * 4 * (2 if kind == "int4" else 1) for rows, cols in per_expert
    )
    if kind == "int8":  # one scale per row
        params = sum(rows * 4 for rows, _ in per_expert)
    quantized_bytes = EXPERTS * (codes + params)
    resident = weights_memory_bytes(layer)
    assert EXPERTS * codes <= resident <= 1.15 * quantized_bytes
    assert not list(layer.parameters())


# -- through the engine ----------------------------------------------------------------------------

CASES = {
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen3_moe": (  # layer 1 dense
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
}
TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def make_moe_dir(path: str, case: str) -> str:
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra})).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(CASES))
def moe_dir(request, tmp_path_factory):
    return request.param, make_moe_dir(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.mark.parametrize("method", ["int4", "int8-rtn"])
def test_quantized_moe_engine_matches_its_dequantized_weights(moe_dir, method):
    """Every expert and decoder linear quantized, routers in float; the prompt's logits and greedy
    tokens equal a float run of the dequantized weights (float32)."""
    case, path = moe_dir
    args = dict(dtype="float32", max_model_len=128, kv_cache_memory="8MiB", enforce_eager=True)
    quantized, reference = LLM(path, quantization=method, **args), LLM(path, **args)
    try:
        model = quantized.engine.model_runner.model
        modules = dict(model.named_modules())
        assert isinstance(modules["model.layers.0.mlp.experts"], QuantizedMoEExperts)
        assert type(modules["model.layers.0.mlp.gate"]) is not QuantizedLinear  # the router stays float
        assert not any(isinstance(m, MoEExperts) for m in modules.values())
        if case == "qwen3_moe":  # the dense layer's MLP is quantized as any linear
            assert isinstance(modules["model.layers.1.mlp.down_proj"], QuantizedLinear)
        dequantized_reference(quantized, reference)
        tokens = torch.randint(3, 49152, (24,), generator=torch.Generator().manual_seed(3)).tolist()
        ours, expected = teacher_forced_logits(quantized, tokens), teacher_forced_logits(reference, tokens)
        torch.testing.assert_close(ours, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)
        params = SamplingParams(temperature=0, max_tokens=12)
        prompts = [tokens[:9], tokens[5:]]
        got = [o.outputs[0].token_ids for o in quantized.generate(prompts, params, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
        assert got == want
    finally:
        quantized.shutdown()
        reference.shutdown()


@pytest.mark.parametrize("method", ["int8", "gptq", "awq"])
def test_calibrated_methods_refuse_expert_layers_in_one_line(moe_dir, method):
    from llmserve.model_loader import load_arch_config

    _, path = moe_dir
    with pytest.raises(ValueError, match=f"quantization {method} does not apply to mixture-of-experts"):
        EngineArgs(model=path, quantization=method).create_config(load_arch_config(path), path)
