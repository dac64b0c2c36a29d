"""`llmserve bench spec-decode` on a tiny random Llama: the accounting, not the timings."""

from __future__ import annotations

import json

import pytest

from llmserve.benchmarks.spec_decode import GROUNDED_TASKS, grounded_prompts, methods
from llmserve.benchmarks.workload import TokenCorpus
from llmserve.cli.main import main

# The tiny model has 2 layers: early_exit:2 is the target drafting for itself (accepts everything).
FLAGS = ["--dtype", "float32", "--kv-cache-memory", "8MiB", "--num-prompts", "2", "--document-len", "32",
         "--max-tokens", "8", "--batch-sizes", "1,3", "--throughput-output-len", "5",
         "--throughput-repeats", "2",
         "--methods", "ngram,early_exit", "--early-exit-layers", "1,2", "--throughput-method", "early_exit:2",
         "--speculative-disable-batch-size", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def result(tiny_model_dir, tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("spec-bench") / "spec.json"
    assert main(["bench", "spec-decode", "--model", tiny_model_dir, *FLAGS, "--output", str(output)]) == 0
    return json.loads(output.read_text())


def test_latency_rows_cover_every_method_and_workload_with_the_same_tokens(result):
    rows = {(r["workload"], r["method"]): r for r in result["latency"]}
    names = ["none", "ngram", "early_exit:1", "early_exit:2"]
    assert list(rows) == [(w, m) for m in names for w in ("grounded", "chat")]
    for (workload, _), row in rows.items():
        assert row["matching_outputs"] == 2  # speculation never changes greedy tokens
        assert row["output_tokens"] == rows[(workload, "none")]["output_tokens"]
        assert row["ms_per_token"] > 0 and row["speedup"] > 0
    for workload in ("grounded", "chat"):
        assert rows[(workload, "none")]["speedup"] == 1.0
        assert rows[(workload, "none")]["num_draft_tokens"] == 0
        self_draft = rows[(workload, "early_exit:2")]
        assert self_draft["acceptance_rate"] == 1.0 and self_draft["mean_accepted_length"] > 1
        assert rows[(workload, "early_exit:1")]["num_draft_tokens"] > 0


def test_throughput_off_on_auto(result):
    rows = {(r["batch_size"], r["mode"]): r for r in result["throughput"]}
    assert sorted(rows) == [(b, m) for b in (1, 3) for m in ("auto", "off", "on")]
    for (batch_size, mode), row in rows.items():
        assert row["repeats"] == 2
        # Decode steps only: the first token of each request comes from its prefill step.
        assert 0 < row["output_tokens"] <= 4 * batch_size
        assert (row["acceptance_rate"] > 0) == (mode == "on" or (mode == "auto" and batch_size <= 2))
        assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
    assert all(rows[(b, "off")]["speedup"] == 1.0 for b in (1, 3))
    assert result["auto_disable_batch_size"] == 2 and result["throughput_method"] == "early_exit:2"
    assert result["throughput_repeats"] == 2
    assert {"machine", "command", "date", "git_commit", "engine_args"} <= result.keys()


def test_grounded_prompts_hold_a_document_and_a_task(tiny_model_dir):
    from llmserve.model_loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = grounded_prompts(tokenizer, TokenCorpus(tokenizer), 2, 64, seed=0)
    texts = [tokenizer.decode(p) for p in prompts]
    assert all(GROUNDED_TASKS[i] in text for i, text in enumerate(texts))
    assert all(len(p) > 64 for p in prompts)
    assert prompts == grounded_prompts(tokenizer, TokenCorpus(tokenizer), 2, 64, seed=0)


def test_method_list_errors():
    with pytest.raises(ValueError, match="draft-model"):
        methods(["draft"], [None], None)
    with pytest.raises(ValueError, match="--methods"):
        methods(["hydra"], [None], None)
    assert [m.name for m in methods(["early_exit"], [None, 3], None)] == [
        "none",
        "early_exit",
        "early_exit:3",
    ]
    suffix = methods(["suffix"], [None], None)[1]
    assert (suffix.name, suffix.engine_kwargs) == ("suffix", {"speculative_method": "suffix"})


def test_every_engine_runs_the_same_kernels_and_eagle_is_a_method():
    """Batch invariance decided once for all the engines (unset: off, as speculation keeps it), so the
    baseline's tokens are the reference of the others'; given, it is kept."""
    from llmserve.benchmarks.spec_decode import same_kernels
    from llmserve.config import EngineArgs

    assert same_kernels(EngineArgs())["deterministic"] is False
    assert same_kernels(EngineArgs(deterministic=True))["deterministic"] is True
    assert [m.name for m in methods(["eagle"], [None], None)] == ["none", "eagle"]
    assert methods(["eagle"], [None], None)[1].engine_kwargs == {"speculative_method": "eagle"}
