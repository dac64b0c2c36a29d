"""A family feature that is not supported is a one-line error naming it and what is supported."""

import json

import pytest
import torch

from llmserve.attention.registry import select_attention_backend
from llmserve.config import EngineArgs
from llmserve.model_loader import load_arch_config
from llmserve.model_loader.errors import ModelLoadError

from .families import make_family_dir


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    paths = {}
    for case in (
        "gemma2-softcap-interleaved-window",
        "mixtral-top2-of-4",
        "qwen3-qk-norm",
        "phi3-partial-rotary",
    ):
        paths[case.split("-")[0]] = path = str(tmp_path_factory.mktemp(case))
        make_family_dir(path, case)
    return paths


def _one_line_error(error_type, function, *args, **kwargs) -> str:
    with pytest.raises(error_type) as info:
        function(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_rope_scaling_type_names_the_supported_ones(tmp_path, family_dirs):
    with open(f"{family_dirs['qwen3']}/config.json") as file:
        config = json.load(file)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = _one_line_error(ModelLoadError, load_arch_config, str(tmp_path))
    assert "unsupported rope_scaling type 'yarn'" in message
    assert "default, linear, llama3, longrope" in message


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Starcoder2ForCausalLM"]}))
    message = _one_line_error(ModelLoadError, load_arch_config, str(tmp_path))
    assert "Starcoder2ForCausalLM" in message
    for name in (
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "MixtralForCausalLM",
    ):
        assert name in message


@pytest.mark.parametrize(
    "family, engine_args, expected",
    [
        ("gemma2", dict(quantization="int8"), "quantization does not apply to gemma2 models"),
        ("mixtral", dict(quantization="gptq"), "quantization gptq does not apply to mixture-of-experts"),
        ("phi3", dict(quantization="gguf"), "quantization gguf does not apply to phi3 models"),
        ("gemma2", dict(tensor_parallel_size=2), "tensor parallelism does not apply to gemma2 models"),
        (
            "mixtral",
            dict(tensor_parallel_size=2, quantization="gguf"),
            "quantization gguf cannot split the experts' 96 units over 2 tensor-parallel ranks (48 + 48)",
        ),
        (
            "qwen3",
            dict(enable_expert_parallel=True),
            "--enable-expert-parallel needs a mixture-of-experts model",
        ),
        (
            "mixtral",
            dict(tensor_parallel_size=2, all2all_backend="all_to_all"),
            "--all2all-backend all_to_all needs --enable-expert-parallel",
        ),
        (
            "gemma2",
            dict(speculative_method="early_exit", num_speculative_tokens=2, speculative_draft_layers=1),
            "speculative method early_exit does not apply to gemma2 models",
        ),
        (
            "gemma2",
            dict(sliding_window=8),
            "--sliding-window does not combine with gemma2's per-layer windows",
        ),
    ],
)
def test_features_a_family_lacks_are_one_line_errors(family_dirs, family, engine_args, expected):
    path = family_dirs[family]
    args = EngineArgs(model=path, **engine_args)
    message = _one_line_error(ValueError, args.create_config, load_arch_config(path), path)
    assert expected in message


def test_soft_capped_models_refuse_the_compiled_attention_kernel():
    message = _one_line_error(
        ValueError, select_attention_backend, "cpu_paged", torch.device("cpu"), reference_only=True
    )
    assert "cannot soft-cap" in message
    assert select_attention_backend("auto", torch.device("cpu"), reference_only=True).name == "torch"


def test_bounded_sliding_kv_refuses_what_it_cannot_combine_with(family_dirs):
    """KV events and a draft model's pool (both keyed by one block table) are one-line errors with
    Gemma's per-layer KV groups; --disable-hybrid-kv-cache-manager keeps full KV and allows them."""
    path = family_dirs["gemma2"]
    arch = load_arch_config(path)
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5599"})
    args = EngineArgs(model=path, max_model_len=64, kv_events_config=events)
    message = _one_line_error(ValueError, args.create_config, arch, path)
    assert "--kv-events-config does not combine with gemma2's bounded sliding-window KV" in message
    message = _one_line_error(
        ValueError, EngineArgs(model=path, max_model_len=64).create_config, arch, path, arch
    )
    assert "a draft model (speculative_method draft) does not combine" in message
    assert "--disable-hybrid-kv-cache-manager" in message
    full = EngineArgs(
        model=path, max_model_len=64, kv_events_config=events, disable_hybrid_kv_cache_manager=True
    )
    assert full.create_config(arch, path).cache.kv_groups == ()
    within_window = EngineArgs(model=path, max_model_len=16)  # no sequence outgrows the window of 16
    assert within_window.create_config(arch, path).cache.kv_groups == ()
    assert len(EngineArgs(model=path, max_model_len=64).create_config(arch, path).cache.kv_groups) == 3
