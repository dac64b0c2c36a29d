"""A step's flat inputs: the requests catching up by some tokens turned into token ids, positions and
attention metadata (slot mapping, block tables, prefill spans), vectorized with numpy; the only Python
loops are over requests (gathering their new token ids and block tables), never over tokens. With
KV-cache groups (config/kv_groups.py: sliding and global layers) each group gets its own metadata,
built from its columns of the requests' interleaved block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from llmserve.attention.low_bit import first_window, window_rows
from llmserve.attention.window import decode_context_positions, prefill_context_positions
from llmserve.config import CacheConfig
from llmserve.forward_context import AttentionMetadata, PrefillSpan, RecentKVPlan
from llmserve.sample.token_tree import tree_shape
from llmserve.worker.prompt_logprobs import PromptLogprobRows
from llmserve.worker.prompt_logprobs import select_rows as select_prompt_logprob_rows


class BatchRow(Protocol):
    """What input preparation reads of a request: a runner's CachedRequestState, or a draft model's
    view of one (spec_decode/proposers/draft_model.py)."""

    all_token_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int]
    block_ids: list[int]

    @property
    def num_tokens(self) -> int: ...


@dataclass
class StepInputs:
    requests: list[BatchRow]  # in batch order (decodes first)
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    sample_rows: list[int]  # batch indices of requests that sample this step
    logits_indices: torch.Tensor  # flat token index of each sampling request's last token (and its drafts)
    prompt_logprob_rows: PromptLogprobRows | None = None  # rows of requests asking for prompt log-probs
    pool_rows: list[int] = field(default_factory=list)  # batch indices of embedding requests done now
    pool_indices: torch.Tensor | None = None  # flat index of each one's last prompt token
    static_size: int | None = None  # a decode step on the static buffers (cuda_graphs.py): its padded size
    # LoRA: each flat token's adapter slot (-1: the base model); None when no token has an adapter
    lora_slots: np.ndarray | None = None


class InputBuilder:
    """Flat inputs for a model runner: its cache's block size, groups, window and sinks, its attention
    backend (which rows count as decodes, whether decodes read gathered context) and its device."""

    def __init__(self, cache: CacheConfig, attention_backend, device: torch.device) -> None:
        self.cache = cache
        self.attention_backend = attention_backend
        self.device = device
        self.block_size = cache.block_size
        self.kv_groups = cache.kv_groups  # (): one group of every layer
        self.recent_kv = (
            None  # int4/int2 caches: the runner's window (worker/recent_kv.py), whose slots it reads
        )

    def build(
        self,
        rows: list[tuple[BatchRow, int]],
        lora_slots: Callable[[list[BatchRow]], np.ndarray] | None = None,
    ) -> StepInputs:
        """Flat inputs for requests catching up by the given numbers of tokens (drafts included);
        `lora_slots`: each request's LoRA adapter slot (-1: none), where adapters are enabled."""
        # Short rows first (decodes, verify spans) so attention can batch them into one call.
        limit = self.attention_backend.max_decode_query_len
        rows = sorted(rows, key=lambda row: row[1] > limit)
        requests = [request for request, _ in rows]
        num_new = np.array([count for _, count in rows], dtype=np.int64)
        computed = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
        seq_lens = computed + num_new
        ends = np.cumsum(num_new)
        starts = ends - num_new

        token_ids: list[int] = []
        for request, first, count in zip(requests, computed.tolist(), num_new.tolist(), strict=True):
            token_ids.extend(request.all_token_ids[first : first + count])
            token_ids.extend(request.spec_token_ids)  # speculative decoding: drafts follow the last token
        positions = np.arange(ends[-1]) - np.repeat(starts - computed, num_new)  # in the KV slots' order
        trees = {i: t for i, r in enumerate(requests) if (t := getattr(r, "spec_tree_parents", None))}
        block_tables = self._block_tables(requests, int(seq_lens.max()))
        token_rows = np.repeat(np.arange(len(requests)), num_new)
        if self.kv_groups:
            attention = self._group_metadata(block_tables, token_rows, positions, num_new, seq_lens, starts)
        else:
            slot_mapping = self._slots(block_tables[token_rows, positions // self.block_size], positions)
            attention = self.attention_metadata(block_tables, num_new, seq_lens, starts, slot_mapping)
        if trees:
            self._add_tree_masks(attention, trees, seq_lens, starts)
        if self.recent_kv is not None:
            attention.recent_kv = self._recent_kv_plan(
                requests, block_tables, computed, seq_lens, token_rows, positions, len(attention.prefills)
            )

        num_drafts = np.array([len(r.spec_token_ids) for r in requests], dtype=np.int64)
        caught_up = [i for i, r in enumerate(requests) if seq_lens[i] == r.num_tokens + num_drafts[i]]
        pool_rows = [i for i in caught_up if getattr(requests[i], "pooling", False)]  # embeddings
        sample_rows = [i for i in caught_up if i not in pool_rows] if pool_rows else caught_up
        to_device = self._to_device
        row_slots = None if lora_slots is None else lora_slots(requests)
        return StepInputs(
            lora_slots=row_slots[token_rows] if row_slots is not None and row_slots.max() >= 0 else None,
            requests=requests,
            input_ids=to_device(np.asarray(token_ids, dtype=np.int64)),
            positions=to_device(_tree_positions(positions, trees, ends, computed) if trees else positions),
            attention=attention,
            sample_rows=sample_rows,
            logits_indices=to_device(_logits_indices(ends[sample_rows], num_drafts[sample_rows])),
            prompt_logprob_rows=select_prompt_logprob_rows(requests, computed, num_new, starts, self.device),
            pool_rows=pool_rows,
            pool_indices=to_device(ends[pool_rows] - 1) if pool_rows else None,
        )

    def _recent_kv_plan(
        self, requests, block_tables, computed, seq_lens, token_rows, positions, num_prefills
    ) -> RecentKVPlan:
        """The step's moves for an int4/int2 cache (forward_context.RecentKVPlan): every block whose last
        row this step writes, from the window (rows cached before the step) and the new rows; the new
        rows of the blocks a later query reads in full precision; the sinks no request wrote before."""
        block, recent = self.block_size, self.recent_kv
        slots = recent.slots(request.request_id for request in requests)
        span, num_sinks = recent.window_blocks * block, recent.sink_tokens
        first, end = computed // block, seq_lens // block  # blocks [first, end) are completed this step
        counts = np.maximum(end - first, 0)
        firsts = np.cumsum(counts) - counts  # each sequence's first completed block, in plan order
        owner = np.repeat(np.arange(len(requests)), counts)
        sealed_index = first[owner] + np.arange(int(counts.sum())) - firsts[owner]  # in its table
        sealed_blocks = block_tables[owner, sealed_index]
        recent.drop_sinks(sealed_blocks.tolist())  # reused blocks: their old sinks are gone
        # sinks: read (and first written) once a sequence's first span is complete; entry 0 elsewhere
        after_span = np.flatnonzero(seq_lens >= span)
        sinks, made = np.zeros(len(requests), dtype=np.int64), np.zeros(len(requests), dtype=bool)
        sinks[after_span], made[after_span] = recent.sink_entries(block_tables[after_span, 0].tolist())
        if (made & (computed >= span)).any():  # a prefix hit of a first span whose sinks were dropped
            raise RuntimeError(
                "an int4/int2 prefix hit's sink entry is missing (the step that made it failed)"
            )
        token_block = positions // block
        from_new = np.flatnonzero(token_block < end[token_rows])
        rows = token_rows[from_new]
        sealed_from_new = (firsts[rows] + token_block[from_new] - first[rows]) * block + positions[
            from_new
        ] % block
        kept = np.where(counts > 0, computed % block, 0)  # window rows of a block completed now
        keeper = np.repeat(np.arange(len(requests)), kept)
        offset = np.arange(int(kept.sum())) - np.repeat(np.cumsum(kept) - kept, kept)
        kept_positions = first[keeper] * block + offset
        # rows a later query reads in full precision: those of the sequence's incomplete span of blocks
        span_start = end // recent.window_blocks * recent.window_blocks
        stays = np.flatnonzero(token_block >= span_start[token_rows])
        sink_sources = np.flatnonzero((positions < num_sinks) & made[token_rows])
        already = np.where(made, np.minimum(computed, num_sinks), 0)  # sink positions in the windows
        writer = np.repeat(np.arange(len(requests)), already)
        sink_positions = np.arange(len(writer)) - np.repeat(np.cumsum(already) - already, already)
        device = self._to_device
        return RecentKVPlan(
            sealed_blocks=device(sealed_blocks),
            sealed_firsts=device(np.flatnonzero(sealed_index == 0)),
            sealed_from_window=device(firsts[keeper] * block + offset),
            window_rows=device(window_rows(slots[keeper], kept_positions, block)),
            sealed_from_new=device(sealed_from_new),
            new_rows=device(from_new),
            window_writes=device(window_rows(slots[token_rows[stays]], positions[stays], block)),
            window_sources=device(stays),
            sinks_from_window=device(sinks[writer] * num_sinks + sink_positions),
            sink_window_rows=device(window_rows(slots[writer], sink_positions, block)),
            sinks_from_new=device(sinks[token_rows[sink_sources]] * num_sinks + positions[sink_sources]),
            sink_new_rows=device(sink_sources),
            tables=device(block_tables),
            window_slot_tensor=device(slots),
            sink_entry_tensor=device(sinks),
            sink_entries=sinks.tolist(),
            earlier_rows=[
                device(
                    window_rows(
                        slots[i], np.arange(first_window(int(computed[i]), block), computed[i]), block
                    )
                )
                for i in range(len(requests) - num_prefills, len(requests))
            ],
            computed=computed.tolist(),
        )

    def takes_trees(self, counts: list[int]) -> bool:
        """Whether this builder's backend verifies a step's token trees in place: one whose paged kernel
        takes tree masks (`takes_tree_masks`), every row of the step (`counts`: tokens each; a tree's
        root and drafts, other decodes and spans, prompt chunks) short enough to be a decode span there,
        since the masks cover decode spans only."""
        backend = self.attention_backend
        return (
            getattr(backend, "takes_tree_masks", False)
            and not self.kv_groups
            and not self.cache.sliding_window
            and max(counts) <= backend.max_decode_query_len
        )

    def _add_tree_masks(
        self, attention: AttentionMetadata, trees: dict[int, list[int]], seq_lens, starts: np.ndarray
    ) -> None:
        """Token trees (sample/token_tree.py): each tree's verify span gets its mask. A backend that takes
        tree masks reads them as bits over its decode spans (`decode_tree_masks`); otherwise the span is a
        prefill span here and the step runs this builder's backend, which must be the torch reference."""
        if self.kv_groups or self.cache.sliding_window:
            raise ValueError("token trees need no sliding window and no KV groups")
        if getattr(self.attention_backend, "takes_tree_masks", False):
            attention.decode_tree_masks = self._to_device(_tree_bits(trees, attention, starts))
            return
        if self.attention_backend.name != "torch":
            raise ValueError("token trees need the torch attention backend or one that takes tree masks")
        attention.backend = self.attention_backend
        num_decodes = len(seq_lens) - len(attention.prefills)
        for row, parents in trees.items():
            mask = _tree_mask(parents, int(seq_lens[row]))
            attention.prefills[row - num_decodes].tree_mask = self._to_device(mask)

    def _group_metadata(self, flat_tables, token_rows, positions, num_new, seq_lens, starts):
        """Group 0's metadata carrying the other groups': each from its columns of the flat tables."""
        metadata = []
        for index, group in enumerate(self.kv_groups):
            tables = np.ascontiguousarray(flat_tables[:, index :: len(self.kv_groups)])
            slot_mapping = self._slots(tables[token_rows, positions // self.block_size], positions)
            metadata.append(
                self.attention_metadata(tables, num_new, seq_lens, starts, slot_mapping, group.window, 0)
            )
        metadata[0].other_groups = tuple(metadata[1:])
        return metadata[0]

    def attention_metadata(
        self, block_tables, num_new, seq_lens, starts, slot_mapping, window=None, sinks=None
    ) -> AttentionMetadata:
        """One group's metadata; `window`, `sinks`: the group's (None: the engine's model-wide ones)."""
        num_decodes = int(np.count_nonzero(num_new <= self.attention_backend.max_decode_query_len))
        decode_query_starts = np.concatenate(([0], np.cumsum(num_new[:num_decodes])))
        cache = self.cache
        window = cache.sliding_window if window is None else window
        sinks = cache.attention_sinks if sinks is None else sinks
        decode_slots = decode_mask = None
        if num_decodes and self.attention_backend.needs_gathered_decode:
            context, valid = decode_context_positions(seq_lens[:num_decodes], sinks, window)
            decode_blocks = np.take_along_axis(block_tables[:num_decodes], context // self.block_size, axis=1)
            decode_slots = self._to_device(self._slots(decode_blocks, context))
            decode_mask = self._to_device(valid)[:, None, None, :]
        prefills = [
            self._prefill_span(
                block_tables[i], int(starts[i]), int(num_new[i]), int(seq_lens[i]), window, sinks
            )
            for i in range(num_decodes, len(num_new))
        ]
        return AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            num_decode_tokens=int(decode_query_starts[-1]),
            decode_context_slots=decode_slots,
            decode_context_mask=decode_mask,
            prefills=prefills,
            decode_block_tables=self._to_device(block_tables[:num_decodes]) if num_decodes else None,
            decode_seq_lens=self._to_device(seq_lens[:num_decodes]) if num_decodes else None,
            decode_query_starts=self._to_device(decode_query_starts) if num_decodes else None,
            block_size=self.block_size,
            sliding_window=window,
            attention_sinks=sinks,
        )

    def _prefill_span(
        self, block_table: np.ndarray, start: int, num_new: int, seq_len: int, window: int, sinks: int
    ) -> PrefillSpan:
        """A sequence's queries and its context slots: all positions, or with a sliding window only
        the live ones (sinks and window; their blocks are the ones still in the table)."""
        live = prefill_context_positions(seq_len, num_new, sinks, window)
        positions = np.arange(seq_len) if live is None else live
        slots = self._slots(block_table[positions // self.block_size], positions)
        return PrefillSpan(
            query_start=start,
            query_end=start + num_new,
            context_slots=self._to_device(slots),
            context_positions=None if live is None else self._to_device(live),
        )

    def _block_tables(self, requests: list[BatchRow], max_len: int) -> np.ndarray:
        """[requests, columns] of their tables (with groups: interleaved, as the plan carries them)."""
        num_columns = -(-max_len // self.block_size) * max(len(self.kv_groups), 1)
        tables = np.zeros((len(requests), num_columns), dtype=np.int64)
        for row, request in enumerate(requests):
            table = request.block_ids[:num_columns]
            tables[row, : len(table)] = table
        return tables

    def _slots(self, blocks: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """KV slot of each position, given the block id holding it (same shapes)."""
        return blocks * self.block_size + positions % self.block_size

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)


def _logits_indices(ends: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Flat indices of the tokens whose logits are needed: each sampling request's last token, and
    with k drafts its last k + 1 tokens (speculative decoding verifies every draft position)."""
    counts = num_drafts + 1
    firsts = np.repeat(ends - counts, counts)
    return firsts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _tree_positions(positions: np.ndarray, trees: dict[int, list[int]], ends, computed) -> np.ndarray:
    """Rotary positions: a tree's drafts (the last n tokens of its span) sit at the root's position
    plus their depth, not at their index."""
    positions = positions.copy()
    for row, parents in trees.items():
        end = int(ends[row])
        positions[end - len(parents) : end] = computed[row] + tree_shape(parents).depth
    return positions


def _tree_bits(trees: dict[int, list[int]], attention: AttentionMetadata, starts: np.ndarray) -> np.ndarray:
    """[num_decode_tokens] int64 masks for a paged kernel: -1 (every earlier token of its span: causal)
    for rows without a tree; a tree's root 0 (nothing before it in its span), draft i its span's token 0
    (the root) and tokens 1 + j for its ancestors j (itself among them). `starts`: each row's first token."""
    if attention.prefills:
        raise ValueError("token trees in a paged kernel must all be decode spans")
    bits = np.full(attention.num_decode_tokens, -1, dtype=np.int64)
    for row, parents in trees.items():
        ancestors = tree_shape(parents).ancestors  # [n, n]: draft j is draft i or an ancestor
        weights = np.left_shift(np.int64(1), np.arange(1, 1 + len(parents), dtype=np.int64))
        first = int(starts[row])
        bits[first] = 0
        bits[first + 1 : first + 1 + len(parents)] = 1 | (ancestors.astype(np.int64) @ weights)
    return bits


def _tree_mask(parents: list[int], seq_len: int) -> np.ndarray:
    """[1 + n, seq_len] bool for a tree's verify span (root, then its n drafts in slot order): every
    query sees the context and the root; a draft sees its ancestors and itself among the drafts."""
    num_drafts = len(parents)
    mask = np.ones((1 + num_drafts, seq_len), dtype=bool)
    mask[:, seq_len - num_drafts :] = False
    mask[1:, seq_len - num_drafts :] = tree_shape(parents).ancestors
    return mask
