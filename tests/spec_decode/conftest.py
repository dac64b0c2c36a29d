"""Tiny random Llamas for end-to-end speculative decoding tests (float32, milliseconds per step)."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams

# 4 layers so that an early exit (2 layers by default) is a real, different draft.
TARGET_LAYERS = 4
MAX_TOKENS = 24

# Token-id prompts: some repeat a phrase (prompt lookup finds drafts there), some do not.
PROMPTS = [
    [5, 6, 7, 8] * 6,
    [100, 200, 300] * 5 + [9],
    list(range(1000, 1030)),
    [42] * 3,
    [7, 700, 7000, 70, 17, 170] * 3 + [7, 700],
    [31, 4159, 2653],
]


def greedy(max_tokens: int = MAX_TOKENS, k: int | None = None, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k, **kwargs
    )


def make_llm(model_dir: str, **kwargs) -> LLM:
    """A small float32 engine; speculation never auto-disabled unless the test says so."""
    kwargs.setdefault("speculative_disable_batch_size", 0)
    kwargs.setdefault("max_model_len", 256)
    return LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", **kwargs)


def spec_kwargs(method: str, target_dir: str, other_draft_dir: str, draft_head: str | None = None) -> dict:
    """Engine kwargs per proposer; *_all and *_self are the target drafting for itself; draft_head_only
    is the head without prompt lookup."""
    head = dict(speculative_method="draft_head", speculative_draft_head=draft_head)
    return {
        "ngram": dict(speculative_method="ngram"),
        "early_exit": dict(speculative_method="early_exit"),
        "early_exit_all": dict(speculative_method="early_exit", speculative_draft_layers=TARGET_LAYERS),
        "draft": dict(speculative_method="draft", speculative_draft_model=other_draft_dir),
        "draft_self": dict(speculative_method="draft", speculative_draft_model=target_dir),
        "draft_head": head,
        "draft_head_only": dict(head, prompt_lookup_max=0),
        "suffix": dict(speculative_method="suffix"),
        "eagle": dict(speculative_method="eagle", speculative_draft_head=draft_head),  # token trees
    }[method]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_no_leaks(llm: LLM) -> None:
    """Every block back in the free pool once all requests are done; ref counts agree with tables."""
    manager = llm.engine.kv_cache_manager
    manager.check_integrity()
    assert not llm.engine.has_unfinished_requests()
    assert manager.pool.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine OpenMP spinning made these
    tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> str:
    from tests.helpers import make_tiny_llama_dir

    path = tmp_path_factory.mktemp("spec") / "target"
    return make_tiny_llama_dir(str(path), num_hidden_layers=TARGET_LAYERS)


@pytest.fixture(scope="session")
def other_draft_dir(tmp_path_factory) -> str:
    """A different random model with the same vocabulary: a valid draft that is rarely right."""
    from tests.helpers import make_tiny_llama_dir

    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("spec") / "draft"), seed=1)


@pytest.fixture(scope="session")
def reference_llm(target_dir) -> LLM:
    return make_llm(target_dir)


# A draft head for the tiny target, trained by the real command on the target's own outputs (seconds).
HEAD_TRAINING_FLAGS = [
    "--num-grounded", "3", "--num-chat", "6", "--num-sampled-chat", "2", "--max-tokens", "32",
    "--intermediate-size", "256", "--vocab-subset", "512", "--epochs", "40", "--batch-size", "64",
    "--learning-rate", "0.01", "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "8MiB",
]  # fmt: skip


@pytest.fixture(scope="session")
def draft_head(target_dir, tmp_path_factory) -> str:
    from llmserve.cli.main import main

    path = str(tmp_path_factory.mktemp("spec") / "head.safetensors")
    assert main(["train-draft-head", "--model", target_dir, "--output", path, *HEAD_TRAINING_FLAGS]) == 0
    return path


def record_tree_paths(runner) -> list:
    """Make `runner`'s tree verifier record every accepted path it verifies; returns the list it fills."""
    paths: list = []
    verify = runner.tree_verifier.__call__

    def recording(logits, requests, failed=None):
        result = verify(logits, requests, failed)
        paths.extend(result.paths.values())
        return result

    runner.tree_verifier = recording
    return paths
