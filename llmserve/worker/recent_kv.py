"""The full-precision parts of a 4-bit or 2-bit KV cache (attention/kv_format.py: KIVI).

Keys of such a cache are quantized per channel over a whole block, so a block is quantized only once
its last row is written, and a query reads its sequence's most recent blocks in full precision (the
window) and its first tokens (the attention sinks) too. Both are kept here, in the model's dtype, in every
layer:
- the window: LOW_BIT_WINDOW_BLOCKS blocks of rows per request, a ring (block j of a sequence at place
  j % LOW_BIT_WINDOW_BLOCKS). A request keeps its window slot from its first step to its end, and one
  preempted (by recomputing: swapping is refused) rewrites it.
- the sinks: the K/V of positions 0 .. LOW_BIT_SINK_TOKENS - 1, one entry per first block of the pool
  (the block holding them, whose rows there are out of its ranges). A sequence writes its entry when
  its first span of window blocks completes (until then those positions are in its window); a request
  whose first spans come from the prefix cache shares that block, and finds the entry under it (an
  adapter's or another start's block is another block). An entry goes when its block is quantized
  again, i.e. reused: entries are at most the first blocks alive in the pool, used or cached. Entries
  made by a step that fails are dropped (`forget_step`); the next step keeps them.
Slots and entries are handed out as they are needed; when all are taken the tensors grow (double, rows
copied over) and every attention layer is given views of the new ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from llmserve.config.kv_cache_dtype import LOW_BIT_SINK_TOKENS, LOW_BIT_WINDOW_BLOCKS


class RecentKV:
    def __init__(
        self,
        layers: Sequence,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 8,
    ) -> None:
        self.layers = list(layers)
        self.block_size = block_size
        self.window_blocks = LOW_BIT_WINDOW_BLOCKS
        self.sink_tokens = LOW_BIT_SINK_TOKENS
        self.slot_rows = self.window_blocks * block_size  # window rows per request
        self._row_shape = (self.layers[0].num_kv_heads, head_dim) if self.layers else (0, head_dim)
        self.dtype, self.device = dtype, device
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._sink_of: dict[int, int] = {}  # a sequence's first pool block -> its sink entry
        self._free_entries: list[int] = []
        self._made: list[int] = []  # first blocks whose entries the last step made
        # [layers, K/V, rows, kv_heads, head_dim]: the windows' rows, and the sinks' (sink_tokens each)
        self.windows = self._empty(0)
        self.sinks = self._empty(0)
        self._grow_windows(slots)
        self._grow_sinks(4)

    @property
    def num_slots(self) -> int:
        return self.windows.shape[2] // self.slot_rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.windows, self.sinks))

    def slots(self, request_ids: Iterable[str]) -> np.ndarray:
        """Each request's window slot (given one on its first step)."""
        out = []
        for request_id in request_ids:
            slot = self._slot_of.get(request_id)
            if slot is None:
                if not self._free:
                    self._grow_windows(2 * self.num_slots)
                slot = self._slot_of[request_id] = self._free.pop()
            out.append(slot)
        return np.asarray(out, dtype=np.int64)

    def sink_entries(self, first_blocks: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each first block's sink entry, and whether it was made now (to be written this step)."""
        self._made = []  # the last step's entries stand: it did not fail
        entries, made = [], []
        for block in first_blocks:
            entry = self._sink_of.get(block)
            made.append(entry is None)
            if entry is None:
                if not self._free_entries:
                    self._grow_sinks(2 * (self.sinks.shape[2] // self.sink_tokens))
                entry = self._sink_of[block] = self._free_entries.pop()
                self._made.append(block)
            entries.append(entry)
        return np.asarray(entries, dtype=np.int64), np.asarray(made, dtype=bool)

    def drop_sinks(self, blocks: Iterable[int]) -> None:
        """Blocks quantized now: any entry under them belonged to their previous content."""
        for block in blocks:
            entry = self._sink_of.pop(block, None)
            if entry is not None:
                self._free_entries.append(entry)

    def forget_step(self) -> None:
        """The step failed: the entries it made may be partly written."""
        self.drop_sinks(self._made)
        self._made = []

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def _empty(self, rows: int) -> torch.Tensor:
        return torch.zeros(len(self.layers), 2, rows, *self._row_shape, dtype=self.dtype, device=self.device)

    def _grow_windows(self, slots: int) -> None:
        first_new = self.num_slots
        self.windows = self._copied(self.windows, slots * self.slot_rows)
        self._free.extend(reversed(range(first_new, slots)))  # low slots first
        self._bind()

    def _grow_sinks(self, entries: int) -> None:
        first_new = self.sinks.shape[2] // self.sink_tokens
        self.sinks = self._copied(self.sinks, entries * self.sink_tokens)
        self._free_entries.extend(reversed(range(first_new, entries)))
        self._bind()

    def _copied(self, old: torch.Tensor, rows: int) -> torch.Tensor:
        new = self._empty(rows)
        new[:, :, : old.shape[2]] = old
        return new

    def _bind(self) -> None:
        for index, layer in enumerate(self.layers):
            layer.recent_kv = (
                self.windows[index, 0],
                self.windows[index, 1],
                self.sinks[index, 0],
                self.sinks[index, 1],
            )
