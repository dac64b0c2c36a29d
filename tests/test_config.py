"""llmserve/config: each config validates its own fields, modes are `Literal`s whose values the
implementations agree with, and the package imports no implementation module. No model needed."""

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import torch

import llmserve.config as config_package
from llmserve.config import (
    AttentionBackendName,
    CacheConfig,
    EngineArgs,
    ModelConfig,
    SchedulerConfig,
    cpu_isa,
)
from llmserve.config.cpu_isa import selected_level
from llmserve.config.kv_cache_dtype import KV_CACHE_DTYPES, kv_row_bytes
from llmserve.config.quantization import GGUF_BLOCK_TYPES, int_kernels_take
from llmserve.config.speculative import DEFAULT_MAX_VERIFY_ROWS

CONFIG_DIR = Path(config_package.__file__).parent
# a request's sampling options: a data type the speculative config reads (under TYPE_CHECKING)
ALLOWED_OUTSIDE = {"llmserve.sampling_params"}


@pytest.fixture(scope="module")
def smollm2_arch():
    from llmserve.model_loader import default_model_path, load_arch_config

    return load_arch_config(default_model_path())


def _llmserve_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmserve"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("llmserve"))
    return found


def test_config_imports_no_implementation_module():
    outside = {
        f"{path.name}: {name}"
        for path in CONFIG_DIR.glob("*.py")
        for name in _llmserve_imports(path)
        if not name.startswith("llmserve.config") and name not in ALLOWED_OUTSIDE
    }
    assert not outside


def test_the_verify_row_limit_is_the_small_batch_kernels():
    from llmserve.kernels.small_batch_linear import MAX_ROWS

    assert DEFAULT_MAX_VERIFY_ROWS == MAX_ROWS


@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pools_row_bytes_are_the_formats_layout(kv_dtype, dtype):
    from llmserve.attention.kv_format import KV_CACHE_FORMATS

    assert tuple(KV_CACHE_FORMATS) == KV_CACHE_DTYPES
    fmt = KV_CACHE_FORMATS[kv_dtype]
    rows = torch.randn(32, 2, 64, dtype=dtype)  # a block of 32 tokens' rows
    if fmt.is_low_bit:  # keys per block, values per row: rows of one size
        stored = [fmt.quantize_key_blocks(rows), fmt.quantize_values(rows)]
    else:
        stored = [fmt.quantize(rows) if fmt.is_quantized else rows]
    for part in stored:
        assert part.shape[-1] * part.element_size() == kv_row_bytes(kv_dtype, 64, dtype)


def test_the_attention_backend_names_are_the_registrys():
    from llmserve.attention.registry import _BACKENDS

    assert set(typing.get_args(AttentionBackendName)) == {"auto", *_BACKENDS}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 24}, "block_size must be a power of two, got 24"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"max_model_len": 0}, "max_model_len must be >= 1"),
        ({"dtype": "float64"}, "dtype must be one of auto, float32, bfloat16, float16; got 'float64'"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype must be one of auto, int8, fp8, int4, int2"),
        ({"sliding_window": 0}, "sliding_window must be >= 1"),
        ({"attention_sinks": -1}, "attention_sinks must be >= 0"),
        ({"ttft_target_ms": -1.0}, "ttft_target_ms and tpot_target_ms must be >= 0"),
    ],
)
def test_engine_args_refuse_a_bad_option_when_made(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority; got 'lifo'"),
        ({"preemption_mode": "drop"}, "preemption_mode must be one of recompute, swap, auto"),
        ({"priority_aging_seconds": 0.0}, "priority_aging_seconds must be > 0"),
        ({"max_num_seqs": 0}, "max_num_batched_tokens and max_num_seqs must be >= 1"),
        ({"tpot_target_ms": float("inf")}, "ttft_target_ms and tpot_target_ms"),
    ],
)
def test_scheduler_config_validates_its_fields(options, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 4, "max_model_len": 128, **options})


def test_cache_and_model_configs_validate_their_fields(smollm2_arch):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        CacheConfig(block_size=12, num_blocks=4, kv_cache_memory=1)
    with pytest.raises(ValueError, match="at least one block"):
        CacheConfig(block_size=16, num_blocks=0, kv_cache_memory=0)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(block_size=16, num_blocks=4, kv_cache_memory=1, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch"):
        ModelConfig("m", smollm2_arch, torch.float32, 128, attention_backend="flash")
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        ModelConfig("m", smollm2_arch, torch.float32, 0)


def test_a_mode_flag_outside_its_choices_is_a_usage_error(capsys):
    from llmserve.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "x", "--scheduling-policy", "lifo"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'lifo'" in capsys.readouterr().err


def test_create_config_resolves_and_keeps_the_checks_that_need_the_model(smollm2_arch):
    args = EngineArgs(device="cpu", dtype="float32", enable_chunked_prefill=False, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match=r"without chunked prefill, max_num_batched_tokens \(512\)"):
        args.create_config(smollm2_arch, "m")
    config = EngineArgs(
        device="cpu", dtype="float32", ttft_target_ms=0, scheduling_policy="priority"
    ).create_config(smollm2_arch, "m")
    assert config.scheduler.ttft_target_ms is None and config.scheduler.scheduling_policy == "priority"
    assert config.cache.block_size == 32
    assert config.model.max_model_len == min(smollm2_arch.max_position_embeddings, 4096)


def test_speculation_by_default_stays_on_at_any_batch_over_the_int_kernels(smollm2_arch):
    """--speculative-disable-batch-size unset: 0 for a proposer that runs no model over layers on the
    CPU's int8/int4 kernels (the default model's blocks), 4 for the others and for float layers; given,
    kept."""

    def limit(**args) -> int:
        return (
            EngineArgs(device="cpu", **args).create_config(smollm2_arch, "m").speculative.disable_batch_size
        )

    for method in ("ngram", "suffix", "draft_head"):
        assert limit(speculative_method=method) == 0
        assert limit(speculative_method=method, quantization="none") == 4
        assert limit(speculative_method=method, speculative_disable_batch_size=2) == 2
    assert limit(speculative_method="early_exit") == 4  # it runs most of the target's layers per draft
    assert limit(speculative_method="eagle") == 4


def test_a_gguf_files_blocks_are_the_cpus_default_and_none_opts_out(smollm2_arch, monkeypatch):
    from llmserve.quantization.gguf_native import SUPPORTED_TYPES

    assert set(SUPPORTED_TYPES) == set(GGUF_BLOCK_TYPES)  # what the loader reads is the default
    assert "Q4_1" in smollm2_arch.gguf_tensor_types  # the embedded default model
    assert EngineArgs(device="cpu").create_config(smollm2_arch, "m").model.quantization.method == "gguf"
    for value in ("none", "int4"):
        chosen = (
            EngineArgs(device="cpu", quantization=value).create_config(smollm2_arch, "m").model.quantization
        )
        assert (chosen and chosen.method) == (None if value == "none" else value)
    floats = dataclasses.replace(smollm2_arch, gguf_tensor_types=("F16", "F32"))  # nothing kept in blocks
    assert EngineArgs(device="cpu").create_config(floats, "m").model.quantization is None
    float32 = EngineArgs(device="cpu", dtype="float32").create_config(smollm2_arch, "m").model.quantization
    level = selected_level().name  # float32 inputs run the int kernels below AVX-512 BF16 only
    assert (float32 and float32.method) == ("gguf" if int_kernels_take(torch.float32, level) else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no int4/int8 kernel there: float
    assert EngineArgs(device="cuda").create_config(smollm2_arch, "m").model.quantization is None


def test_the_gguf_default_falls_back_to_float_where_gguf_does_not_combine(smollm2_arch, caplog):
    phi3 = dataclasses.replace(smollm2_arch, architecture="phi3")
    with caplog.at_level("INFO", logger="llmserve"):
        assert EngineArgs(device="cpu").create_config(phi3, "m").model.quantization is None
    assert "served dequantized to float: quantization gguf does not apply to phi3" in caplog.text
    with pytest.raises(ValueError, match="quantization gguf does not apply to phi3"):  # asked for: refused
        EngineArgs(device="cpu", quantization="gguf").create_config(phi3, "m")
    # 2 ranks of SmolLM2's 9 query heads: o_proj inputs of 384 + 192 columns, whole blocks of 32
    assert (
        EngineArgs(device="cpu", tensor_parallel_size=2).create_config(smollm2_arch, "m").model.quantization
    )
    uneven = dataclasses.replace(smollm2_arch, intermediate_size=1552)  # 776 + 776 MLP units a rank
    with caplog.at_level("INFO", logger="llmserve"):
        config = EngineArgs(device="cpu", tensor_parallel_size=2).create_config(uneven, "m")
    assert config.model.quantization is None and "input widths (384, 192, 776, 776) cut" in caplog.text
    gemma = dataclasses.replace(smollm2_arch, architecture="gemma2")  # no quantization there: not even "none"
    assert EngineArgs(device="cpu", quantization="none").create_config(gemma, "m").model.quantization is None


def test_auto_dtype_is_bf16_unless_a_path_runs_torchs_bf16_on_this_cpu(smollm2_arch, monkeypatch, caplog):
    """On a CPU without native bf16 `auto` is bf16 where the compiled kernels take every hot path, float32
    (saying why) where a model or option would run PyTorch's bf16 arithmetic; with native bf16 always bf16."""
    import llmserve.config as config

    def auto(arch=smollm2_arch, **flags) -> torch.dtype:
        return EngineArgs(device="cpu", **flags).create_config(arch, "m").model.dtype

    avx2 = cpu_isa.LEVELS[0]  # a level with compiled kernels, whatever this CPU is
    monkeypatch.setattr(config, "selected_level", lambda: avx2)
    for native in (True, False):
        monkeypatch.setattr(config, "cpu_has_native_bf16", lambda native=native: native)
        assert auto() == torch.bfloat16  # the default model: dense, head_dim 64, plain cache
        assert auto(enable_lora=True) == torch.bfloat16  # the compiled LoRA delta takes bf16
        assert (
            EngineArgs(device="cpu", dtype="float32").create_config(smollm2_arch, "m").model.dtype
            == torch.float32
        )
    moe = dataclasses.replace(smollm2_arch, num_experts=4, num_experts_per_tok=2)
    cases = [
        (moe, {}, "the mixture-of-experts layers multiply in PyTorch"),
        (smollm2_arch, {"kv_cache_dtype": "int8"}, "SDPA over an int8 KV cache"),
        (smollm2_arch, {"sliding_window": 64}, "with a sliding window or score softcapping"),
        # widths the int kernels cannot group: served float (the GGUF's blocks refuse them)
        (dataclasses.replace(smollm2_arch, head_dim=80), {"quantization": "none"}, "at head_dim 80"),
        (smollm2_arch, {"quantization": "gptq"}, "quantization gptq calibrates the float model"),
        (smollm2_arch, {"enable_lora": True, "max_lora_rank": 171}, "wider than the compiled delta takes"),
        (
            smollm2_arch,
            {"speculative_method": "draft", "speculative_draft_model": "d"},
            "speculative method draft",
        ),
        (smollm2_arch, {"attention_backend": "torch"}, "the torch attention backend"),
        (
            dataclasses.replace(smollm2_arch, intermediate_size=1552),
            {"quantization": "none"},
            "[576, 1552] not all multiples of 32",
        ),
    ]
    for arch, flags, why in cases:
        caplog.clear()
        with caplog.at_level("INFO", logger="llmserve"):
            assert auto(arch, **flags) == torch.float32
        assert "dtype auto is float32 on this CPU" in caplog.text and why in caplog.text
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    assert auto(moe, enable_lora=True) == torch.bfloat16  # native bf16 matmuls: nothing to avoid
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(config, "selected_level", lambda: None)  # no compiled kernels here
    assert auto() == torch.float32

    def forced_level_this_cpu_lacks():
        raise ValueError("LLMSERVE_CPU_ISA=amx names a level this CPU lacks")

    monkeypatch.setattr(config, "selected_level", forced_level_this_cpu_lacks)
    with caplog.at_level("INFO", logger="llmserve"):  # float; the kernels' loader then refuses the level
        assert auto(quantization="none") == torch.float32
    assert "names a level this CPU lacks" in caplog.text
