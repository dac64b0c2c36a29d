"""The kernels' instruction-set level: the CPU's best, a lower one when forced, never one it lacks."""

import pytest

from llmserve.config import cpu_isa
from llmserve.config.cpu_isa import LEVELS, best_level, resolve_level

ZEN3 = frozenset(["avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "sse4_2"])
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512cd", "avx512vl"}
ZEN5 = SKYLAKE_X | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}
SAPPHIRE_RAPIDS = ZEN5 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    ("flags", "level"),
    [(ZEN3, "avx2"), (SKYLAKE_X, "avx512"), (ZEN5, "avx512_bf16"), (SAPPHIRE_RAPIDS, "amx")],
)
def test_the_best_level_the_cpu_reports_is_taken(flags, level):
    assert best_level(flags).name == level
    assert resolve_level(flags, None).name == level


def test_a_cpu_without_avx2_and_fma_has_no_level():
    assert best_level(frozenset({"sse4_2", "avx"})) is None
    assert best_level(ZEN3 - {"fma"}) is None


def test_a_lower_level_can_be_forced_and_a_higher_one_is_an_error():
    assert resolve_level(SAPPHIRE_RAPIDS, "avx2").name == "avx2"
    assert resolve_level(ZEN5, "avx512").name == "avx512"
    with pytest.raises(ValueError, match="LLMSERVE_CPU_ISA=amx: this CPU lacks amx_bf16, amx_int8, amx_tile"):
        resolve_level(ZEN5, "amx")
    with pytest.raises(ValueError, match="choose one of avx2, avx512, avx512_bf16, amx"):
        resolve_level(ZEN5, "avx512vnni")


def test_each_level_compiles_for_what_it_requires():
    """Every level's flags include the level below's (a kernel compiled for one runs at the next)."""
    for lower, higher in zip(LEVELS, LEVELS[1:], strict=False):
        assert lower.cpu_flags < higher.cpu_flags
    assert LEVELS[0].compiler_flags == ("-march=x86-64-v3",)
    assert "-mavx512bf16" in LEVELS[2].compiler_flags and "-mamx-tile" in LEVELS[3].compiler_flags


def test_this_process_level_follows_the_variable(monkeypatch):
    cpu_isa.selected_level.cache_clear()
    try:
        monkeypatch.setenv(cpu_isa.FORCE_VARIABLE, "avx2")
        assert cpu_isa.selected_level().name == "avx2" and cpu_isa.is_forced()
    finally:
        cpu_isa.selected_level.cache_clear()


@pytest.mark.cpu_kernels
def test_the_configs_int_kernel_dtypes_are_the_builds():
    """EngineArgs' GGUF default reads which activation dtypes the int8/int4 kernels take from the level
    (config/quantization.py); the build at this process's level (forced or not) must agree."""
    import torch

    from llmserve.config.quantization import int_kernels_take
    from llmserve.kernels.cpu_ops import load_cpu_ops

    ops, level = load_cpu_ops(), cpu_isa.selected_level()
    for dtype in (torch.bfloat16, torch.float32):
        assert int_kernels_take(dtype, level.name) == ops.small_batch_linear_int8_supported(dtype), dtype
    assert not int_kernels_take(torch.float32, "amx") and int_kernels_take(torch.float32, "avx512")
