"""`llmserve eval ppl --output` and `kv_cache_ppl --output`: the result file holds the run metadata
and the figures the command printed, on a tiny random Llama with a few tokens."""

import json
import math

from llmserve.benchmarks import kv_cache_ppl
from llmserve.cli.main import main

METADATA = {"benchmark", "machine", "command", "date", "git_commit"}


def test_eval_ppl_writes_its_result(tmp_path, tiny_model_dir, capsys):
    text, output = tmp_path / "text.txt", tmp_path / "ppl.json"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    argv = ["eval", "ppl", "--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-memory", "8MiB",
            "--text", str(text), "--max-tokens", "40", "--context", "16", "--decode-tokens", "0",
            "--output", str(output)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(output.read_text())
    assert result.keys() >= METADATA and result["benchmark"] == "eval-ppl"
    assert result["machine"]["cpu_count"] > 0 and result["date"].endswith("+00:00")
    assert result["tokens"] == 40 - 3 and result["windows"] == 3  # windows of 16, 16, 8 tokens
    assert result["perplexity"] == math.exp(result["nll"]) and result["nll"] > 0
    assert result["decode_ms_per_token"] is None and result["quantization"] is None
    assert result["text"] == str(text) and result["context"] == 16
    assert f"perplexity {result['perplexity']:.4f}" in capsys.readouterr().out


def test_kv_cache_ppl_writes_its_result(tmp_path, tiny_model_dir, capsys):
    output = tmp_path / "kv.json"
    argv = ["--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-dtype", "int8",
            "--sliding-window", "16", "--attention-sinks", "4", "--tokens", "192", "--chunk", "16",
            "--kv-cache-memory", "1MiB", "--output", str(output)]  # fmt: skip
    assert kv_cache_ppl.main(argv) == 0
    result = json.loads(output.read_text())
    assert result.keys() >= METADATA and result["benchmark"] == "kv-cache-ppl"
    assert result["command"].startswith("python -m llmserve.benchmarks.kv_cache_ppl --model ")
    assert result["command"].endswith(f"--output {output}")
    assert (result["kv_cache_dtype"], result["sliding_window"], result["attention_sinks"]) == ("int8", 16, 4)
    assert result["tokens"] == 192 and result["tokens_scored"] == 191
    assert result["perplexity"] == math.exp(result["nll"]) and result["nll"] > 0
    # the window freed the blocks behind it: fewer held at once than the whole text needs
    assert 0 < result["peak_blocks"] < math.ceil(192 / result["block_size"])
    assert f"ppl {result['perplexity']:.4f}" in capsys.readouterr().out
