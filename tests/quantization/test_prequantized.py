"""Checkpoints published quantized (GPTQ, AWQ, compressed-tensors, FP8): a tiny random Llama packed by
tests/quantization/prequantized_packers.py serves as the same model with the packer's dequantized
float weights does, its int4/int8 layers on the quantized kernels; unknown methods: a one-line error."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.config import EngineArgs
from llmserve.config.quantization import QuantizationConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.model_loader import ModelLoadError
from llmserve.model_loader.prequantized import (
    CheckpointQuantization,
    IntegerLinear,
    decode_layer,
    dequantized_weights,
    read_quantization,
    unpack_int32,
)
from llmserve.quantization.kernels import QuantizedLinear
from llmserve.quantization.methods import quantize_model
from llmserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_llama_dir, round_inputs_as_the_small_batch_kernels
from tests.quantization import prequantized_packers as packers

PROMPTS = ["The quick brown fox jumps over the lazy dog", "def main():\n    return"]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEPT_FLOAT = "model.layers.1.mlp.down_proj"  # listed as not quantized: stored and served in float
ENGINE_LINEARS = 2 * 4  # qkv, o, gate_up, down per layer


def _gptq_config(bits: int, sym: bool, desc_act: bool, v2: bool = False) -> dict:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": 32,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
        "modules_to_not_convert": [KEPT_FLOAT],
    }


def _ct_config(
    fmt: str, kind: str, bits: int, strategy: str, symmetric: bool = True, actorder: str | None = None
) -> dict:
    weights = {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy, "dynamic": False}
    if strategy == "group":
        weights["group_size"] = 32
    if actorder is not None:
        weights["actorder"] = actorder
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head", KEPT_FLOAT],
    }


_AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
_AWQ_CONFIG["modules_to_not_convert"] = [KEPT_FLOAT]
_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}

# name -> (packer of one weight, quantization_config, the kernel kind of the layers kept quantized;
# None: every layer dequantized at load)
FORMATS: dict[str, tuple[Callable, dict, str | None]] = {
    "gptq-4bit-sym": (packers.gptq, _gptq_config(4, True, False), "int4"),
    "gptq-4bit-asym-v2": (
        lambda w: packers.gptq(w, sym=False, v2=True),
        _gptq_config(4, False, False, v2=True),
        "int4",
    ),
    "gptq-4bit-desc-act": (
        lambda w: packers.gptq(w, sym=False, desc_act=True, seed=w.shape[0] + w.shape[1]),
        _gptq_config(4, False, True),
        None,
    ),
    "gptq-8bit-sym": (lambda w: packers.gptq(w, bits=8), _gptq_config(8, True, False), "int8"),
    "awq-gemm": (packers.awq, _AWQ_CONFIG, "int4"),
    "ct-w4a16-sym": (packers.ct_int4, _ct_config("pack-quantized", "int", 4, "group"), "int4"),
    "ct-w4a16-asym": (
        lambda w: packers.ct_int4(w, symmetric=False),
        _ct_config("pack-quantized", "int", 4, "group", symmetric=False),
        "int4",
    ),
    "ct-w4a16-actorder-group": (  # weight_g_idx shuffled: no contiguous groups, dequantized at load
        lambda w: packers.ct_int4(w, symmetric=False, actorder_seed=w.shape[0] + w.shape[1]),
        _ct_config("pack-quantized", "int", 4, "group", symmetric=False, actorder="group"),
        None,
    ),
    "ct-w8a8-channel": (packers.ct_int8, _ct_config("int-quantized", "int", 8, "channel"), "int8"),
    "ct-w8a8-tensor": (
        lambda w: packers.ct_int8(w, per_tensor=True),
        _ct_config("int-quantized", "int", 8, "tensor"),
        "int8",
    ),
    "ct-fp8-channel": (
        lambda w: packers.fp8(w, per_channel=True),
        _ct_config("float-quantized", "float", 8, "channel"),
        None,
    ),
    "fp8-tensor": (packers.fp8, _FP8_CONFIG, None),
    "fp8-block": (packers.fp8_blocks, {**_FP8_CONFIG, "weight_block_size": [32, 32]}, None),
}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("float")))


def _is_quantized(name: str) -> bool:
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and module.rpartition(".")[2] in LINEARS and module != KEPT_FLOAT


def _write(source: str, dest: str, tensors: dict[str, torch.Tensor], quantization: dict | None) -> str:
    shutil.copytree(source, dest)
    save_file(tensors, os.path.join(dest, "model.safetensors"))
    with open(os.path.join(dest, "config.json")) as file:
        config = json.load(file)
    if quantization is not None:
        config["quantization_config"] = quantization
    with open(os.path.join(dest, "config.json"), "w") as file:
        json.dump(config, file)
    return dest


def _pack(float_dir: str, tmp: str, fmt: str) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(the packed checkpoint, the float checkpoint of its dequantized weights, those weights)."""
    pack, quantization, _ = FORMATS[fmt]
    source = load_file(os.path.join(float_dir, "model.safetensors"))
    packed, reference = {}, {}
    for name, tensor in source.items():
        if _is_quantized(name):
            parts, dequantized = pack(tensor)
            module = name.removesuffix(".weight")
            packed.update({f"{module}.{suffix}": value for suffix, value in parts.items()})
            reference[name] = dequantized.contiguous()
        else:
            packed[name] = reference[name] = tensor
    if any(value.dtype == torch.float8_e4m3fn for value in packed.values()):
        # an activation scale: dropped, activations stay float
        packed["model.layers.0.self_attn.q_proj.input_scale"] = torch.ones(1)
    quantized_dir = _write(float_dir, os.path.join(tmp, "quantized"), packed, quantization)
    return quantized_dir, _write(float_dir, os.path.join(tmp, "reference"), reference, None), reference


def _run(engine: LLMEngine) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens of each prompt and the log-probs of its prompt tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, params)
    tokens, logprobs = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.prompt_logprobs is not None:
                logprobs.setdefault(output.request_id, list(output.prompt_logprobs.token_logprobs))
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    ids = [str(index) for index in range(len(PROMPTS))]
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decoded_weights_equal_the_packers(float_dir, tmp_path, fmt):
    """The loader's dequantization of every layer is the packer's float weight (the format's meaning)."""
    quantized_dir, _, reference = _pack(float_dir, str(tmp_path), fmt)
    with open(os.path.join(quantized_dir, "config.json")) as file:
        spec = read_quantization(json.load(file), quantized_dir)
    decoded = dequantized_weights(
        load_file(os.path.join(quantized_dir, "model.safetensors")), spec, torch.float32
    )
    assert set(decoded) == set(reference)
    for name, weight in reference.items():
        torch.testing.assert_close(decoded[name], weight, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "fmt", ["ct-w4a16-sym", "ct-w4a16-asym", "ct-w8a8-channel", "ct-fp8-channel", "fp8-block"]
)
def test_decoded_weights_equal_transformers(float_dir, tmp_path, fmt):
    """An independent reader of the format: transformers' own integration (compressed-tensors'
    decompression; FP8 dequantized on a CPU) loads the same weights (compressed-tensors decompresses in
    its scales' float16: within float16's rounding)."""
    # imported, never skipped: both are pinned (transformers, and compressed-tensors in the dev extra)
    import compressed_tensors  # noqa: F401
    import transformers

    quantized_dir, _, _ = _pack(float_dir, str(tmp_path), fmt)
    options = {}
    if fmt.startswith("ct-"):
        options["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized_dir, dtype=torch.float32, **options)
    with open(os.path.join(quantized_dir, "config.json")) as file:
        spec = read_quantization(json.load(file), quantized_dir)
    tensors = load_file(os.path.join(quantized_dir, "model.safetensors"))
    decoded = dequantized_weights(tensors, spec, torch.float32)
    compared = [name for name in hf.state_dict() if _is_quantized(name)]
    assert len(compared) == 2 * len(LINEARS) - 1
    for name in compared:
        weight = hf.state_dict()[name].float()
        torch.testing.assert_close(decoded[name], weight, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_engine_serves_the_checkpoint_as_its_dequantized_float_model(float_dir, tmp_path, caplog, fmt):
    """float32: greedy tokens equal and prompt log-probs close to the float model of the packer's
    weights; the layers that map onto int4/int8 run on those kernels, with those very weights; the
    others are named in one log line."""
    quantized_dir, reference_dir, reference = _pack(float_dir, str(tmp_path), fmt)
    expected_kind = FORMATS[fmt][2]
    args = dict(dtype="float32", kv_cache_memory="4MiB")
    with caplog.at_level(logging.INFO, logger="llmserve"):
        engine = LLMEngine(EngineArgs(model=quantized_dir, **args))
    lines = [r.getMessage() for r in caplog.records if "dequantized to float32 at load" in r.getMessage()]
    assert len(lines) == (1 if expected_kind is None else 0)
    model = engine.model_runner.model
    swapped = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if expected_kind is None:
        assert swapped == {}
    else:
        assert len(swapped) == ENGINE_LINEARS - 1  # all but KEPT_FLOAT
        assert KEPT_FLOAT not in swapped and "lm_head" not in swapped
        assert {m.kernel.kind for m in swapped.values()} == {expected_kind}
    for name, module in swapped.items():  # the kernels multiply by the packer's weights
        parts = model.packed_modules.get(name.rpartition(".")[2], (name.rpartition(".")[2],))
        parent = name.rpartition(".")[0]
        weight = torch.cat([reference[f"{parent}.{part}.weight"] for part in parts])
        torch.testing.assert_close(module.kernel.dequantize(torch.float32), weight, rtol=0, atol=1e-6)
    float_engine = LLMEngine(EngineArgs(model=reference_dir, **args))
    if round_inputs_as_the_small_batch_kernels(float_engine.model_runner.model, model):
        float_engine.model_runner.decode_stack = None  # the rounding hooks are on the modules
    tokens, logprobs = _run(engine)
    float_tokens, float_logprobs = _run(float_engine)
    assert tokens == float_tokens
    for prompt, float_prompt in zip(logprobs, float_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(prompt), torch.tensor(float_prompt), rtol=0, atol=1e-3)


def test_naming_the_float_layers_does_not_dequantize_them(float_dir, tmp_path, monkeypatch):
    """The `prequantized` method reads the checkpoint's layers again only to find the codes its kernels
    take: the FP8 layers (the loader's float model has them) are named, never multiplied out again."""
    from llmserve.model_loader import prequantized as decoding
    from llmserve.quantization.prequantized import checkpoint_layers

    quantized_dir, _, _ = _pack(float_dir, str(tmp_path), "fp8-block")

    def refuse(*_):
        raise AssertionError("an FP8 layer dequantized only to be named")

    monkeypatch.setattr(decoding, "_blocks", refuse)
    kept, dequantized = checkpoint_layers(quantized_dir)
    assert kept == {}
    assert len(dequantized) == 2 * len(LINEARS) - 1
    assert set(dequantized.values()) == {"fp8 block-wise"}


def test_bfloat16_runs_the_packed_int4_kernel(float_dir, tmp_path):
    """bfloat16 on a CPU: GPTQ's codes go to the compiled int4 kernel (PyTorch's packed op where the
    build lacks it), AWQ's too; the lm_head stays float."""
    from llmserve.kernels.cpu_ops import load_cpu_ops
    from llmserve.quantization.kernels import Int4PackedKernel, RoundedInputKernel

    quantized_dir, _, _ = _pack(float_dir, str(tmp_path), "gptq-4bit-sym")
    engine = LLMEngine(EngineArgs(model=quantized_dir, dtype="bfloat16", kv_cache_memory="4MiB"))
    model = engine.model_runner.model
    kernels = {type(m.kernel) for m in model.modules() if isinstance(m, QuantizedLinear)}
    ops = load_cpu_ops()
    compiled = ops is not None and ops.small_batch_linear_int8_supported(torch.bfloat16)
    assert kernels == {RoundedInputKernel if compiled else Int4PackedKernel}
    tokens, _ = _run(engine)
    assert all(len(t) == 10 for t in tokens)


def test_a_quantized_lm_head_is_dequantized_and_named(tmp_path, caplog):
    """A GPTQ checkpoint that quantized its (untied) lm_head too: served in float, named in the log line."""
    float_dir = make_tiny_llama_dir(str(tmp_path / "float"), tie_word_embeddings=False)
    packed, head = {}, None
    for name, tensor in load_file(os.path.join(float_dir, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and (module.rpartition(".")[2] in LINEARS or module == "lm_head"):
            parts, dequantized = packers.gptq(tensor)
            packed.update({f"{module}.{suffix}": value for suffix, value in parts.items()})
            head = dequantized if module == "lm_head" else head
        else:
            packed[name] = tensor
    path = _write(float_dir, str(tmp_path / "quantized"), packed, _gptq_config(4, True, False))
    with caplog.at_level(logging.INFO, logger="llmserve"):
        model = LLMEngine(EngineArgs(model=path, dtype="float32", kv_cache_memory="4MiB")).model_runner.model
    assert not isinstance(model.lm_head, QuantizedLinear)
    torch.testing.assert_close(model.lm_head.weight, head, rtol=0, atol=1e-6)
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == ENGINE_LINEARS
    (line,) = [r.getMessage() for r in caplog.records if "at load" in r.getMessage()]
    assert "not a quantizable linear of this model: 1 (lm_head)" in line


@pytest.mark.parametrize(
    ("case", "kept"),
    [
        ("phi3-partial-rotary", 3 * 4),  # its fused qkv_proj and gate_up_proj as the checkpoint stores them
        ("qwen3-moe-dense-layer", 3 * 2 + 2),  # attention, and layer 1's dense MLP; experts dequantized
        ("gemma3-qk-norm-local-rope", 3 * 4),
    ],
)
def test_other_families_serve_gptq_checkpoints(tmp_path, case, kept):
    """GPTQ packs every projection (Mixtral-style experts included; the router stays float): greedy
    tokens equal the float model of the packer's weights; the fused and dense linears are int4."""
    from tests.models.families import make_family_dir

    float_dir = str(tmp_path / "float")
    make_family_dir(float_dir, case)
    packed, reference = {}, {}
    for name, tensor in load_file(os.path.join(float_dir, "model.safetensors")).items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            group = 32 if tensor.shape[1] % 32 == 0 else 16  # Qwen3-MoE's experts: 48 inputs
            parts, reference[name] = packers.gptq(tensor, group=group)
            packed.update(
                {f"{name.removesuffix('.weight')}.{suffix}": value for suffix, value in parts.items()}
            )
        else:
            packed[name] = reference[name] = tensor
    config = _gptq_config(4, True, False)
    quantized_dir = _write(float_dir, str(tmp_path / "quantized"), packed, config)
    reference_dir = _write(float_dir, str(tmp_path / "reference"), reference, None)
    args = dict(dtype="float32", kv_cache_memory="4MiB")
    engine = LLMEngine(EngineArgs(model=quantized_dir, **args))
    model = engine.model_runner.model
    swapped = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(swapped) == kept
    assert {m.kernel.kind for m in swapped.values()} == {"int4"}
    float_engine = LLMEngine(EngineArgs(model=reference_dir, **args))
    if round_inputs_as_the_small_batch_kernels(float_engine.model_runner.model, model):
        float_engine.model_runner.decode_stack = None
    tokens, logprobs = _run(engine)
    float_tokens, float_logprobs = _run(float_engine)
    assert tokens == float_tokens
    for prompt, float_prompt in zip(logprobs, float_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(prompt), torch.tensor(float_prompt), rtol=0, atol=1e-3)


def test_each_tensor_parallel_rank_holds_its_cut_of_the_checkpoints_codes(tmp_path):
    """Two ranks of a model whose heads split unevenly (6 query / 3 KV heads): each rank's int4
    weights are the whole model's, cut by hand (tests/distributed/test_quantized_shards.py's oracle)."""
    from tests.distributed.conftest import UNEVEN_HEADS
    from tests.distributed.test_quantized_shards import _build, _config, _cut, _dequantized, _shards

    float_dir = make_tiny_llama_dir(str(tmp_path / "float"), **UNEVEN_HEADS)
    packed = {}
    for name, tensor in load_file(os.path.join(float_dir, "model.safetensors")).items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            parts, _ = packers.gptq(tensor, sym=False)
            packed.update(
                {f"{name.removesuffix('.weight')}.{suffix}": value for suffix, value in parts.items()}
            )
        else:
            packed[name] = tensor
    path = _write(float_dir, str(tmp_path / "quantized"), packed, _gptq_config(4, False, False))
    config = _config(path, None)
    assert config.quantization.method == "prequantized"
    whole = _build(config)
    quantize_model(whole, config)
    want = _dequantized(whole)
    assert len(want) == 2 * 4
    for shard in _shards(config, None):
        got = _dequantized(shard)
        assert got.keys() == want.keys()
        for name, weight in want.items():
            assert torch.equal(got[name], _cut(name, weight, shard.shard, config)), (shard.shard.rank, name)


def test_quantization_none_serves_the_checkpoint_dequantized(float_dir, tmp_path, caplog):
    quantized_dir, _, _ = _pack(float_dir, str(tmp_path), "awq-gemm")
    args = EngineArgs(model=quantized_dir, dtype="float32", kv_cache_memory="4MiB", quantization="none")
    with caplog.at_level(logging.INFO, logger="llmserve"):
        model = LLMEngine(args).model_runner.model
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    (line,) = [r.getMessage() for r in caplog.records if "served as its float model" in r.getMessage()]
    assert "awq" in line and "(--quantization none)" in line


@pytest.mark.parametrize(("device", "method"), [("cpu", "prequantized"), ("cuda", None)])
def test_checkpoint_codes_are_kept_only_where_a_packed_kernel_runs(device, method):
    """No --quantization: the checkpoint's own codes on the CPU (its int4/int8 kernels); on a GPU,
    where they would be dequantized at every forward, the float model the loader decoded."""
    config = QuantizationConfig.create(None, None, (64,), (), "gptq", device)
    assert (config and config.method) == method
    assert QuantizationConfig.create("none", None, (64,), (), "gptq", device) is None
    assert QuantizationConfig.create("int8", None, (64,), (), "gptq", device).method == "int8"


def test_the_float_model_on_a_gpu_is_named_in_one_line(caplog):
    from llmserve.quantization.prequantized import log_served_float

    with caplog.at_level(logging.INFO, logger="llmserve"):
        log_served_float("gptq", torch.bfloat16, torch.device("cuda", 0))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "checkpoint quantization gptq: served as its float model, every layer dequantized to bfloat16 "
        "(no int4/int8 kernel on cuda: its codes would be dequantized at every forward)"
    )


def test_unpack_int32_reads_lowest_bits_first():
    words = torch.tensor([[0x76543210, -0x789ABCDF]], dtype=torch.int32)  # the second: 0x87654321
    assert unpack_int32(words, 4, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert unpack_int32(words.t(), 8, 0).t().tolist() == [[0x10, 0x32, 0x54, 0x76, 0x21, 0x43, 0x65, 0x87]]


def _word(unsigned: int) -> int:
    """A 32-bit word written as hex, as the int32 a checkpoint stores it."""
    return unsigned - 2**32 if unsigned >= 2**31 else unsigned


@pytest.mark.parametrize("v2", [False, True])
def test_gptq_words_decode_by_the_formats_definition(v2):
    """Golden words, independent of our packer. GPTQ's qweight [in / 8, out] holds input rows 8i .. 8i+7
    of one output column in a word, row 8i + j in bits 4j .. 4j+3: 0x76543210 in column 0 is rows 0..7
    with codes 0..7. qzeros [groups, out / 8] holds output columns 8i .. 8i+7 the same way: 0xFEDCBA98
    is columns 0..7 with 8..15, the zero itself in gptq_v2 and the zero minus one in v1."""
    qweight = torch.tensor([[_word(0x76543210)] + [0] * 7], dtype=torch.int32)  # [in 8 / 8, out 8]
    parts = {
        "qweight": qweight,
        "qzeros": torch.tensor([[_word(0xFEDCBA98)]], dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    spec = CheckpointQuantization("gptq", 4, zeros_minus_one=not v2)
    layer = decode_layer(parts, spec)
    assert isinstance(layer, IntegerLinear) and layer.group_size == 8
    assert layer.codes[0].tolist() == list(range(8))  # output 0, inputs 0..7
    assert layer.codes[1:].eq(0).all()
    assert layer.zeros[:, 0].tolist() == [z + (0 if v2 else 1) for z in range(8, 16)]
    eight_bit = decode_layer(
        {
            "qweight": torch.tensor([[0x03020100], [0x07060504]], dtype=torch.int32),  # [in 8 / 4, out 1]
            "qzeros": torch.tensor([[0x7F]], dtype=torch.int32),  # v1: 127 + 1
            "scales": torch.ones(1, 1, dtype=torch.float16),
        },
        CheckpointQuantization("gptq", 8, zeros_minus_one=True),
    )
    assert eight_bit.codes.tolist() == [list(range(8))] and eight_bit.zeros.tolist() == [[128.0]]


def test_awq_words_decode_by_the_formats_definition():
    """Golden words, independent of our packer. AutoAWQ's GEMM packer puts output column
    order_map[i] of each 8 into nibble i (bits 4i .. 4i+3), order_map = (0, 2, 4, 6, 1, 3, 5, 7).
    Codes 0..7 in columns 0..7: nibbles 0..7 hold 0, 2, 4, 6, 1, 3, 5, 7, so the word, highest nibble
    first, is 0x75316420. Zeros 15, 14, ..., 8 in columns 0..7: nibbles hold 15, 13, 11, 9, 14, 12,
    10, 8, the word 0x8ACE9BDF."""
    qweight = torch.tensor([[_word(0x75316420)]] + [[0]] * 7, dtype=torch.int32)  # [in 8, out 8 / 8]
    parts = {
        "qweight": qweight,
        "qzeros": torch.tensor([[_word(0x8ACE9BDF)]], dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    layer = decode_layer(parts, CheckpointQuantization("awq", 4))
    assert isinstance(layer, IntegerLinear) and layer.group_size == 8
    assert layer.codes[:, 0].tolist() == list(range(8))  # input 0, outputs 0..7
    assert layer.codes[:, 1:].eq(0).all()
    assert layer.zeros[:, 0].tolist() == list(range(15, 7, -1))


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "gptq: unsupported bits 3"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq: unsupported version 'gemv'"),
    ],
)
def test_unsupported_quantization_is_a_one_line_error(float_dir, tmp_path, quantization, message):
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    path = _write(float_dir, str(tmp_path / "model"), tensors, quantization)
    with pytest.raises(ModelLoadError, match=message) as error:
        LLMEngine(EngineArgs(model=path, dtype="float32", kv_cache_memory="4MiB"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("fmt", ["gptq-4bit-sym", "awq-gemm", "ct-w8a8-channel"])
def test_kept_codes_are_never_decoded_to_float(float_dir, tmp_path, monkeypatch, fmt):
    """Layers whose codes a kernel keeps are left out of the float loading (no decoding, no float
    parameter); the model equals the one built from every layer decoded, then replaced."""
    from llmserve.model_loader import load_arch_config
    from tests.quantization.test_weights_loaded_once import assert_equals_the_old_path, load_recording_names

    quantized_dir, _, _ = _pack(float_dir, str(tmp_path), fmt)
    args = EngineArgs(model=quantized_dir, kv_cache_memory="4MiB")
    config = args.create_config(load_arch_config(quantized_dir), quantized_dir).model
    assert config.quantization is not None and config.quantization.method == "prequantized"
    model, names = load_recording_names(monkeypatch, config)
    kept = {
        source
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
        for source in model.checkpoint_names(f"{name}.weight")
    }
    assert kept, "the checkpoint's codes are kept in the kernels"
    assert not kept & names
    assert_equals_the_old_path(model, config, quantized_dir)
