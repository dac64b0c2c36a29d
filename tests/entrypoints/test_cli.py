"""The `llmserve` command: streamed generate and chat, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from ..helpers import make_tiny_llama_dir

pytestmark = pytest.mark.process


def llmserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("cli") / "tiny"))


def test_generate_streams_text_and_exits_zero(tiny_model):
    result = llmserve("generate", "Hello there", "--model", tiny_model, "--max-tokens", "8", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_chat_keeps_a_history_and_quits_on_end_of_input(tiny_model):
    result = llmserve("chat", "--model", tiny_model, "--max-tokens", "4", stdin="first\nsecond\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3  # two answered prompts, then end of input at the third


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "x", "--model", "/no/such/model.gguf"], "no such file"),
        (["generate", "x", "--max-tokens", "0"], "max_tokens"),
        (["generate", "x", "--temperature", "-1"], "temperature"),
        (["generate"], "required"),
        (["generate", "x", "--no-such-flag"], "unrecognized"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    result = llmserve(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_corrupt_and_unsupported_models_are_one_line_errors(tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(1000))
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    for model in (corrupt, unsupported):
        result = llmserve("generate", "x", "--model", str(model))
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
