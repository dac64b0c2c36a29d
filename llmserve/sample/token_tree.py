"""Token trees for speculative decoding: a proposal's drafts as a tree instead of a chain.

A tree of n drafts is a parent index per draft: -1 for a child of the request's last token (the
root), else the index of an earlier draft (parents[i] < i), so every prefix of the drafts is a tree
too (the planner may cut a proposal to a prefix). A chain is parents [-1, 0, 1, ...]. The verify
pass lays the drafts out after the root in index order (KV slots and logits rows 1..n), each at
rotary position root + its depth, each attending to the context, the root and its own ancestors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_parents(parents: Sequence[int]) -> None:
    """Raise ValueError unless every parent is -1 or an earlier draft."""
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            raise ValueError(f"draft {index}'s parent {parent} is not -1 or an earlier draft")


def is_chain(parents: Sequence[int]) -> bool:
    """Whether the tree is one path (each draft the child of the one before)."""
    return all(parent == index - 1 for index, parent in enumerate(parents))


def chain(num_drafts: int) -> list[int]:
    return list(range(-1, num_drafts - 1))


def depths(parents: Sequence[int]) -> np.ndarray:
    """[n] each draft's depth: 1 for a child of the root."""
    depth = np.zeros(len(parents), dtype=np.int64)
    for index, parent in enumerate(parents):  # parents come first: one pass
        depth[index] = 1 if parent < 0 else depth[parent] + 1
    return depth


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """[n, n] bool: [i, j] is True where draft j is draft i or one of its ancestors."""
    mask = np.eye(len(parents), dtype=bool)
    for index, parent in enumerate(parents):
        if parent >= 0:
            mask[index] |= mask[parent]
    return mask


def children(parents: Sequence[int]) -> list[list[int]]:
    """Children of each node in index order: entry 0 is the root's, entry 1 + i draft i's."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for index, parent in enumerate(parents):
        kids[parent + 1].append(index)
    return kids


def path_tokens(parents: Sequence[int], token_ids: Sequence[int]) -> list[list[int]]:
    """For each draft, the draft tokens from the root's child down to it (itself included)."""
    paths: list[list[int]] = []
    for index, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [token_ids[index]])
    return paths
