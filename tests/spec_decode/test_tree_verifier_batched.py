"""The batched greedy tree verification (sample/tree_verifier.py:accept_greedy) against a plain walk.

Random trees of several shapes (chains, stars, random parents, wide-then-deep), several greedy
requests of different tree sizes in one TreeVerifier call, a small vocabulary so that drafts often
equal the target's argmax and siblings often share a token (the walk takes the first of them), and
forced cases: nothing accepted, a whole branch accepted, a deeper subtree under a shadowed sibling.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.sample.token_tree import tree_shape
from llmserve.sample.tree_verifier import TreeVerifier
from llmserve.sampling_params import SamplingParams
from llmserve.worker.request_state import CachedRequestState

V = 5  # few tokens: matches and equal siblings are common
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def reference_walk(parents: list[int], token_ids: list[int], argmax: list[int]) -> tuple[list[int], int]:
    """From the root, move to the first child (by index) whose token is the argmax at the current node;
    stop where none is and emit that argmax. `argmax[0]` is the root's, `argmax[1 + i]` draft i's."""
    path, node = [], -1
    while True:
        child = next(
            (c for c in range(len(parents)) if parents[c] == node and token_ids[c] == argmax[node + 1]), None
        )
        if child is None:
            return path, argmax[node + 1]
        path.append(child)
        node = child


def random_parents(rng: np.random.Generator, kind: str, n: int) -> list[int]:
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] * n
    if kind == "wide_then_deep":  # a few root children, then each new node under a recent one
        return [-1 if i < 3 else int(rng.integers(max(0, i - 3), i)) for i in range(n)]
    return [int(rng.integers(-1, i)) for i in range(n)]  # random: any earlier node or the root


def random_tree(
    rng: np.random.Generator, kind: str, n: int, argmax: list[int]
) -> tuple[list[int], list[int]]:
    """Parents and tokens: each draft the argmax at its parent half the time, else any token."""
    parents = random_parents(rng, kind, n)
    tokens = [argmax[p + 1] if rng.random() < 0.5 else int(rng.integers(V)) for p in parents]
    return parents, tokens


def _request(index: int, tokens: list[int], parents: list[int]) -> CachedRequestState:
    request = CachedRequestState(str(index), [0, 1], [0, 1], GREEDY, (), None, [], 2)
    request.set_drafts(list(tokens), list(parents))
    return request


def _logits_with_argmax(argmax: list[int]) -> torch.Tensor:
    logits = torch.randn(len(argmax), V)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


def verify_and_compare(verifier: TreeVerifier, trees: list[tuple[list[int], list[int], list[int]]]) -> list:
    """Run one batch of (parents, tokens, argmax) trees; assert each equals the reference walk."""
    requests = [_request(i, tokens, parents) for i, (parents, tokens, _) in enumerate(trees)]
    logits = torch.cat([_logits_with_argmax(argmax) for _, _, argmax in trees])
    result = verifier(logits, requests)
    paths = []
    for request, (parents, tokens, argmax) in zip(requests, trees, strict=True):
        path, token = reference_walk(parents, tokens, argmax)
        assert result.paths[request.request_id] == path, (parents, tokens, argmax)
        assert result.token_ids[request.request_id] == [tokens[i] for i in path] + [token]
        paths.append(path)
    assert list(result.paths) == [r.request_id for r in requests]  # request order kept
    return paths


def test_random_batches_equal_the_reference_walk():
    rng = np.random.default_rng(0)
    verifier = TreeVerifier(V, torch.device("cpu"))
    kinds = ["chain", "star", "random", "wide_then_deep"]
    lengths = []
    for _ in range(150):
        trees = []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(1, 13))
            argmax = rng.integers(V, size=1 + n).tolist()
            trees.append((*random_tree(rng, kinds[int(rng.integers(len(kinds)))], n, argmax), argmax))
        lengths += [len(p) for p in verify_and_compare(verifier, trees)]
    assert 0 in lengths and max(lengths) >= 4  # both rejected trees and deep accepted paths were seen


def test_nothing_accepted_a_whole_branch_and_a_shadowed_sibling_in_one_batch():
    parents = [-1, -1, 0, 1, 1, 4, 3, 5]  # leaves 2, 6, 7; branch to 7: 1 -> 4 -> 5 -> 7
    argmax = [1, 0, 2, 0, 0, 3, 0, 0, 4]
    none = ([-1, -1, 0], [2, 3, 1], [1, 1, 1, 1])  # no child of the root is the root's argmax
    branch = (parents, [0, 1, 0, 0, 2, 3, 0, 0], argmax)  # draft 7's token is draft 5's argmax 0
    # Drafts 0 and 1 both carry the root's argmax; 0 comes first, so 1's deeper subtree is never walked.
    shadowed = ([-1, -1, 0, 1, 3], [2, 2, 3, 0, 0], [2, 1, 0, 0, 0, 0])
    paths = verify_and_compare(TreeVerifier(V, torch.device("cpu")), [none, branch, shadowed])
    assert paths == [[], [1, 4, 5, 7], [0]]


def test_mixed_sizes_reuse_the_cached_shapes_and_layout():
    """Tree structure is computed once per shape and the step's layout once per batch of shapes."""
    parents = [-1, -1, 0, 1]
    assert tree_shape(parents) is tree_shape(tuple(parents))
    assert tree_shape(parents).earlier_siblings.nonzero()[0].tolist() == [1]  # draft 1 after draft 0
    verifier = TreeVerifier(V, torch.device("cpu"))
    rng = np.random.default_rng(1)
    for _ in range(3):
        trees = []
        for tree_parents in ([-1, 0], parents, [-1] * 6):
            argmax = rng.integers(V, size=1 + len(tree_parents)).tolist()
            trees.append((tree_parents, rng.integers(V, size=len(tree_parents)).tolist(), argmax))
        verify_and_compare(verifier, trees)
    assert len(verifier._layouts) == 1
