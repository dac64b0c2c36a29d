"""Per-step batch metadata that attention layers read, set around each forward pass.

Batching stays out of model code: the model sees a flat list of tokens and positions; only the
attention layers look at how those tokens split into sequences and where their KV lives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One sequence with more than one query token this step (a prompt chunk or a recompute)."""

    query_start: int  # first row of its queries in the flat token batch
    query_end: int
    context_slots: torch.Tensor  # [context_len] KV slots of positions 0..context_len-1 (new ones included)
    # sliding window: the positions of context_slots (sinks, then the window; None = 0..context_len-1)
    context_positions: torch.Tensor | None = None
    # a token tree's verify span (sample/token_tree.py): [q, context_len] True where a query may see a
    # key (the context, the root, its own ancestors); None: causal by position
    tree_mask: torch.Tensor | None = None


@dataclass
class RecentKVPlan:
    """A step's moves for an int4/int2 cache (attention/low_bit.py, worker/recent_kv.py): the blocks
    completed this step, gathered from the window and the new rows and quantized into the pool, then
    the new rows that stay in the window and the sinks first computed now. Rows of the completed blocks
    are numbered block * block_size + offset in `sealed_blocks` order; window rows as low_bit.window_rows."""

    sealed_blocks: torch.Tensor  # [n] pool block ids completed this step
    sealed_firsts: torch.Tensor  # [f] which of them are a sequence's first block (indices into sealed_blocks)
    sealed_from_window: torch.Tensor  # [a] rows of the completed blocks that come from the window
    window_rows: torch.Tensor  # [a] their flat window rows
    sealed_from_new: torch.Tensor  # [b] rows of the completed blocks that come from the new rows
    new_rows: torch.Tensor  # [b] their flat token indices
    window_writes: torch.Tensor  # [m] flat window rows written this step
    window_sources: torch.Tensor  # [m] their flat token indices
    # sink rows (entry * sink_tokens + position) first written this step, from the window or new rows
    sinks_from_window: torch.Tensor
    sink_window_rows: torch.Tensor
    sinks_from_new: torch.Tensor
    sink_new_rows: torch.Tensor
    tables: torch.Tensor  # [sequences, columns] int64 block tables, in batch order
    window_slot_tensor: torch.Tensor  # [sequences] each one's window slot, in batch order
    sink_entry_tensor: torch.Tensor  # [sequences] each one's sink entry
    sink_entries: list[int]  # the same, for the per-sequence prefills
    # each prefill's window rows its queries read from before the step (positions low_bit.first_window(
    # computed) .. computed - 1), gathered before the step's writes reuse their places
    earlier_rows: list[torch.Tensor]
    computed: list[int]  # each sequence's tokens cached before this step, in batch order


@dataclass
class AttentionMetadata:
    """The batch as attention needs it.

    "Decode" sequences come first: those with at most the backend's `max_decode_query_len` query
    tokens this step (single-token decodes, and for in-place backends also short spans such as a
    speculative verification), attended to in one batched call. Longer spans follow as prefills."""

    slot_mapping: torch.Tensor  # [num_tokens] KV slot each new token's K/V is written to
    num_decode_tokens: int  # query rows 0..num_decode_tokens-1 belong to the decode sequences
    decode_context_slots: torch.Tensor | None  # [num_decodes, max_context] slots (padded; gathering backends)
    decode_context_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] True where valid
    prefills: list[PrefillSpan]
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64 (in-place backends)
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64 context lengths, new tokens included
    # [num_decodes + 1] int64: decode sequence i's query rows are [starts[i], starts[i + 1]) (in-place
    # backends); None means one query row per decode sequence
    decode_query_starts: torch.Tensor | None = None
    block_size: int = 16
    sliding_window: int = 0  # keys further back than this from a query are hidden (0: no window)
    attention_sinks: int = 0  # ... except the sequence's first this many tokens (StreamingLLM)
    # KV-cache groups 1.. (config/kv_groups.py): their own slots and tables; this one is group 0's
    other_groups: tuple[AttentionMetadata, ...] = ()
    # [num_decode_tokens] int64: token trees verified as decode spans (backends with `takes_tree_masks`):
    # bit j of a query's mask set where it sees its span's token j (its ancestors; -1: every earlier one)
    decode_tree_masks: torch.Tensor | None = None
    # the backend every layer calls this step in place of its own (None: its own): a step verifying a
    # token tree where its own backend takes no tree masks runs the torch reference
    backend: object | None = None
    recent_kv: RecentKVPlan | None = None  # int4/int2 caches: the step's window and block moves

    def query_starts(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """decode_query_starts, or where it is None one query row for each of the `num_rows` decodes."""
        if self.decode_query_starts is not None:
            return self.decode_query_starts
        return torch.arange(num_rows + 1, device=device)


_context: AttentionMetadata | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _context
    previous, _context = _context, metadata
    try:
        yield
    finally:
        _context = previous


def get_attention_metadata(group: int = 0) -> AttentionMetadata:
    """The step's metadata for the layers of KV-cache group `group`."""
    if _context is None:
        raise RuntimeError("attention called outside set_forward_context")
    return _context.other_groups[group - 1] if group else _context
