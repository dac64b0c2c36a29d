"""Speculative decoding through the entry points: `serve` (usage.speculative, /metrics), `generate`
and one-line errors for bad --speculative-* flags."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest

from llmserve import LLM, SamplingParams
from llmserve.cli.main import main
from tests.entrypoints.conftest import API_KEY, ServerProcess, start_server, tiny_server_args
from tests.entrypoints.test_server_lifecycle import delta, scrape

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
# The tiny model has 2 layers: an early exit after both is the target itself, which accepts every draft.
SELF_DRAFT = ["--speculative-method", "early_exit", "--speculative-draft-layers", "2"]
PROMPT = "one two three one two three one two"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("spec-server") / "server.log"
    args = tiny_server_args(tiny_model_dir, *SELF_DRAFT, "--num-speculative-tokens", "4")
    process = start_server(args, log, api_key=API_KEY)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(spec_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_completion_text_equals_no_speculation_and_usage_reports_drafts(client, tiny_model_dir):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    expected = LLM(tiny_model_dir, dtype="float32").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert response.choices[0].text == expected[0].outputs[0].text
    assert response.usage.completion_tokens == 12
    spec = response.usage.model_extra["speculative"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]  # the target drafting for itself
    assert spec["acceptance_rate"] == 1.0
    assert spec["mean_accepted_length"] == 1 + spec["num_accepted_tokens"] / spec["num_drafts"]


def test_chat_and_streamed_usage_carry_the_same_field(client):
    messages = [{"role": "user", "content": "Count: one two three"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_body=NO_EOS)
    assert chat.usage.model_extra["speculative"]["num_accepted_tokens"] > 0
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert chunks[-1].usage.model_extra["speculative"]["acceptance_rate"] == 1.0


def test_a_request_that_does_not_speculate_has_no_speculative_usage(client):
    """max_tokens=1 leaves no room for drafts: `usage` keeps exactly OpenAI's three fields."""
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert response.usage.model_extra == {}


def test_per_request_number_of_drafts(client):
    """`num_speculative_tokens` in the body: 0 turns speculation off for the request, 2 caps its drafts."""

    def complete(num_speculative_tokens: int):
        extra = {**NO_EOS, "num_speculative_tokens": num_speculative_tokens}
        return client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, extra_body=extra
        )

    off = complete(0)
    assert off.usage.model_extra == {}
    two = complete(2)
    spec = two.usage.model_extra["speculative"]
    assert spec["num_draft_tokens"] <= 2 * spec["num_drafts"] and spec["num_drafts"] >= 3
    assert two.choices[0].text == off.choices[0].text
    with pytest.raises(openai.BadRequestError, match="num_speculative_tokens"):
        complete(99)


def test_metrics_count_drafts_and_expose_rates(spec_server, client):
    before = scrape(spec_server)
    usages = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=10, extra_body=NO_EOS).usage
        for p in (PROMPT, "alpha beta")
    ]
    after = scrape(spec_server)
    drafted = sum(u.model_extra["speculative"]["num_draft_tokens"] for u in usages)
    accepted = sum(u.model_extra["speculative"]["num_accepted_tokens"] for u in usages)
    assert delta(after, before, "llmserve:spec_decode_num_draft_tokens_total") == drafted
    assert delta(after, before, "llmserve:spec_decode_num_accepted_tokens_total") == accepted
    assert after["llmserve:spec_decode_draft_acceptance_rate"] == 1.0
    assert after["llmserve:spec_decode_mean_accepted_length"] > 1.0


def llmserve(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmserve.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_generate_with_ngram_speculation(tiny_model_dir, capsys):
    prompt = "a b a b a b"
    flags = ["--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--dtype", "float32"]
    assert main(["generate", prompt, "--model", tiny_model_dir, *flags, "--speculative-method", "ngram"]) == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(tiny_model_dir, dtype="float32").generate(prompt, params, use_tqdm=False)
    assert capsys.readouterr().out.strip() == expected[0].outputs[0].text.strip()


def test_bad_speculative_flags_are_one_line_errors(tiny_model_dir, capsys):
    """Each check is unit-tested in tests/spec_decode; here: they reach both commands as one line."""
    assert main(["generate", "x", "--model", tiny_model_dir, "--speculative-method", "bogus"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "llmserve: error: speculative_method must be one of ngram, draft, early_exit, draft_head, suffix, "
        "medusa, eagle; got 'bogus'"
    ]
    result = llmserve(
        "serve", "--model", tiny_model_dir, "--speculative-method", "ngram", "--prompt-lookup-min", "9"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "llmserve: error: need 1 <= prompt_lookup_min <= prompt_lookup_max, got 9 and 6"
    ]
