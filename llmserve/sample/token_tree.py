"""Token trees for speculative decoding: a proposal's drafts as a tree instead of a chain.

A tree of n drafts is a parent index per draft: -1 for a child of the request's last token (the
root), else the index of an earlier draft (parents[i] < i), so every prefix of the drafts is a tree
too (the planner may cut a proposal to a prefix). A chain is parents [-1, 0, 1, ...]. The verify
pass lays the drafts out after the root in index order (KV slots and logits rows 1..n), each at
rotary position root + its depth, each attending to the context, the root and its own ancestors.
A proposer's trees take few shapes (a static tree and its prefixes), so `tree_shape` computes each
shape's structure once and caches it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, eq=False)
class TreeShape:
    """A tree's structure, computed once per parents list (`tree_shape`); its arrays are read-only.
    Compared by identity: `tree_shape` returns the same object for the same parents."""

    parents: np.ndarray  # [n] int64
    depth: np.ndarray  # [n] int64, `depths`
    ancestors: np.ndarray  # [n, n] bool, `ancestor_mask`
    earlier_siblings: np.ndarray  # [n, n] bool: [i, j] where j < i and j has i's parent

    @property
    def num_drafts(self) -> int:
        return len(self.parents)


def tree_shape(parents: Sequence[int]) -> TreeShape:
    """The cached structure of the tree with these parents."""
    return _cached_tree_shape(tuple(parents))


@functools.lru_cache(maxsize=256)  # bounded: a proposer's shapes are a static tree's prefixes
def _cached_tree_shape(parents: tuple[int, ...]) -> TreeShape:
    array = np.array(parents, dtype=np.int64).reshape(-1)
    earlier = np.tri(len(parents), k=-1, dtype=bool)  # [i, j] where j < i
    shape = TreeShape(
        array, depths(parents), ancestor_mask(parents), earlier & (array[:, None] == array[None, :])
    )
    for value in (shape.parents, shape.depth, shape.ancestors, shape.earlier_siblings):
        value.flags.writeable = False
    return shape
