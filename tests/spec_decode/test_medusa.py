"""Tree proposers: Medusa heads (proposers/medusa.py: the published file layout, training by
`train-draft-head --medusa-heads`) and eagle (proposers/eagle.py: the draft head expanded as a tree);
greedy output identical to plain decoding with their token trees."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.spec_decode.proposers.draft_head import DraftHead
from llmserve.spec_decode.proposers.eagle import EagleTreeProposer
from llmserve.spec_decode.proposers.medusa import (
    DEFAULT_TREE,
    MedusaHeads,
    MedusaProposer,
    load_medusa_heads,
    tree_parents,
)
from llmserve.worker.request_state import CachedRequestState
from tests.helpers import TINY_LLAMA_CONFIG

from .conftest import PROMPTS, assert_no_leaks, greedy, make_llm, record_tree_paths, token_ids

HIDDEN, VOCAB = TINY_LLAMA_CONFIG["hidden_size"], TINY_LLAMA_CONFIG["vocab_size"]
# Less text and fewer epochs than the draft head's fixture: the heads only need to load and draft.
MEDUSA_TRAINING_FLAGS = [
    "--num-grounded", "1", "--num-chat", "3", "--num-sampled-chat", "1", "--max-tokens", "24",
    "--epochs", "3", "--batch-size", "32", "--learning-rate", "0.01", "--dtype", "float32",
    "--max-model-len", "1024", "--kv-cache-memory", "8MiB",
]  # fmt: skip


def _published_state(num_heads: int, hidden: int = HIDDEN, vocab: int = VOCAB, seed: int = 0) -> dict:
    """A state dict in FasterDecoding/Medusa's layout (one residual block per head)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for k in range(num_heads):
        state[f"medusa_head.{k}.0.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.1
        state[f"medusa_head.{k}.0.linear.bias"] = torch.zeros(hidden)
        state[f"medusa_head.{k}.1.weight"] = torch.randn(vocab, hidden, generator=generator)
    return state


def test_loads_the_published_layout_from_safetensors_and_torch_files(tmp_path):
    state = _published_state(3, hidden=16, vocab=32)
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    torch.save(state, str(tmp_path / "medusa_lm_head.pt"))
    for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):
        heads = load_medusa_heads(str(tmp_path / name), 16, 32)
        assert heads.num_heads == 3
        hidden = torch.randn(2, 16)
        block = state["medusa_head.1.0.linear.weight"]
        expected = (hidden + torch.nn.functional.silu(hidden @ block.T)) @ state["medusa_head.1.1.weight"].T
        torch.testing.assert_close(heads(hidden)[1], expected)
    with pytest.raises(ValueError, match="do not fit"):
        load_medusa_heads(str(tmp_path / "medusa_lm_head.pt"), 16, 64)
    deeper = dict(state, **{"medusa_head.0.1.linear.weight": torch.zeros(16, 16)})
    torch.save(deeper, str(tmp_path / "deeper.pt"))
    with pytest.raises(ValueError, match="more than one residual block"):
        load_medusa_heads(str(tmp_path / "deeper.pt"), 16, 32)


def test_default_tree_lists_parents_first():
    parents = tree_parents(DEFAULT_TREE)
    assert parents[:7] == [-1, -1, 0, -1, 0, 1, 2]
    assert all(p < i for i, p in enumerate(parents))
    with pytest.raises(ValueError, match="before its parent"):
        tree_parents(((0, 0), (0,)))


def test_proposals_are_the_heads_top_k_by_tree_node():
    """Node (r_1..r_d) is head d-1's r_d-th token; K cuts the tree to its first nodes; a structured
    output request gets the top-1 chain."""
    torch.manual_seed(0)
    heads = MedusaHeads(8, 16, 2)
    proposer = MedusaProposer(heads, k=5, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    request = CachedRequestState("r", [1, 2], [1, 2, 3], params, (), None, [], 2)
    hidden = torch.randn(1, 8)
    proposal = proposer.propose(SampledBatch([request], [[4]], hidden))["r"]
    top = heads(hidden)[:, 0].topk(3, dim=-1).indices.tolist()
    assert proposal.num_tokens == 4
    assert proposal.parents == [-1, -1, 0, -1, 0]
    assert proposal.token_ids == [top[0][0], top[0][1], top[1][0], top[0][2], top[1][1]]


@pytest.fixture(scope="module")
def reference(reference_llm) -> list[list[int]]:
    return token_ids(reference_llm.generate(PROMPTS, greedy(), use_tqdm=False))


@pytest.fixture(scope="module")
def medusa_file(target_dir, tmp_path_factory) -> str:
    """Heads trained by the real command on the tiny target's own outputs (seconds)."""
    from llmserve.cli.main import main

    path = str(tmp_path_factory.mktemp("medusa") / "medusa.safetensors")
    flags = [*MEDUSA_TRAINING_FLAGS, "--medusa-heads", "3"]
    assert main(["train-draft-head", "--model", target_dir, "--output", path, *flags]) == 0
    return path


@pytest.mark.parametrize("k", [2, 15])
def test_medusa_greedy_equals_plain_decoding(target_dir, medusa_file, reference, k):
    """Trees cut to K nodes, in a batch, with chunked prefill and prefix caching;
    the prompts run twice so the second pass hits the prefix cache."""
    llm = make_llm(
        target_dir,
        speculative_method="medusa",
        speculative_draft_head=medusa_file,
        num_speculative_tokens=k,
        speculative_adaptive_k=False,  # whole trees every step (rarely right heads would shrink K to 1)
        max_num_batched_tokens=16,
    )
    paths = record_tree_paths(llm.engine.model_runner)
    for _ in range(2):
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert paths, "no token tree was verified"
    assert_no_leaks(llm)


def test_medusa_seeded_sampling_is_reproducible(target_dir, medusa_file):
    """Temperature 1 through the tree verifier's recursive rejection: a seed gives the same tokens
    alone and in a batch (its draws come from its own generator)."""
    llm = make_llm(target_dir, speculative_method="medusa", speculative_draft_head=medusa_file)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    alone = token_ids(llm.generate([PROMPTS[0]], params, use_tqdm=False))
    batch = token_ids(llm.generate(PROMPTS[:3], [params, greedy(), greedy()], use_tqdm=False))
    assert batch[0] == alone[0]
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert_no_leaks(llm)


# -- eagle: the draft head expanded as a tree ---------------------------------------------------------


def test_eagle_expands_each_branch_from_its_own_token():
    """Node (r_1..r_d)'s token is the r_d-th best candidate of the head stepped from its parent's
    guessed feature and its parent's token: the root from the target's feature and sampled token."""
    torch.manual_seed(0)
    hidden_size, vocab = 8, 40
    head = DraftHead(hidden_size, 16, torch.arange(0, vocab, 2), 1e-5).eval()
    embedding = torch.nn.Embedding(vocab, hidden_size)
    target = SimpleNamespace(
        model=SimpleNamespace(embed_tokens=embedding),
        arch=SimpleNamespace(tie_word_embeddings=True),
        lm_head=None,
    )
    proposer = EagleTreeProposer(head, target, k=6)
    assert proposer.tree == DEFAULT_TREE[:6]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    request = CachedRequestState("r", [1, 2], [1, 2, 3], params, (), None, [], 2)
    feature = torch.randn(1, hidden_size)
    with torch.inference_mode():
        proposal = proposer.propose(SampledBatch([request], [[4]], feature))["r"]
        weight = embedding.weight[head.vocab_ids]

        def candidates(f, token):
            guess = head(f, embedding(torch.tensor([token])))
            return guess, head.vocab_ids[(guess @ weight.T).topk(3).indices[0]].tolist()

        root, first = candidates(feature, 4)
        _, under_best = candidates(root, first[0])
        _, under_second = candidates(root, first[1])
    # DEFAULT_TREE[:6]: (0,), (1,), (0, 0), (2,), (0, 1), (1, 0)
    assert proposal.parents == [-1, -1, 0, -1, 0, 1]
    assert proposal.token_ids == [first[0], first[1], under_best[0], first[2], under_best[1], under_second[0]]


@pytest.mark.parametrize("k", [4, 15])
def test_eagle_greedy_equals_plain_decoding(target_dir, draft_head, reference, k):
    llm = make_llm(
        target_dir,
        speculative_method="eagle",
        speculative_draft_head=draft_head,
        num_speculative_tokens=k,
        speculative_adaptive_k=False,
        max_num_batched_tokens=16,
    )
    for _ in range(2):
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert_no_leaks(llm)


HEADS = dict(speculative_draft_head="heads.safetensors")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(HEADS, tensor_parallel_size=2, speculative_method="eagle"),
            "eagle .token trees. runs on one rank",
        ),
        (
            dict(HEADS, pipeline_parallel_size=2, speculative_method="medusa"),
            "medusa .token trees. runs on one",
        ),
        (dict(HEADS, sliding_window=64, speculative_method="eagle"), "needs full attention"),
        (dict(HEADS, deterministic=True, speculative_method="eagle"), "--deterministic does not combine"),
        (dict(speculative_method="medusa"), "medusa needs --speculative-draft-head"),
    ],
)
def test_what_tree_methods_refuse(kwargs, message):
    from llmserve.config import EngineArgs
    from tests.distributed.test_shard import ARCH

    with pytest.raises(ValueError, match=message) as error:
        EngineArgs(device="cpu", **kwargs).create_config(ARCH, "model")
    assert "\n" not in str(error.value)


def test_eagle_trees_with_penalties_logit_bias_and_logprobs_equal_plain(
    target_dir, draft_head, reference_llm
):
    """Rows processed along each draft's path (repetition penalty, logit bias) and log-probs at the
    rows chosen at: the same tokens and top log-prob entries as plain decoding."""
    params = greedy(repetition_penalty=1.3, logit_bias={PROMPTS[0][0]: 5.0}, logprobs=2)
    plain = reference_llm.generate(PROMPTS[:3], params, use_tqdm=False)
    llm = make_llm(
        target_dir,
        speculative_method="eagle",
        speculative_draft_head=draft_head,
        num_speculative_tokens=15,
        speculative_adaptive_k=False,
    )
    trees = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert token_ids(trees) == token_ids(plain)
    for tree, base in zip(trees, plain, strict=True):
        for ours, theirs in zip(tree.outputs[0].logprobs, base.outputs[0].logprobs, strict=True):
            assert set(ours) == set(theirs)
            for token, value in theirs.items():
                assert abs(_logprob(ours[token]) - _logprob(value)) < 1e-4
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert_no_leaks(llm)


def _logprob(entry) -> float:
    return entry if isinstance(entry, float) else entry.logprob
