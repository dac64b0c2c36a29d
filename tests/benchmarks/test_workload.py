"""The workload generator: real text, deterministic for a seed, lengths of the requested shape."""

import numpy as np
import pytest

from llmserve.benchmarks.workload import (
    BenchRequest,
    TokenCorpus,
    WorkloadSpec,
    build_workload,
    load_jsonl,
    lognormal_lengths,
    save_jsonl,
)
from llmserve.corpus import corpus_text


@pytest.fixture(scope="module")
def corpus(byte_tokenizer) -> TokenCorpus:
    return TokenCorpus(byte_tokenizer)


def test_corpus_is_real_documentation_text():
    text = corpus_text()
    assert len(text) > 200_000
    assert "assert" in text and "argparse" in text.lower()
    assert "lorem" not in text.lower()


def test_same_seed_same_workload_other_seed_other_workload(byte_tokenizer, corpus):
    first = build_workload(WorkloadSpec(num_requests=20, seed=7), byte_tokenizer, corpus)
    again = build_workload(WorkloadSpec(num_requests=20, seed=7), byte_tokenizer, corpus)
    other = build_workload(WorkloadSpec(num_requests=20, seed=8), byte_tokenizer, corpus)
    assert first == again
    assert [r.prompt for r in first] != [r.prompt for r in other]


def test_lognormal_lengths_have_the_requested_median_spread_and_bounds():
    lengths = lognormal_lengths(np.random.default_rng(0), 20_000, median=200, sigma=0.6, bounds=(4, 1024))
    assert lengths.min() >= 4 and lengths.max() <= 1024
    assert abs(np.median(lengths) - 200) < 5
    inside = lengths[(lengths > 4) & (lengths < 1024)]
    assert abs(np.log(inside).std() - 0.6) < 0.03


def test_workload_lengths_follow_the_spec(byte_tokenizer, corpus):
    spec = WorkloadSpec(num_requests=400, seed=1, prompt_len_median=120, output_len_median=60, sigma=0.5,
                        prompt_len_range=(10, 300), output_len_range=(4, 100))  # fmt: skip
    requests = build_workload(spec, byte_tokenizer, corpus)
    prompt = np.array([r.prompt_len for r in requests])
    output = np.array([r.max_tokens for r in requests])
    assert len(requests) == 400
    assert prompt.max() <= 300 and output.min() >= 4 and output.max() <= 100
    assert prompt.min() >= 10 - 3  # a cut multi-byte character may cost a few bytes
    assert abs(np.median(prompt) - 120) < 12 and abs(np.median(output) - 60) < 6
    for request in requests[:50]:
        assert byte_tokenizer.encode(request.prompt) == request.prompt_token_ids


def test_fixed_lengths(byte_tokenizer, corpus):
    spec = WorkloadSpec(num_requests=30, fixed_prompt_len=64, fixed_output_len=16)
    requests = build_workload(spec, byte_tokenizer, corpus)
    assert all(61 <= r.prompt_len <= 64 for r in requests)
    assert sum(r.prompt_len == 64 for r in requests) >= 25
    assert {r.max_tokens for r in requests} == {16}


def test_shared_prefixes_are_k_system_prompts_followed_by_questions(byte_tokenizer, corpus):
    spec = WorkloadSpec(num_requests=40, shared_prefixes=3, prefix_len=50, fixed_prompt_len=20)
    requests = build_workload(spec, byte_tokenizer, corpus)
    prefixes = {tuple(r.prompt_token_ids[:50]) for r in requests}
    assert len(prefixes) == 3
    assert all(r.prompt_len <= 70 for r in requests)
    assert len({tuple(r.prompt_token_ids[50:]) for r in requests}) == 40  # every question differs


def test_jsonl_round_trip_and_tokenizing_text_only_lines(tmp_path, byte_tokenizer):
    requests = [BenchRequest("hello", [104, 101, 108, 108, 111], 3), BenchRequest("a b", [97, 32, 98], 9)]
    path = save_jsonl(requests, tmp_path / "w.jsonl")
    assert load_jsonl(path) == requests
    (tmp_path / "text.jsonl").write_text('{"prompt": "hi", "max_tokens": 2}\n\n')
    assert load_jsonl(tmp_path / "text.jsonl", byte_tokenizer) == [BenchRequest("hi", [104, 105], 2)]


BAD_LINES = ['{"prompt": "hi"}', '{"prompt": "hi", "max_tokens": 0}', '{"max_tokens": 2}']


@pytest.mark.parametrize("line", BAD_LINES)
def test_bad_workload_lines_are_rejected_with_the_line_number(tmp_path, byte_tokenizer, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(path, byte_tokenizer)
