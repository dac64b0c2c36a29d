"""`llmserve bench ...` end to end on a tiny random Llama with tiny settings: files written, keys present."""

import json

import pytest

from llmserve.cli.main import main

WORKLOAD = ["--num-requests", "4", "--prompt-len-median", "10", "--output-len-median", "4",
            "--prompt-len-range", "2,30", "--output-len-range", "1,8"]  # fmt: skip


@pytest.fixture
def engine_flags(tiny_model_dir) -> list[str]:
    return ["--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-memory", "8MiB"]


def run(argv: list[str], tmp_path, name: str) -> dict:
    output, plot = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    assert main([*argv, "--output", str(output), "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 0
    result = json.loads(output.read_text())
    assert {"machine", "command", "date", "git_commit"} <= result.keys()
    return result


def test_bench_throughput(tmp_path, engine_flags):
    argv = ["bench", "throughput", *WORKLOAD, "--naive-batch-sizes", "2,4", *engine_flags]
    result = run(argv, tmp_path, "throughput")
    assert [r["system"] for r in result["results"]] == ["naive(B=2)", "naive(B=4)", "continuous"]
    assert all(r["matching_outputs"] == 4 for r in result["results"][:2])
    assert result["speedup_vs_best_naive"] > 0 and result["workload"]["num_requests"] == 4


def test_bench_throughput_continuous_only_in_an_engine_thread(tmp_path, engine_flags):
    argv = ["bench", "throughput", *WORKLOAD, "--naive-batch-sizes", "none", "--engine-thread", *engine_flags]
    result = run(argv, tmp_path, "throughput-thread")
    assert [r["system"] for r in result["results"]] == ["continuous"]
    assert result["engine_thread"] is True and result["speedup_vs_best_naive"] is None
    assert result["results"][0]["output_tokens"] > 0


def test_bench_latency(tmp_path, engine_flags):
    argv = ["bench", "latency", "--prompt-lengths", "4,8", "--decode-tokens", "2", "--repeats", "1",
            "--copy-mib", "1", "--matmul-size", "32", *engine_flags]  # fmt: skip
    result = run(argv, tmp_path, "latency")
    assert [p["prompt_len"] for p in result["points"]] == [4, 8]
    assert result["bounds"]["floor_ms_per_token"] > 0
    assert result["engine_args"]["prefix_caching"] is False


def test_bench_memory_with_live_engine(tmp_path, engine_flags):
    flags = [*engine_flags[:-2], "--kv-cache-memory", "256KiB", "--block-size", "4"]
    result = run(["bench", "memory", *WORKLOAD, "--live", *flags], tmp_path, "memory")
    paged, at_max_len, at_workload_max = result["allocations"]
    assert (
        paged["strategy"] == "paged"
        and paged["concurrent_sequences"] >= at_workload_max["concurrent_sequences"]
    )
    assert at_workload_max["concurrent_sequences"] >= at_max_len["concurrent_sequences"]
    assert result["live"]["max_running"] >= 1


def test_bench_workload_file_replays_into_another_benchmark(tmp_path, tiny_model_dir, engine_flags):
    path = tmp_path / "w.jsonl"
    assert main(["bench", "workload", "--out", str(path), "--tokenizer", tiny_model_dir, *WORKLOAD]) == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 4 and all(
        line.keys() == {"prompt", "prompt_token_ids", "max_tokens"} for line in lines
    )
    result = run(["bench", "memory", "--workload", str(path), *engine_flags], tmp_path, "memory")
    assert result["workload"]["output_tokens"] == sum(line["max_tokens"] for line in lines)


def test_bad_flags_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--naive-batch-sizes", "a,b"])
    assert exit_info.value.code == 2
