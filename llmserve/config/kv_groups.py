"""KV-cache groups: the model's layers split by attention kind, one block table per group.

A model whose layers mix sliding-window and global attention (Gemma 2/3) keeps the KV of a sliding
layer only for its window. Layers of one kind share a block table, so the blocks of a sliding group
can be freed as they leave the window while a global group's grow. All groups draw from one block
pool whose blocks are the same size: every group has the same number of layers (`group_size`, the
smallest count of any kind; a kind with more layers is split into several groups, the last one
possibly shorter), and the j-th layer of every group stores its KV in the pool's j-th tensor. A block
id belongs to one group at a time, so its bytes hold `group_size` layers of that group:

    Gemma 2, 4 layers (S G S G):   group 0 (global)  layers 1, 3   tensors 0, 1
                                   group 1 (window)  layers 0, 2   tensors 0, 1

Global groups come first, so group 0 is a global one wherever there is one. A model with one kind of
layer has one group holding every layer, the pool's tensors in layer order (as without groups). Under
pipeline parallelism a stage's pool has tensors for the most layers one group has in that stage.
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class KVCacheGroup:
    window: int  # its layers attend to the last this many positions and keep only their KV (0: global)
    layers: tuple[int, ...]  # model layer indices; the i-th stores its KV in the pool's i-th tensor


def kv_cache_groups(layer_types: tuple[str, ...], window: int) -> tuple[KVCacheGroup, ...]:
    """Groups of layers by kind; sliding layers (`SLIDING`) keep `window` positions."""
    full = tuple(i for i, kind in enumerate(layer_types) if kind != SLIDING)
    sliding = tuple(i for i, kind in enumerate(layer_types) if kind == SLIDING)
    kinds = [(0, full), (window, sliding)]
    size = min(len(layers) for _, layers in kinds if layers)
    return tuple(
        KVCacheGroup(kind_window, layers[start : start + size])
        for kind_window, layers in kinds
        for start in range(0, len(layers), size)
    )


def group_size(groups: tuple[KVCacheGroup, ...], stages: list[range] | None = None) -> int:
    """Layers whose KV one block holds: the pool's number of tensors (with pipeline stages, the most
    layers of one group within one stage: each stage's pool holds its own layers)."""
    stages = stages or [range(max(i for group in groups for i in group.layers) + 1)]
    return max(len(stage_layers(group, stage)) for group in groups for stage in stages)


def stage_layers(group: KVCacheGroup, stage: range | tuple[int, ...]) -> tuple[int, ...]:
    """The group's layers that run in this pipeline stage."""
    return tuple(i for i in group.layers if i in stage)
