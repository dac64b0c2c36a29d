"""Quantized experts (quantization/moe.py): each expert's weights packed once, only the routed experts
run, the router in float; against the same experts dequantized, in the layer and through the engine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmserve import LLM
from llmserve.cli.main import main
from llmserve.config import EngineArgs
from llmserve.model_loader import load_arch_config
from llmserve.models.layers.moe import MoEExperts
from llmserve.quantization.formats import quantize_int4, quantize_int8
from llmserve.quantization.kernels import QuantizedLinear, RoundedInputKernel
from llmserve.quantization.moe import QuantizedMoEExperts, checkpoint_expert_weights
from llmserve.worker.memory_report import weights_memory_bytes
from tests.e2e.conftest import teacher_forced_logits
from tests.models.moe_gguf import VOCAB, write_moe_gguf
from tests.quantization.moe_reference import (
    assert_greedy_equal_but_at_near_ties,
    dequantized_reference,
    greedy,
)

pytestmark = pytest.mark.cpu_kernels

EXPERTS, HIDDEN, UNITS = 8, 64, 96
QUANTIZERS = {
    "int8": quantize_int8,  # one scale per row (int8-rtn)
    "int8-g16": lambda weight: quantize_int8(weight, 16),  # GGUF Q6_K's groups
    "int4": lambda weight: quantize_int4(weight, 32),
}


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


@pytest.mark.parametrize("kind", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_quantized_experts_equal_their_dequantized_weights(kind, dtype, tokens):
    """Unbalanced routing, experts no token chose never run; float32 rows where the kernels take
    none multiply by the dequantized weights exactly, kernel rows (input rounded to 8 bits per 32
    columns) within that rounding."""
    layer, reference = _quantized_layer(kind, dtype)
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, chosen = _unbalanced_routing(tokens)
    for expert in set(range(EXPERTS)) - set(chosen.flatten().tolist()):  # read, they would give NaN
        for kernel in (layer.gate_up[expert], layer.down[expert]):
            kernel.small_batch_scales.fill_(float("nan"))
    with torch.no_grad():
        out = layer(hidden, weights, chosen)
        expected = reference(hidden, weights, chosen)
    assert out.isfinite().all()
    rounded = any(isinstance(k, RoundedInputKernel) and k.takes(dtype) for k in layer.gate_up)
    scale = expected.abs().max().item()
    tolerance = 3e-2 if rounded or dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance * scale, rtol=0)


@pytest.mark.parametrize("kind", list(QUANTIZERS))
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (20, 2), (7, 1)])
def test_grouped_kernels_equal_the_experts_one_by_one(kind, tokens, top_k):
    """Where the kernels take the activations, the layer is one compiled call over all experts
    (no host sync), bit for bit what each expert's own kernel gives its rows; top_k 1 with weights
    of 1 is how expert parallelism calls a rank's experts (moe_parallel.py `_held`)."""
    layer, _ = _quantized_layer(kind, torch.bfloat16)
    if not layer.gate_up[0].takes(torch.bfloat16):
        pytest.skip("this level's int8/int4 kernels do not take bfloat16 inputs")
    assert layer.grouped_gate_up is not None and layer.grouped_down is not None
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    weights, chosen = _unbalanced_routing(tokens)
    if top_k == 1:
        weights, chosen = torch.ones(tokens, 1), torch.arange(tokens).remainder(3).view(tokens, 1) * 2
    with torch.no_grad():
        grouped = layer(hidden, weights, chosen)
        layer.grouped_gate_up = None  # now expert by expert
        one_by_one = layer(hidden, weights, chosen)
    assert torch.equal(grouped, one_by_one)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("path", ["grouped", "one-by-one"])
def test_a_run_of_the_experts_computes_only_their_pairs(kind, path):
    """Expert parallelism's rank holds a run of the router's experts: the layers holding 0-2, 3-5
    and 6-7 each give, bit for bit, the whole layer's output with the other pairs' weights at 0
    (tokens with no pair there: zeros), and the three partial outputs add up to the whole layer's
    (each rounded to bf16 once); an expert id past the router's is an error, not a skipped pair."""
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * UNITS, HIDDEN) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, UNITS) * 0.2
    quantize = QUANTIZERS[kind]
    codes = [quantize(w) for w in gate_up], [quantize(w) for w in down]
    cpu = torch.device("cpu")
    whole = QuantizedMoEExperts(*codes, torch.bfloat16, cpu)
    runs = [range(0, 3), range(3, 6), range(6, 8)]
    parts = [
        QuantizedMoEExperts(codes[0][r.start : r.stop], codes[1][r.start : r.stop], torch.bfloat16, cpu,
                            r.start, EXPERTS)
        for r in runs
    ]  # fmt: skip
    if path == "one-by-one":
        for layer in (whole, *parts):
            layer.grouped_gate_up = None
    elif not whole.runs_grouped(torch.bfloat16):
        pytest.skip("this level's int8/int4 kernels do not take bfloat16 inputs")
    tokens = 12
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(4)).bfloat16()
    weights, chosen = _unbalanced_routing(tokens)
    chosen[3:6, 1] = 7  # the last run gets pairs, experts 1, 3, 4 and 6 none
    with torch.no_grad():
        got = [layer(hidden, weights, chosen) for layer in parts]
        total = whole(hidden, weights, chosen)
        for run, out in zip(runs, got, strict=True):
            mine = (chosen >= run.start) & (chosen < run.stop)
            expected = whole(hidden, weights * mine, chosen)  # the others' pairs at weight 0
            assert torch.equal(out, expected)
            assert torch.equal(out[~mine.any(1)], torch.zeros_like(out[~mine.any(1)]))
    scale = total.abs().max().item()
    torch.testing.assert_close(sum(g.float() for g in got), total.float(), atol=2e-2 * scale, rtol=0)
    with pytest.raises((RuntimeError, ValueError), match="expert index out of range"):
        parts[0](hidden, weights, torch.full_like(chosen, EXPERTS))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_experts_hold_only_their_packed_bytes(kind):
    """Resident bytes (every unique storage of the layer) within 1.15x the quantized weights' bytes
    (codes at their bits, float32 scales and offsets): no float copy and no second packed copy."""
    layer, _ = _quantized_layer(kind, torch.bfloat16)
    assert all(isinstance(kernel, RoundedInputKernel) for kernel in [*layer.gate_up, *layer.down])
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
# float32 GGUF files of tiny Mixtral and Qwen3-MoE models (small vocabularies: quick to load), quantized
# at start-up as any float model (the HF directory path loads to the same modules: test_families.py)

ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory="8MiB", enforce_eager=True)


@pytest.fixture(scope="module", params=["llama", "qwen3moe"])
def moe_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    write_moe_gguf(path, request.param)
    return request.param, str(path)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("method", ["int4", "int8-rtn"])
def test_quantized_moe_engine_matches_its_dequantized_weights(moe_file, method):
    """Every expert and decoder linear quantized, routers in float; the prompt's logits and greedy
    tokens equal a float run of the dequantized weights (float32)."""
    _, path = moe_file
    quantized, reference = LLM(path, quantization=method, **ENGINE), LLM(path, **ENGINE)
    try:
        modules = dict(quantized.engine.model_runner.model.named_modules())
        assert all(
            isinstance(modules[f"model.layers.{i}.mlp.experts"], QuantizedMoEExperts) for i in range(2)
        )
        assert type(modules["model.layers.0.mlp.gate"]) is not QuantizedLinear  # the router stays float
        assert not any(isinstance(m, MoEExperts) for m in modules.values())
        assert isinstance(modules["model.layers.1.self_attn.o_proj"], QuantizedLinear)
        rounded = dequantized_reference(quantized, reference)
        tokens = _prompt(3, 24)
        ours, expected = teacher_forced_logits(quantized, tokens), teacher_forced_logits(reference, tokens)
        torch.testing.assert_close(ours, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)
        assert_greedy_equal_but_at_near_ties(quantized, reference, [tokens[:9], tokens[5:]], rounded)
    finally:
        quantized.shutdown()
        reference.shutdown()


@pytest.mark.parametrize("method", ["int8", "gptq", "awq"])
def test_calibrated_methods_refuse_expert_layers_in_one_line(moe_file, method):
    _, path = moe_file
    with pytest.raises(ValueError, match=f"quantization {method} does not apply to mixture-of-experts"):
        EngineArgs(model=path, quantization=method).create_config(load_arch_config(path), path)


def test_a_saved_moe_checkpoint_reloads_the_same_experts(tmp_path):
    """`llmserve quantize` saves every expert's weight (one entry per expert); `--quantization DIR`
    puts them back: the same codes and the same greedy tokens as quantizing at start-up."""
    path = str(tmp_path / "tiny-qwen3moe.gguf")
    write_moe_gguf(path, "qwen3moe")
    output = str(tmp_path / "int4")
    assert main(["quantize", "--model", path, "--quantization", "int4", "--output", output]) == 0
    direct, saved = LLM(path, quantization="int4", **ENGINE), LLM(path, quantization=output, **ENGINE)
    try:
        llms = (direct, saved)
        experts = [
            dict(llm.engine.model_runner.model.named_modules())["model.layers.0.mlp.experts"] for llm in llms
        ]
        for a, b in zip(experts[0].dequantize(), experts[1].dequantize(), strict=True):
            assert torch.equal(a, b)
        prompts = [_prompt(5, 9)]
        assert greedy(direct, prompts) == greedy(saved, prompts)
    finally:
        direct.shutdown()
        saved.shutdown()


def test_checkpoint_expert_names_map_to_each_experts_layer():
    """A pre-quantized checkpoint's experts, by Mixtral's (w1/w3/w2) or Qwen3-MoE's names: gate and up
    fused per expert under the layer's expert keys; a layer missing one expert's part takes none."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for layer in model.layers:
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = MoEExperts(2, HIDDEN, UNITS)
    quantize = QUANTIZERS["int4"]
    shapes = {"w1": (UNITS, HIDDEN), "w3": (UNITS, HIDDEN), "w2": (HIDDEN, UNITS)}
    mixtral = {
        f"layers.0.block_sparse_moe.experts.{e}.{w}": quantize(torch.randn(*shape))
        for e in range(2)
        for w, shape in shapes.items()
    }
    qwen = {  # expert 1 missing
        f"layers.1.mlp.experts.0.{part}": mixtral[f"layers.0.block_sparse_moe.experts.0.{w}"]
        for part, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
    }
    weights, used = checkpoint_expert_weights(model, {**mixtral, **qwen})
    assert set(weights) == {
        f"layers.0.mlp.experts.{p}.{e}" for p in ("gate_up_proj", "down_proj") for e in range(2)
    }
    assert used == set(mixtral)
    gate, up = (
        mixtral["layers.0.block_sparse_moe.experts.1.w1"],
        mixtral["layers.0.block_sparse_moe.experts.1.w3"],
    )
    fused = torch.cat([gate.dequantize(), up.dequantize()])
    assert torch.equal(weights["layers.0.mlp.experts.gate_up_proj.1"].dequantize(), fused)
    weights, used = checkpoint_expert_weights(
        model, {k.replace("experts.1.", "experts.0."): v for k, v in mixtral.items()}
    )
    assert not weights and not used


@pytest.mark.full
def test_a_gptq_mixtral_checkpoint_serves_its_experts_own_codes(tmp_path):
    """A GPTQ checkpoint of a Mixtral (every projection packed, its experts' w1/w3/w2 included; the
    router float): each experts layer holds the checkpoint's int4 codes (their dequantization is the
    packer's weights) and the engine gives the float run of those weights. (Fast tier: the name
    mapping, test_checkpoint_expert_names_map_to_each_experts_layer; the layer, the tests above.)"""
    from safetensors.torch import load_file, save_file

    from tests.models.families import make_family_dir
    from tests.quantization import prequantized_packers as packers

    float_dir = str(tmp_path / "float")
    make_family_dir(float_dir, "mixtral-top2-of-4")
    packed, reference = {}, {}
    for name, tensor in load_file(f"{float_dir}/model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.startswith("model.layers.") and module.endswith(("proj", ".w1", ".w2", ".w3")):
            parts, reference[name] = packers.gptq(tensor, group=32)
            packed.update({f"{module}.{suffix}": value for suffix, value in parts.items()})
        else:
            packed[name] = reference[name] = tensor
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    dirs = {}
    for kind, tensors, quantization in (("quantized", packed, config), ("reference", reference, None)):
        dirs[kind] = str(tmp_path / kind)
        shutil.copytree(float_dir, dirs[kind])
        save_file({k: v.contiguous() for k, v in tensors.items()}, f"{dirs[kind]}/model.safetensors")
        with open(f"{dirs[kind]}/config.json") as file:
            fields = json.load(file)
        with open(f"{dirs[kind]}/config.json", "w") as file:
            json.dump({**fields, **({"quantization_config": quantization} if quantization else {})}, file)
    quantized, float_run = LLM(dirs["quantized"], **ENGINE), LLM(dirs["reference"], **ENGINE)
    try:
        modules = dict(quantized.engine.model_runner.model.named_modules())
        layer = modules["model.layers.0.mlp.experts"]
        assert isinstance(layer, QuantizedMoEExperts) and isinstance(layer.gate_up[0], RoundedInputKernel)
        gate_up, down = layer.dequantize()
        expected = torch.cat(
            [reference[f"model.layers.0.block_sparse_moe.experts.3.{w}.weight"] for w in ("w1", "w3")]
        )
        torch.testing.assert_close(gate_up[3], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            down[3], reference["model.layers.0.block_sparse_moe.experts.3.w2.weight"], rtol=0, atol=1e-6
        )
        assert type(modules["model.layers.0.mlp.gate"]) is not QuantizedLinear
        rounded = dequantized_reference(quantized, float_run)
        tokens = torch.randint(3, 49152, (20,), generator=torch.Generator().manual_seed(6)).tolist()
        assert_greedy_equal_but_at_near_ties(quantized, float_run, [tokens[:7], tokens], rounded)
    finally:
        quantized.shutdown()
        float_run.shutdown()
