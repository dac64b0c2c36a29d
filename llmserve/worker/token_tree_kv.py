"""After a token tree's verify pass (sample/tree_verifier.py): its accepted path's KV moved into place.

The pass wrote draft i's K/V at the slot of position root + 1 + i (drafts in index order), with the
rotary position root + depth(i). The accepted path's drafts a_1..a_m (depths 1..m) belong at positions
root + 1..root + m, where the next steps read them: each is copied there, in every layer, from its
slot (no recompute; rotary already used the right position). A copy only moves a draft to an earlier
slot of the same request's blocks, allocated for this step and not yet shared; drafts already in place
(a path that is a prefix of the index order) are not copied. The slots past the path hold rejected
drafts' KV, past the request's computed tokens: never read, overwritten by later steps or freed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llmserve.worker.request_state import CachedRequestState


def accepted_slot_moves(
    request: CachedRequestState, path: Sequence[int], block_size: int
) -> tuple[list[int], list[int]]:
    """(source slots, destination slots) of the path's drafts that are not in place yet."""
    root = request.num_tokens - 1  # the root is the request's last token, the one the step computed
    sources = [root + 1 + node for node in path]
    destinations = [root + depth for depth in range(1, len(path) + 1)]
    moves = [(s, d) for s, d in zip(sources, destinations, strict=True) if s != d]
    if not moves:
        return [], []
    blocks = request.block_ids

    def slot(position: int) -> int:
        return blocks[position // block_size] * block_size + position % block_size

    return [slot(s) for s, _ in moves], [slot(d) for _, d in moves]


def move_accepted_kv(
    kv_cache: torch.Tensor,  # [layers, 2, num_slots, kv_heads, row]
    block_size: int,
    requests: Sequence[CachedRequestState],
    paths: dict[str, list[int]],
) -> None:
    """Copy each request's accepted drafts to the slots right after its root, all layers at once (the
    sources are gathered before any destination is written, so overlapping moves are safe)."""
    sources, destinations = [], []
    for request in requests:
        src, dst = accepted_slot_moves(request, paths[request.request_id], block_size)
        sources += src
        destinations += dst
    if sources:
        index = torch.tensor(sources, dtype=torch.int64, device=kv_cache.device)
        kv_cache[:, :, torch.tensor(destinations, dtype=torch.int64, device=kv_cache.device)] = kv_cache[
            :, :, index
        ]


def tree_hidden_rows(requests: Sequence[CachedRequestState], paths: dict[str, list[int]]) -> torch.Tensor:
    """An order of the step's sampling rows in which each tree request's rows start with its root and
    its accepted path (row j: the state after the first j accepted drafts, as for a chain), so a
    proposer reads them as it reads a chain's; other requests' rows stay as they are."""
    order, start = [], 0
    for request in requests:
        count = 1 + len(request.spec_token_ids)
        rows = list(range(start, start + count))
        path = paths.get(request.request_id)
        if path is not None:
            front = [start] + [start + 1 + node for node in path]
            rows = front + [row for row in rows if row not in set(front)]
        order += rows
        start += count
    return torch.from_numpy(np.asarray(order, dtype=np.int64))
