"""Smoke tests of benchmarks/tools: each tool's measurement runs on something tiny; no timing
is asserted, only that the figures are there and the plumbing (worktrees, steps, health checks) works."""

from __future__ import annotations

import argparse
import http.server
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from benchmarks.tools import (
    ab_checkouts,
    decode_attention_micro,
    dp_prefix_hits,
    elementwise_micro,
    k_quant_gguf,
    linear_micro,
    prefill_attention_micro,
    side_by_side,
    step_split,
)
from llmserve.benchmarks import results
from llmserve.benchmarks.workload import WorkloadSpec, build_workload

SPEC = WorkloadSpec(num_requests=5, seed=0, prompt_len_median=12, output_len_median=4,
                    prompt_len_range=(6, 24), output_len_range=(2, 6))  # fmt: skip


# -- ab_checkouts -----------------------------------------------------------------------------------


def test_ab_measure_runs_on_a_tiny_model(tiny_model_dir):
    from llmserve import LLM

    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory="16MiB", block_size=4)  # prompts fill blocks
    requests = build_workload(SPEC, llm.tokenizer)
    result = ab_checkouts.measure(
        llm, requests, passes=2, decode_prompt_tokens=4, decode_tokens=5, decode_repeats=2
    )
    assert len(result["passes"]) == 2 and result["tok_s"] == pytest.approx(max(result["passes"]), abs=0.1)
    assert result["cached_prompt_tokens"] == 0  # every pass computes its prompts
    assert len(result["b1_all"]) == 2 and result["b1_ms"] > 0


def test_ab_rounds_alternate_and_summarize_per_side():
    assert ab_checkouts.round_orders(3) == [("base", "new"), ("new", "base"), ("base", "new")]
    runs = [
        {"tag": "base", "tok_s": 100.0, "b1_ms": 10.0},
        {"tag": "new", "tok_s": 90.0, "b1_ms": 9.0},
        {"tag": "new", "tok_s": 110.0, "b1_ms": 8.0},
        {"tag": "base", "tok_s": 80.0, "b1_ms": 12.0},
        {"tag": "base", "tok_s": 120.0, "b1_ms": 11.0},
        {"tag": "new", "tok_s": 105.0, "b1_ms": 7.0},
    ]
    summary = ab_checkouts.summarize(runs)
    assert summary["base"] == {"runs": 3, "tok_s": 100.0, "b1_ms": 11.0}
    assert summary["new"] == {"runs": 3, "tok_s": 105.0, "b1_ms": 8.0}
    assert summary["new_vs_base"]["tok_s"] == pytest.approx(0.05)


def _git(*args: str, cwd: Path) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_ab_checkout_is_a_worktree_added_once(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    (repo / "file.txt").write_text("one\n")
    _git("add", "file.txt", cwd=repo)
    _git("commit", "-q", "-m", "one", cwd=repo)
    commit = _git("rev-parse", "HEAD", cwd=repo)
    path, resolved = ab_checkouts.ensure_checkout(repo, "HEAD", tmp_path / "worktrees")
    assert resolved == commit and (path / "file.txt").read_text() == "one\n"
    assert ab_checkouts.ensure_checkout(repo, commit[:7], tmp_path / "worktrees") == (path, commit)
    assert ab_checkouts.ensure_checkout(repo, str(repo), tmp_path / "worktrees") == (repo.resolve(), commit)
    (repo / "file.txt").write_text("two\n")
    assert ab_checkouts.ensure_checkout(repo, str(repo), tmp_path / "worktrees")[1] == commit + "-dirty"


def test_ab_child_imports_the_checkout_it_measures():
    argv, env = ab_checkouts.child_command(Path("/checkouts/base"), "base", Path("/w.jsonl"), 3)
    assert env["PYTHONPATH"] == "/checkouts/base"
    assert Path(argv[1]).name == "ab_checkouts.py" and argv[2:4] == ["--measure", "/w.jsonl"]


# -- side_by_side -----------------------------------------------------------------------------------


def test_side_by_side_times_each_system_alone_in_order(tmp_path):
    args = side_by_side.parse_args(["t1", "--results", str(tmp_path), "--peer-command", "vllm serve X"])
    steps = side_by_side.plan(args)
    assert [step.name for step in steps] == ["offline-1", "sweep", "inf1", "peer", "inf2", "offline-2"]
    assert steps[0].server is None and "--naive-batch-sizes" in steps[0].bench
    assert steps[1].bench[-1] == str(tmp_path / "serve-t1-sweep.json")
    assert steps[3].server == ["bash", "-c", "exec vllm serve X"] and steps[3].url == "http://127.0.0.1:8092"
    no_peer = side_by_side.plan(side_by_side.parse_args(["t2"]))
    assert "peer" not in [step.name for step in no_peer]
    all_at_once = side_by_side.plan(side_by_side.parse_args(["t4", "--rates", "inf", "--peer-command", "x"]))
    assert [step.name for step in all_at_once] == ["offline-1", "sweep", "peer", "inf2", "offline-2"]
    assert all(step.bench[step.bench.index("--sweep") + 1] == "inf" for step in all_at_once[1:4])
    engine = ["--engine-args", "--model m.gguf --quantization gguf", "--peer-command", "x"]
    flagged = side_by_side.plan(side_by_side.parse_args(["t5", *engine]))
    flags = ["--model", "m.gguf", "--quantization", "gguf"]
    for step in flagged:  # ours, offline and served, run the model the flags name; the peer does not
        command = step.bench if step.server is None else step.server
        assert (command[-6:-2] if step.server is None else command[-4:]) == flags or step.name == "peer"


def test_side_by_side_dry_run_prints_the_steps(capsys):
    side_by_side.main(["t3", "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[0].startswith("offline-1: ") and "[server: " in lines[1]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the handler's name is http.server's)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_side_by_side_waits_for_health():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert side_by_side.wait_for_health(url, None, timeout=10) >= 0
    finally:
        server.shutdown()
    with pytest.raises(TimeoutError):
        side_by_side.wait_for_health(url, None, timeout=0.5)


@pytest.mark.process
def test_side_by_side_records_each_servers_start_up(tmp_path, monkeypatch):
    """A server step returns its seconds to ready, and main writes them to startup-TAG.json."""
    port = _free_port()
    health = (
        "import http.server as h\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    server = side_by_side.Step("srv", ["true"], [sys.executable, "-c", health], f"http://127.0.0.1:{port}")
    offline = side_by_side.Step("off", ["true"])
    monkeypatch.setattr(side_by_side, "plan", lambda args: [offline, server])
    workload = tmp_path / "workload.jsonl"
    workload.write_text("")  # main only checks that it exists; the planned steps never read it
    side_by_side.main(
        ["t4", "--workload", str(workload), "--results", str(tmp_path / "r"), "--logs", str(tmp_path / "l")]
    )
    result = json.loads((tmp_path / "r" / "startup-t4.json").read_text())
    assert [s["step"] for s in result["servers"]] == ["srv"] and result["servers"][0]["ready_seconds"] > 0
    assert result["command"].startswith("python -m benchmarks.tools.side_by_side")
    assert result["machine"] and result["date"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- linear_micro -----------------------------------------------------------------------------------


@pytest.mark.cpu_kernels("bf16_linear")
def test_linear_micro_times_every_format_this_build_has():
    results = linear_micro.run(rows=[1, 2], num_layers=1, vocab=64, repeats=1, copy_mib=1)
    assert {result["format"] for result in results} >= {"bf16"}
    assert all(result["ms"] > 0 and result["GB/s"] > 0 for result in results)


@pytest.mark.cpu_kernels("amx_bf16")
def test_linear_micro_compares_amx_with_the_kernels_before_it():
    results = linear_micro.compare_amx(rows=[9, 40], vocab=64, repeats=1)
    assert [(r["layer"], r["rows"]) for r in results][:2] == [("qkv", 9), ("qkv", 40)] and len(results) == 10
    assert {r["before"] for r in results} == {"oneDNN", "small-batch"}
    assert all(r["before_us"] > 0 and r["amx_us"] > 0 and r["amx_GFLOPs"] > 0 for r in results)


@pytest.mark.cpu_kernels("bf16_linear")
def test_linear_micro_compares_onednn_with_the_tiled_kernel():
    results = linear_micro.compare_tiled(rows=[9, 40], repeats=1)
    assert [r["rows"] for r in results] == [9, 40]
    assert all(len(r["onednn_us"]) == len(r["kernel_us"]) == 4 for r in results)
    assert all(min(r["onednn_us"] + r["kernel_us"]) > 0 for r in results)


@pytest.mark.cpu_kernels("bf16_linear")
def test_linear_micro_times_the_logits_and_a_layer_in_cache_and_streamed():
    logits = linear_micro.compare_logits(rows=[2, 9], vocab=4096, repeats=1)
    assert [(r["case"], r["rows"]) for r in logits][:3] == [
        ("lm_head float32", 2),
        ("lm_head bf16", 2),
        ("gate_up bf16", 2),
    ]
    assert len(logits) == 6 and all(r["us"] > 0 and r["TFLOP/s"] > 0 for r in logits)
    streamed = linear_micro.compare_streamed(rows=[9], num_layers=2, repeats=1)
    assert [r["rows"] for r in streamed] == [9]
    assert streamed[0]["cached_us"] > 0 and streamed[0]["streamed_us"] > 0


@pytest.mark.cpu_kernels
def test_elementwise_micro_times_swiglu_and_rms_norm():
    results = elementwise_micro.run(rows=[1, 3], repeats=1)
    assert [r["rows"] for r in results] == [1, 3]
    assert all(r["swiglu_us"] > 0 and r["rms_norm_us"] > 0 for r in results)


# -- prefill_attention_micro ------------------------------------------------------------------------


@pytest.mark.cpu_kernels("avx2")
def test_prefill_attention_micro_times_each_kernel_this_cpu_has():
    (row,) = prefill_attention_micro.run([40], repeats=1)
    path = prefill_attention_micro.load_cpu_ops().prefill_attention_path(torch.bfloat16)
    assert path in ("amx", "avx512_bf16", "fma")
    kernel = "avx512_bf16" if path == "amx" else path
    assert row["tokens"] == 40 and row[f"{kernel}_ms"] > 0 and row["torch_sdpa_ms"] > 0
    if "amx_ms" in row:  # the two kernels agree within bf16 rounding of the output
        assert row["amx_ms"] > 0 and row["max_abs_diff"] < 0.05


# -- decode_attention_micro -------------------------------------------------------------------------


@pytest.mark.cpu_kernels
def test_decode_attention_micro_times_the_kernel_from_memory_and_from_cache():
    (row,) = decode_attention_micro.run([(3, 40)], layers=2, repeats=1)
    assert (row["sequences"], row["context"]) == (3, 40)
    assert row["memory_ms"] > 0 and row["cached_ms"] > 0
    # the bytes per second are the K and V rows read: 2 layers x K and V x 120 tokens x 3 heads x 64 x 2 B
    assert row["memory_gbs"] == pytest.approx(2 * 2 * 120 * 3 * 64 * 2 / (row["memory_ms"] / 1e3) / 1e9)
    assert decode_attention_micro.parse_batches("96x270,8x1000") == [(96, 270), (8, 1000)]
    with pytest.raises(argparse.ArgumentTypeError, match="'9x' is not SEQUENCESxCONTEXT"):
        decode_attention_micro.parse_batches("96x270,9x")


# -- step_split -------------------------------------------------------------------------------------


def test_step_split_runs_a_workload_at_once_and_splits_its_decode_steps(tiny_model_dir):
    from llmserve.config import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(model=tiny_model_dir, dtype="float32", kv_cache_memory="16MiB", prefix_caching=False)
    )
    requests = build_workload(SPEC, engine.tokenizer)
    phases = {}
    seconds, steps = step_split.run(engine, requests, phases)
    assert seconds > 0 and not engine.has_unfinished_requests()
    assert set(phases) == set(step_split.step_phases(engine)) and 0 < sum(phases.values()) < seconds
    assert phases["forward"] > 0 and "schedule" not in vars(engine.scheduler)  # the wrappers are gone
    # every prompt token and every output token after the first is in some step
    assert sum(step[1] for step in steps) == sum(r.prompt_len for r in requests)
    assert sum(step[0] for step in steps) == sum(r.max_tokens - 1 for r in requests)
    result = step_split.split(steps)
    assert result["decode_only_steps"] + result["steps_with_prompt_tokens"] == len(steps)
    assert sum(group["steps"] for group in result["by_rows"]) == result["decode_only_steps"]
    assert sum(result["decode_seconds_fixed_rows_context"]) == pytest.approx(result["decode_only_seconds"])


# -- results.git_commit ---------------------------------------------------------------------------


def test_git_commit_is_read_in_a_checkout_and_in_a_linked_worktree(tmp_path):
    """Result files name their commit also when the benchmark runs from `git worktree add` (as
    ab_checkouts does): there ".git" is a file naming the worktree's git dir."""
    repo = tmp_path / "repo"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    subprocess.run([*git, "pack-refs", "--all"], check=True)  # the branch only in packed-refs
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    subprocess.run([*git, "worktree", "add", "-q", "-b", "side", str(tmp_path / "wt")], check=True)
    subprocess.run([*git, "worktree", "add", "-q", "--detach", str(tmp_path / "detached")], check=True)
    (tmp_path / "wt" / "sub").mkdir()
    assert results.git_commit(repo) == head
    assert results.git_commit(tmp_path / "wt" / "sub") == head
    assert results.git_commit(tmp_path / "detached") == head
    assert results.git_commit(tmp_path) is None  # no checkout above it


def test_a_result_names_the_commit_of_the_code_that_ran_wherever_it_was_started(tmp_path, monkeypatch):
    checkout = Path(results.__file__).resolve().parents[2]  # the suite runs from a checkout
    head = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    monkeypatch.chdir(tmp_path)  # outside any checkout, as a benchmark started from /tmp is
    assert results.git_commit() == head and results.run_metadata("serve")["git_commit"] == head


# -- dp_prefix_hits ---------------------------------------------------------------------------------


def test_dp_prefix_hits_runs_one_engine_then_the_router_and_compares_their_hit_rates(tmp_path, monkeypatch):
    """Each step's server and bench commands; the bench results stand in for the real runs."""
    steps = []

    def fake_run_step(step, logs, tag, health_timeout):
        steps.append(step)
        hits = 600.0 if len(steps) == 1 else 570.0
        cache = {"queries": 1000.0, "hits": hits, "hit_rate": hits / 1000, "by_replica": {}}
        run = {"num_requests": 5, "num_ok": 5, "duration": 1.0, "total_token_throughput": 1.0,
               "output_throughput": 1.0, "prefix_cache": cache}  # fmt: skip
        output = Path(step.bench[step.bench.index("--output") + 1])
        output.write_text(json.dumps({"url": step.url, "runs": [run]}))

    monkeypatch.setattr(dp_prefix_hits, "run_step", fake_run_step)
    workload = tmp_path / "w.jsonl"
    workload.write_text("")  # exists: not written again
    out = tmp_path / "result.json"
    dp_prefix_hits.main(
        ["--out", str(out), "--workload", str(workload), "--port", "8123", "--logs", str(tmp_path)]
    )
    one, dp = steps
    assert "--data-parallel-size" not in one.server and dp.server[-2:] == ["--data-parallel-size", "2"]
    assert one.url == dp.url == "http://127.0.0.1:8123" and "--workload" in one.bench
    result = json.loads(out.read_text())
    assert list(result["runs"]) == ["one-engine", "dp2"] and result["hit_rate_ratio"] == pytest.approx(0.95)
    assert result["command"].startswith("python -m benchmarks.tools.dp_prefix_hits --out")
    assert result["machine"] and result["git_commit"] is not None


def test_k_quant_gguf_types_its_tensors_as_a_q4_k_m_and_serves_in_its_blocks(tmp_path, monkeypatch):
    """The tool's file: Q6_K output, Q4_K embedding and projections, Q6_K v and down in the layers where
    `use_more_bits` holds; served by default in its blocks (every layer a quantized one)."""
    import gguf

    from llmserve import LLM, SamplingParams
    from llmserve.quantization.kernels import QuantizedLinear

    path = str(tmp_path / "q4_k_m.gguf")
    args = ["--layers", "8", "--hidden", "256", "--intermediate", "512", "--heads", "4", "--kv-heads", "2"]
    k_quant_gguf.write(path, k_quant_gguf.build_parser().parse_args([path, *args, "--vocab", "300"]))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert (types["output.weight"], types["token_embd.weight"], types["blk.3.attn_q.weight"]) == (
        "Q6_K",
        "Q4_K",
        "Q4_K",
    )
    more = [layer for layer in range(8) if types[f"blk.{layer}.ffn_down.weight"] == "Q6_K"]
    assert more == [0, 3, 6, 7] and more == [k for k in range(8) if types[f"blk.{k}.attn_v.weight"] == "Q6_K"]
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(path, dtype="bfloat16", quantization="gguf", max_model_len=64, kv_cache_memory="4MiB")
    model = llm.engine.model_runner.model
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == 8 * 4 + 2  # qkv, o, gate_up, down
    out = llm.generate(
        [{"prompt_token_ids": [1, 5, 9]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 3
    llm.shutdown()
