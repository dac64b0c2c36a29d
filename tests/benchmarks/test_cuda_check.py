"""The device check (benchmarks/tools/cuda_check.py) runs every section's code on tiny shapes
on the CPU, so the one run on a lent GPU does not fail on plumbing; its arithmetic (FLOPs, floors,
targets) and its reading of pytest's output are checked on stated numbers."""

from __future__ import annotations

import json

import pytest

from benchmarks.tools import cuda_check
from llmserve.config import ModelArchConfig


def test_smoke_runs_every_section_on_the_cpu(tmp_path):
    assert cuda_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "cuda_check.json").read_text())
    assert results["env"]["ceilings"] == "skipped: no CUDA device"
    assert results["tests"]["status"] == "skipped: no CUDA device"
    greedy = results["greedy"]
    assert greedy["status"] == "ok" and greedy["equal"] == greedy["prompts"] == 2 + 2 * 2, greedy
    lora = results["lora"]  # on the CPU: the compiled LoRA kernel, against the merged weights
    assert lora["status"] == "ok" and lora["equal"] == lora["prompts"] == 2 * 2, lora
    assert lora["adapter_changes_tokens"] != "0/2 prompts", lora  # the comparison can tell
    speed = results["speed"]
    assert speed["status"] == "ok", speed
    assert speed["vocab_size"] > cuda_check.TOKENIZER_VOCAB  # ids past the tokenizer's decode
    assert [(row["batch"], row["context"]) for row in speed["decode"]] == [(1, 16), (1, 48), (4, 16), (4, 48)]
    assert all(row["step_ms"] > 0 and row["bytes_per_step"] > 0 for row in speed["decode"])
    assert speed["prefill"]["tokens"] == 4 * 32
    assert speed["counts"]["aten_ops"] > 0
    quantized = results["quantized"]  # on the CPU: the compiled kernels, against their float weights
    assert quantized["status"] == "ok" and quantized["prompts"] == 2 and quantized["kernels"], quantized
    assert [(row["batch"], row["context"]) for row in quantized["decode"]] == [(1, 16), (4, 16)]
    # tied: the int8 head's codes, the layers' codes; not the float table whose rows it looks up
    assert quantized["decode"][0]["bytes_per_step"] < speed["decode"][0]["bytes_per_step"]
    checks = [row["check"] for row in results["summary"]]
    assert "greedy = transformers (fp32)" in checks and "host syncs per decode step" in checks
    assert "LoRA greedy = merged weights (fp32)" in checks
    assert "int4 greedy = its float weights (fp32)" in checks


def test_pytest_lines_are_counted_with_and_without_xdist():
    log = "\n".join(
        [
            "tests/kernels/test_triton_elementwise.py::test_rms[dtype0-1-576] PASSED  [  1%]",
            "tests/kernels/test_triton_elementwise.py::test_rms[torch.bfloat16-5-960] FAILED  [  2%]",
            "[gw1] [ 50%] PASSED tests/attention/test_triton_paged_attention.py::test_decode[bfloat16-64]",
            "[gw0] [ 75%] ERROR tests/attention/test_triton_paged_attention.py::test_prefill[float16]",
            "[gw0] [100%] SKIPPED tests/attention/test_triton_paged_attention.py::test_fp8",
            "FAILED tests/kernels/test_triton_elementwise.py::test_rms[torch.bfloat16-5-960] - assert",
            "==== 2 passed, 1 failed, 1 error, 1 skipped in 3.2s ====",
        ]
    )
    counts = cuda_check.count_test_results(log)
    assert (counts["passed"], counts["failed"], counts["error"], counts["skipped"]) == (2, 1, 1, 1)
    assert (counts["bf16_passed"], counts["bf16_failed"]) == (1, 1)
    assert counts["failed_ids"] == [
        "tests/kernels/test_triton_elementwise.py::test_rms[torch.bfloat16-5-960]",
        "tests/attention/test_triton_paged_attention.py::test_prefill[float16]",
    ]


def test_prefill_flops_of_llama_3_2_1b():
    arch = ModelArchConfig(architecture="llama", rms_norm_eps=1e-5, **cuda_check.LLAMA_3_2_1B)
    linear_weights = 973_078_528  # 16 layers of q, k, v, o, gate, up, down (no embedding, no norms)
    attention = 16 * 2 * 2048 * 2048 * 2049
    logits = 2 * 2048 * 128256
    assert cuda_check.prefill_flops(arch, 2048) == 2 * linear_weights * 2048 + attention + logits


def _results(step_ms_b1: float, step_ms_b128: float, prefill_flop_s: float, syncs: float) -> dict:
    gb = 10**9
    return {
        "env": {"copy_gb_s": 4000.0, "matmul_tflop_s": 800.0},
        "tests": {"passed": 10, "failed": 0, "error": 0, "bf16_passed": 4, "bf16_failed": 0, "returncode": 0},
        "greedy": {"prompts": 8, "equal": 8},
        "speed": {
            "engine": {"device": "cuda:0"},
            "decode": [
                {"batch": 1, "context": 1024, "step_ms": step_ms_b1, "bytes_per_step": 2.5 * gb},
                {"batch": 128, "context": 4096, "step_ms": step_ms_b128, "bytes_per_step": 20 * gb},
            ],
            "prefill": {"prompt_len": 2048, "tokens_per_s": 1e5, "flop_per_s": prefill_flop_s},
            "counts": {"batch": 32, "kernel": 300.0, "host_launches": 2.0, "sync_warnings_per_step": syncs},
            "startup": {"first_token_s": 20.0},
            "eager": {"startup": {"first_token_s": 15.0}},
        },
    }


@pytest.mark.parametrize(
    ("args", "verdicts"),
    [
        # b1: floor 0.625 ms; b128: floor 5 ms; prefill against 800 TFLOP/s
        ((1.25, 8.0, 400e12, 1.0), [True, True, True, True, True, True]),
        ((1.26, 8.5, 399e12, 2.0), [True, True, False, False, False, False]),
    ],
)
def test_the_summary_judges_each_target_against_the_measured_floors(args, verdicts):
    rows = {row["check"]: row for row in cuda_check.summary_rows(_results(*args))}
    judged = [
        rows["kernel tests (CUDA)"]["ok"],
        rows["greedy = transformers (fp32)"]["ok"],
        rows["decode b1 ctx1024 ms/step"]["ok"],
        rows["decode b128 ctx4096 ms/step"]["ok"],
        rows["  prefill TFLOP/s (ratio: of the matmul's)"]["ok"],
        rows["host syncs per decode step"]["ok"],
    ]
    assert judged == verdicts
    assert rows["decode b1 ctx1024 ms/step"]["floor"] == pytest.approx(0.625)
    assert rows["  graphs' start-up over eager s"]["measured"] == pytest.approx(5.0)
    assert "PASS" in cuda_check.format_table(list(rows.values()))


@pytest.mark.process
def test_the_kernel_tests_run_compiled_on_the_tests_device(tmp_path, monkeypatch):
    """The pytest child sees LLMSERVE_TEST_DEVICE=cuda and no TRITON_INTERPRET (the Triton test files
    interpret only without that device), and its outcomes are read back from its log."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    test_file = tmp_path / "test_device_env.py"
    test_file.write_text(
        "import os\n"
        "def test_device():\n"
        "    assert os.environ['LLMSERVE_TEST_DEVICE'] == 'cuda'\n"
        "    assert 'TRITON_INTERPRET' not in os.environ\n"
        "def test_bfloat16_fails():\n"
        "    assert False\n"
    )
    log = tmp_path / "tests.log"
    assert cuda_check.run_pytest([str(test_file)], log, timeout=120) == 1
    counts = cuda_check.count_test_results(log.read_text())
    assert (counts["passed"], counts["failed"], counts["bf16_failed"]) == (1, 1, 1)
