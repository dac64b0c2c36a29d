"""Which cached positions a query may see under a sliding window with attention sinks (StreamingLLM).

A query at position p sees key k iff k <= p and (k < sinks or p - k < window); window 0 means no
window. The KV cache manager frees blocks that no future query can see, so these helpers list only
live positions: the sinks, then the window. They build per-step metadata on the host (numpy).
"""

from __future__ import annotations

import numpy as np


def decode_context_positions(seq_lens: np.ndarray, sinks: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """For decodes (query at seq_len - 1): [B, width] key positions and a [B, width] validity mask.

    Padding entries repeat the query's own position (always live), so their slots are real."""
    if window:
        sink_end = np.minimum(sinks, seq_lens)
        window_begin = np.maximum(sink_end, seq_lens - window)
    else:
        sink_end = window_begin = seq_lens
    num_live = sink_end + seq_lens - window_begin
    columns = np.arange(int(num_live.max()))[None, :]
    positions = np.where(
        columns < sink_end[:, None], columns, columns - sink_end[:, None] + window_begin[:, None]
    )
    valid = columns < num_live[:, None]
    return np.where(valid, positions, (seq_lens - 1)[:, None]), valid


def prefill_context_positions(seq_len: int, num_new: int, sinks: int, window: int) -> np.ndarray | None:
    """Key positions a chunk of `num_new` queries (the last ones of `seq_len`) may see: the sinks and
    everything from the first query's window on. None when that is every position 0..seq_len-1."""
    window_begin = seq_len - num_new - window + 1
    if not window or window_begin <= sinks:
        return None
    return np.concatenate((np.arange(sinks), np.arange(window_begin, seq_len)))
