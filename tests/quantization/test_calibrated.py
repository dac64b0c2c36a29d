"""GPTQ and AWQ reconstruct a real layer's outputs better than RTN, on held-out activations.

Activations are the real model's (float32), captured at decoder layer 2 from a thousand tokens of the
calibration corpus; the held-out activations come from other text (the evaluation text).
"""

from __future__ import annotations

import pytest
import torch

from llmserve.config import EngineArgs
from llmserve.evaluation.perplexity import default_text_path
from llmserve.model_loader import default_model_path, load_arch_config, load_tokenizer, load_weights
from llmserve.models.registry import build_model
from llmserve.quantization import awq, calibration
from llmserve.quantization.formats import quantize_int4, quantize_int8
from llmserve.quantization.gptq import HessianAccumulator, gptq_quantize

LAYER = 2
GROUP = 64


@pytest.fixture(scope="module")
def activations():
    path = default_model_path()
    arch = load_arch_config(path)
    config = EngineArgs(dtype="float32", kv_cache_memory="4MiB").create_config(arch, path).model
    model = build_model(config, load_weights(path, torch.float32))
    tokenizer = load_tokenizer(path, arch.eos_token_ids)
    spec = calibration.CalibrationSpec(num_sequences=4, sequence_len=256)
    calib = calibration.calibration_batches(tokenizer, spec, torch.device("cpu"))
    with open(default_text_path()) as file:
        held_out = [torch.tensor(tokenizer.encode(file.read())[:256])]
    model.model.layers = model.model.layers[: LAYER + 1]  # later layers are not needed
    layer = model.model.layers[LAYER]
    linears = {"qkv": layer.self_attn.qkv_proj, "down": layer.mlp.down_proj}
    captured = {}

    def visit(index, visited, hiddens, positions):
        if index != LAYER:
            return
        inputs = {name: [] for name in linears}
        with calibration.capture_inputs(linears, lambda name, x: inputs[name].append(x.clone())):
            for pos, hidden in zip(positions, hiddens, strict=True):
                visited(pos, hidden)
        captured[phase[0]] = {name: torch.cat(chunks) for name, chunks in inputs.items()}

    phase = [""]
    for phase[0], batches in (("calib", calib), ("held_out", held_out)):
        calibration.run_layerwise(model, batches, visit)
    return {name: linear.weight.detach().clone() for name, linear in linears.items()}, captured


def _error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    return (x @ approx.t() - x @ weight.t()).pow(2).mean().item()


@pytest.mark.parametrize("name", ["qkv", "down"])
@pytest.mark.parametrize(
    ("kind", "group", "rtn"),
    [
        ("int4", GROUP, lambda w: quantize_int4(w, GROUP)),  # --quantization gptq
        ("int8", None, lambda w: quantize_int8(w)),  # --quantization int8 (per channel)
    ],
)
def test_gptq_beats_rtn_on_held_out_activations(activations, name, kind, group, rtn):
    weights, captured = activations
    weight, held_out = weights[name], captured["held_out"][name]
    hessian = HessianAccumulator(weight.shape[1], weight.device)
    hessian.add(captured["calib"][name])
    gptq = gptq_quantize(weight, hessian.hessian(), group, kind=kind).dequantize()
    assert _error(held_out, weight, gptq) < _error(held_out, weight, rtn(weight).dequantize())


@pytest.mark.parametrize("name", ["qkv", "down"])
def test_awq_beats_rtn_on_held_out_activations(activations, name):
    weights, captured = activations
    weight, held_out = weights[name], captured["held_out"][name]
    scales = awq.search_scales(weight, captured["calib"][name], GROUP)
    awq_weight = quantize_int4(weight * scales, GROUP).dequantize() / scales  # input divided by s
    rtn = quantize_int4(weight, GROUP).dequantize()
    assert _error(held_out, weight, awq_weight) < _error(held_out, weight, rtn)
