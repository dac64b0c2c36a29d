"""Token-tree verification (sample/token_tree.py, sample/tree_verifier.py, worker/token_tree_kv.py).

End to end: an oracle proposer that knows the plain greedy output hides the right continuation on a
late branch of trees of several shapes, so accepted paths need their KV moved; greedy tokens must
equal plain decoding's, with prefix caching and chunked prefill on. Unit level: the tree attention
mask against dense attention with a scrambled block table; the greedy walk's table; the sampled walk's
output distribution against the target's at temperature 1 (chi-square).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.config import CacheConfig
from llmserve.request import DraftProposal
from llmserve.sample.token_tree import ancestor_mask, children, depths, is_chain
from llmserve.sample.tree_verifier import TreeVerifier, walk_greedy, walk_sampled
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.worker.request_state import CachedRequestState
from llmserve.worker.step_inputs import InputBuilder
from llmserve.worker.token_tree_kv import accepted_slot_moves, tree_hidden_rows

from .conftest import PROMPTS, assert_no_leaks, greedy, make_llm, record_tree_paths, token_ids

# Tree shapes: (parents, which draft at each depth lies on the right path). Right tokens sit on the
# last branch so an accepted path is out of index order (its KV must move).
SHAPES = {
    "chain": ([-1, 0, 1, 2], [0, 1, 2, 3]),
    "star": ([-1, -1, -1, -1], [3]),
    "branched": ([-1, -1, 0, 1, 1, 4, 3, 5], [1, 4, 5, 7]),
}


class OracleTreeProposer:
    """Drafts trees of one shape whose right path (the plain greedy continuation) is `right`; the
    other drafts are wrong tokens. Every `miss_every`-th proposal gets its deepest right draft wrong."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], shape: str, miss_every: int = 3) -> None:
        self.reference = reference
        self.parents, self.right = SHAPES[shape]
        self.miss_every = miss_every
        self.calls = 0

    def propose(self, batch: SampledBatch) -> dict[str, DraftProposal | None]:
        proposals = {}
        for index, request in enumerate(batch.requests):
            limit = batch.draft_limit(index, len(self.parents))
            done = request.num_output_tokens + len(batch.new_token_ids[index])
            truth = self.reference[tuple(request.prompt_token_ids)][done:]
            if limit == 0 or len(truth) < len(self.right):
                proposals[request.request_id] = None
                continue
            self.calls += 1
            tokens = [(truth[0] + 1 + i) % 500 for i in range(len(self.parents))]  # wrong ones
            for depth, node in enumerate(self.right):
                tokens[node] = truth[depth]
            if self.calls % self.miss_every == 0:
                tokens[self.right[-1]] = (truth[len(self.right) - 1] + 7) % 500
            proposals[request.request_id] = DraftProposal(
                batch.num_tokens(index), tokens[:limit], parents=self.parents[:limit]
            )
        return proposals


@pytest.fixture(scope="module")
def reference(reference_llm) -> dict[tuple[int, ...], list[int]]:
    outputs = reference_llm.generate(PROMPTS, greedy(), use_tqdm=False)
    return {tuple(p): ids for p, ids in zip(PROMPTS, token_ids(outputs), strict=True)}


def record_tree_kernel_steps(runner) -> list[str]:
    """Make `runner` note, for each step whose attention carries kernel tree masks, whether the fused
    decode stack or the modules ran it; returns the list it fills."""
    steps: list[str] = []
    forward = runner._forward

    def noting(inputs):
        if inputs.attention.decode_tree_masks is not None:
            stack = runner.decode_stack
            serves = stack is not None and stack.serves(len(inputs.input_ids), inputs.attention)
            steps.append("stack" if serves else "modules")
        return forward(inputs)

    runner._forward = noting
    return steps


@pytest.mark.parametrize("backend", ["cpu_paged", "torch"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_tree_verification_equals_plain_decoding(target_dir, reference, shape, backend):
    """Prefix caching on (the prompts run twice: the second pass hits), chunked prefill with a budget
    that splits the longer prompts; every request must give plain decoding's tokens, the trees
    verified in the compiled paged kernel (its tree masks; the fused decode stack where it applies)
    or on the reference's dense masks."""
    llm = make_llm(
        target_dir,
        speculative_method="ngram",
        num_speculative_tokens=8,
        prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        attention_backend=backend,
    )
    proposer = OracleTreeProposer(reference, shape)
    llm.engine.proposer = proposer  # the engine drafts through whatever Proposer it holds
    paths = record_tree_paths(llm.engine.model_runner)
    kernel_steps = record_tree_kernel_steps(llm.engine.model_runner)
    for _ in range(2):
        outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert token_ids(outputs) == [reference[tuple(p)] for p in PROMPTS]
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0
    if shape != "chain":  # a chain runs as one (the chain verifier, the compiled kernels)
        moved = [p for p in paths if p != list(range(len(p)))]
        assert any(len(p) >= 2 for p in moved) or shape == "star"
        assert moved, "no accepted path needed its KV moved"
        assert bool(kernel_steps) == (backend == "cpu_paged")
    else:
        assert not paths and not kernel_steps
    assert_no_leaks(llm)


def test_batch_of_one_deep_branch_then_plain_steps(target_dir, reference):
    """One request, every tree fully right on the deep branch: each next step reads the moved KV."""
    llm = make_llm(
        target_dir, speculative_method="ngram", num_speculative_tokens=8, speculative_adaptive_k=False
    )
    llm.engine.proposer = OracleTreeProposer(reference, "branched", miss_every=1000)
    outputs = llm.generate([PROMPTS[2]], greedy(), use_tqdm=False)
    assert token_ids(outputs) == [reference[tuple(PROMPTS[2])]]
    stats = llm.engine.spec_decode_stats
    assert stats.num_accepted_tokens >= 4 * 3  # several passes accepted the whole 4-deep branch
    assert_no_leaks(llm)


def test_a_small_tree_step_runs_in_the_fused_decode_stack(target_dir, reference):
    """One request's star of 4 drafts (5 rows: within the float32 stack's 8): its tree steps run in the
    one compiled call with their masks, and give plain decoding's tokens."""
    llm = make_llm(
        target_dir, speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive_k=False
    )
    runner = llm.engine.model_runner
    if runner.decode_stack is None:
        pytest.skip("no fused decode stack for this model here (its float32 kernels need AVX2)")
    llm.engine.proposer = OracleTreeProposer(reference, "star")
    kernel_steps = record_tree_kernel_steps(runner)
    outputs = llm.generate([PROMPTS[2]], greedy(), use_tqdm=False)
    assert token_ids(outputs) == [reference[tuple(PROMPTS[2])]]
    assert kernel_steps and set(kernel_steps) == {"stack"}
    assert_no_leaks(llm)


def test_a_tree_step_beside_a_prompt_chunk_takes_the_reference(target_dir, reference):
    """A request arriving while another verifies trees: its 30-token prompt (longer than a decode span)
    shares a tree step, which then runs on the reference's spans and masks (the kernel's masks cover
    decode spans only); both give plain decoding's tokens."""
    llm = make_llm(
        target_dir, speculative_method="ngram", num_speculative_tokens=8, speculative_adaptive_k=False
    )
    engine = llm.engine
    engine.proposer = OracleTreeProposer(reference, "branched", miss_every=1000)
    kernel_steps = record_tree_kernel_steps(engine.model_runner)
    mixed = []
    build = engine.model_runner.tree_input_builder.build

    def noting(rows, *args):
        mixed.append(max(n for _, n in rows))
        return build(rows, *args)

    engine.model_runner.tree_input_builder.build = noting
    engine.add_request("a", PROMPTS[0], greedy())
    outputs = {}
    while not kernel_steps:  # until a tree is verified in the kernel
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    engine.add_request("b", PROMPTS[2], greedy())
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(outputs["a"].outputs[0].token_ids) == reference[tuple(PROMPTS[0])]
    assert list(outputs["b"].outputs[0].token_ids) == reference[tuple(PROMPTS[2])]
    assert mixed and max(mixed) == len(PROMPTS[2])  # the tree step that held b's prompt
    assert_no_leaks(llm)


# -- the tree's structure and its attention mask ------------------------------------------------------


def test_tree_structure_helpers():
    parents = SHAPES["branched"][0]
    assert depths(parents).tolist() == [1, 1, 2, 2, 2, 3, 3, 4]
    assert children(parents) == [[0, 1], [2], [3, 4], [], [6], [5], [7], [], []]
    assert ancestor_mask(parents)[5].nonzero()[0].tolist() == [1, 4, 5]
    assert is_chain([-1, 0, 1]) and not is_chain([-1, -1])


def test_tree_attention_mask_matches_dense_attention_with_a_scrambled_block_table():
    """A tree span over a context whose blocks are scattered in the pool: each query's output equals
    dense attention over its context, the root and its ancestors, at the right positions."""
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim, context = 4, 4, 2, 8, 9
    parents = SHAPES["branched"][0]
    n = len(parents)
    cache = CacheConfig(block_size=block_size, num_blocks=16, kv_cache_memory=0)
    backend = TorchSDPABackend()
    builder = InputBuilder(cache, backend, torch.device("cpu"))
    request = CachedRequestState(
        "r", [1] * context, [1] * (context + 1), SamplingParams(), (), None, [], context
    )
    request.block_ids = [11, 3, 14, 0, 7]  # scrambled
    request.set_drafts(list(range(2, 2 + n)), parents)
    inputs = builder.build([(request, 1 + n)])
    positions = inputs.positions.tolist()
    assert positions == [context] + (context + depths(parents)).tolist()
    key_cache = torch.randn(16 * block_size, kv_heads, dim)
    value_cache = torch.randn(16 * block_size, kv_heads, dim)
    slots = [request.block_ids[p // block_size] * block_size + p % block_size for p in range(context)]
    past_k, past_v = key_cache[slots].clone(), value_cache[slots].clone()
    query = torch.randn(1 + n, heads, dim)
    key, value = torch.randn(1 + n, kv_heads, dim), torch.randn(1 + n, kv_heads, dim)
    scale = dim**-0.5
    out = backend.forward(query, key, value, key_cache, value_cache, inputs.attention, scale)
    visible = ancestor_mask(parents)
    for row in range(1 + n):
        seen = [0] + ([] if row == 0 else [1 + j for j in np.nonzero(visible[row - 1])[0]])
        keys = torch.cat([past_k, key[seen]]).repeat_interleave(heads // kv_heads, dim=1)
        values = torch.cat([past_v, value[seen]]).repeat_interleave(heads // kv_heads, dim=1)
        weights = (torch.einsum("hd,khd->hk", query[row], keys) * scale).softmax(dim=-1)
        expected = torch.einsum("hk,khd->hd", weights, values)
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


# -- verification ----------------------------------------------------------------------------------


def test_greedy_walk_table():
    parents = SHAPES["branched"][0]
    kids, tokens = children(parents), [10, 11, 12, 13, 14, 15, 16, 17]
    # argmax per row: root -> 11 (draft 1), draft 1 -> 14 (draft 4), draft 4 -> 15 (draft 5), draft 5 -> 99
    argmax = [11, 0, 0, 0, 0, 15, 0, 0, 0]
    argmax[1 + 1], argmax[1 + 5] = 14, 99
    assert walk_greedy(kids, tokens, argmax) == ([1, 4, 5], 99)
    assert walk_greedy(kids, tokens, [42] + [0] * 8) == ([], 42)


V = 8
P = torch.tensor(
    [
        [0.05, 0.30, 0.05, 0.20, 0.10, 0.10, 0.15, 0.05],
        [0.40, 0.05, 0.05, 0.05, 0.05, 0.10, 0.20, 0.10],
        [0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.30],
        [0.02, 0.03, 0.05, 0.05, 0.10, 0.15, 0.20, 0.40],
    ],
    dtype=torch.float64,
)


def _chi_square_bound(categories: int) -> float:
    """The 0.999 quantile of chi-square with categories - 1 degrees of freedom (Wilson-Hilferty)."""
    k = categories - 1
    return k * (1 - 2 / (9 * k) + 3.09 * math.sqrt(2 / (9 * k))) ** 3


def _chi_square(samples: list[int], p: torch.Tensor) -> float:
    counts = np.bincount(samples, minlength=V).astype(np.float64)
    expected = p.numpy() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def test_recursive_rejection_keeps_the_target_distribution():
    """Two candidates at the root, the first with a child: the first token is distributed as
    the root's p and, where the first candidate was accepted, the second as that draft's row."""
    parents, tokens = [-1, -1, 0], [1, 3, 0]
    kids = children(parents)
    generator = torch.Generator().manual_seed(5)
    first, second = [], []
    for _ in range(6000):
        path, token = walk_sampled(kids, tokens, P, generator)
        emitted = [tokens[i] for i in path] + [token]
        first.append(emitted[0])
        if path[:1] == [0]:
            second.append(emitted[1])
    assert _chi_square(first, P[0]) < _chi_square_bound(V)
    assert len(second) > 1000
    assert _chi_square(second, P[1 + 0]) < _chi_square_bound(V)


def _tree_request(index: int, params: SamplingParams, tokens, parents, seed=None) -> CachedRequestState:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    request = CachedRequestState(str(index), [0, 1], [0, 1], params, (), generator, [], 2)
    request.set_drafts(list(tokens), list(parents))
    return request


def test_tree_verifier_mixed_batch_and_seeded_requests():
    """Greedy and sampled trees in one batch: greedy follows the argmax path; a seeded request's
    tokens do not depend on what else is in the batch; logprobs come at the rows chosen at."""
    greedy_params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    random_params = SamplingParams(temperature=1.0, max_tokens=8)
    parents, tokens = [-1, -1, 1], [3, 1, 0]
    logits = P[[0, 1, 2, 3]].float().log()  # rows: root, draft 0, draft 1, draft 2
    verifier = TreeVerifier(V, torch.device("cpu"))
    alone = verifier(logits, [_tree_request(0, random_params, tokens, parents, seed=3)])
    batch = [
        _tree_request(1, greedy_params, tokens, parents),
        _tree_request(0, random_params, tokens, parents, seed=3),
    ]
    both = verifier(torch.cat([logits, logits]), batch)
    assert both.token_ids["0"] == alone.token_ids["0"]
    # greedy: root argmax 1 is draft 1; draft 1's row (P[2]) argmax 7 is no child (draft 2 is 0)
    assert both.paths["1"] == [1] and both.token_ids["1"] == [1, 7]
    assert [set(entry) >= {token} for entry, token in zip(both.logprobs["1"], [1, 7], strict=True)] == [
        True,
        True,
    ]


def test_tree_verifier_rows_follow_the_target_distribution():
    """Through the verifier (row metadata, processing, the rows of each draft): 1,500 requests with
    the same tree at temperature 1; the first token follows the root's row, the second, where draft 0
    was accepted, draft 0's row (a row mix-up would show as another of P's rows)."""
    parents, tokens = [-1, -1, 0], [1, 3, 0]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    requests = [_tree_request(i, params, tokens, parents) for i in range(1500)]
    torch.manual_seed(9)
    result = TreeVerifier(V, torch.device("cpu"))(P.float().log().repeat(1500, 1), requests)
    emitted = [result.token_ids[r.request_id] for r in requests]
    assert _chi_square([e[0] for e in emitted], P[0]) < _chi_square_bound(V)
    second = [e[1] for r, e in zip(requests, emitted, strict=True) if result.paths[r.request_id][:1] == [0]]
    assert len(second) > 300
    assert _chi_square(second, P[1]) < _chi_square_bound(V)


def test_accepted_slot_moves_and_hidden_rows():
    """A path 1 -> 4 from root position 9 (block size 4, scrambled blocks): draft 1 (position 11)
    moves to 10, draft 4 (position 14) to 11; the rows put the root and the path first."""
    request = CachedRequestState("r", [1] * 9, [1] * 10, SamplingParams(), (), None, [5, 2, 7, 0, 3], 9)
    request.set_drafts([0] * 5, [-1, -1, 0, 1, 1])
    sources, destinations = accepted_slot_moves(request, [1, 4], 4)
    assert sources == [7 * 4 + 3, 0 * 4 + 2] and destinations == [7 * 4 + 2, 7 * 4 + 3]
    assert accepted_slot_moves(request, [0], 4) == ([], [])  # draft 0 is already in place
    other = CachedRequestState("o", [1], [1, 2], SamplingParams(), (), None, [1], 1)
    rows = tree_hidden_rows([other, request], {"r": [1, 4]})
    assert rows.tolist() == [0, 1, 3, 6, 2, 4, 5]
