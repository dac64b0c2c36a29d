"""Request-level (static) batching: the baseline that continuous batching is measured against."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from llmserve.forward_context import AttentionMetadata, PrefillSpan, set_forward_context
from llmserve.sample.sampler import greedy_token_ids


@dataclass
class NaiveBatchStats:
    """Tokens the batches computed against tokens anyone asked for: the waste, counted."""

    num_requests: int = 0
    num_groups: int = 0
    prompt_tokens: int = 0  # real prompt tokens
    prefill_tokens: int = 0  # prompt positions computed, right padding included
    output_tokens: int = 0  # tokens returned (each request's own max_tokens)
    decode_tokens: int = 0  # decode rows computed, rows that had already finished included


class NaiveBatchRunner:
    """Runs requests B at a time, the way servers batched before continuous batching.

    Requests are grouped in arrival order, B per group. A group's prompts are right-padded to its
    longest prompt and prefilled in one forward: the pad tokens are computed, that is the padding
    waste. The whole group then decodes, one token per row per step, until its longest request is
    done; rows that finished earlier keep being computed and their tokens are thrown away, since a
    static batch cannot change shape, and no waiting request can start until the group ends. Row r
    owns the contiguous KV slots [r*L, (r+1)*L) of a buffer allocated once per group, with
    L = longest prompt + largest max_tokens rounded up to whole blocks: its block table is a run of
    consecutive blocks.

    It is the honest baseline because only the batching policy differs from the engine: the same
    model object and weights, the same attention backend the engine selected (given the metadata
    both gathering and in-place backends read), decode rows batched into one attention call, greedy
    argmax of the same logits, no per-token Python. Right padding is safe under causal attention: a
    row's pad tokens come after its real ones, so no real token attends to them, its logits are read
    at its own last real position, and its decode tokens overwrite the pad KV in place (decode
    attention covers only the row's own length).
    """

    def __init__(self, model: nn.Module, block_size: int = 16, pad_token_id: int = 0) -> None:
        self.model = model
        self.layers = model.attention_layers()
        backend = self.layers[0].backend
        self.gathered_decode = getattr(backend, "needs_gathered_decode", True)
        # the longest span the backend attends to in place, as the engine's input builder sends it
        # (every span under --deterministic: a prompt's rows then equal their decodes)
        self.max_in_place_span = 0 if self.gathered_decode else backend.max_decode_query_len
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self.block_size = block_size
        self.pad_token_id = pad_token_id

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], batch_size: int, progress=None
    ) -> tuple[list[list[int]], NaiveBatchStats]:
        """Greedy tokens of every request (exactly its max_tokens, EOS ignored), in request order."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        outputs: list[list[int]] = []
        stats = NaiveBatchStats()
        for start in range(0, len(prompts), batch_size):
            group_prompts = prompts[start : start + batch_size]
            group_max_tokens = max_tokens[start : start + batch_size]
            outputs += self._run_group(group_prompts, group_max_tokens)
            _count_group(stats, group_prompts, group_max_tokens)
            if progress is not None:
                progress.update(len(group_prompts))
        return outputs, stats

    def _run_group(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        steps = max(max_tokens)
        row_len = -(-(int(lens.max()) + steps) // self.block_size) * self.block_size
        layout = _RowLayout(len(prompts), row_len, self.block_size, self.device)
        with self._bound_cache(len(prompts) * row_len):
            first = self._prefill(prompts, lens, layout)
            tokens = self._decode(first, lens, layout, steps)
        return [row[:count] for row, count in zip(tokens.tolist(), max_tokens, strict=True)]

    @contextmanager
    def _bound_cache(self, num_slots: int) -> Iterator[None]:
        """Point every attention layer at a fresh contiguous buffer; give the engine's pool back after.

        Zeroed, not empty: masked-out context slots are still multiplied by zero attention weights,
        and 0 * NaN from uninitialized memory would poison the row.
        """
        first = self.layers[0]
        kv_format = first.backend.kv_format  # the engine's --kv-cache-dtype: 8-bit rows carry their scale
        buffer = torch.zeros(
            len(self.layers),
            2,
            num_slots,
            first.num_kv_heads,
            kv_format.row_size(first.head_dim),
            dtype=kv_format.storage_dtype(self.dtype),
            device=self.device,
        )
        saved = [(layer.key_cache, layer.value_cache) for layer in self.layers]
        for index, layer in enumerate(self.layers):
            layer.key_cache, layer.value_cache = buffer[index, 0], buffer[index, 1]
        try:
            yield
        finally:
            for layer, (key_cache, value_cache) in zip(self.layers, saved, strict=True):
                layer.key_cache, layer.value_cache = key_cache, value_cache

    def _prefill(
        self, prompts: Sequence[Sequence[int]], lens: torch.Tensor, layout: _RowLayout
    ) -> torch.Tensor:
        """One forward over the right-padded group; the first generated token of every row."""
        batch, width = len(prompts), int(lens.max())
        padded = np.full((batch, width), self.pad_token_id, dtype=np.int64)
        for row, prompt in enumerate(prompts):
            padded[row, : len(prompt)] = prompt
        input_ids = torch.from_numpy(padded).to(self.device).flatten()
        columns = torch.arange(width, device=self.device)
        if width <= self.max_in_place_span:
            metadata = layout.span_metadata(width)
        else:
            metadata = layout.prefill_metadata(width)
        with set_forward_context(metadata):
            hidden = self.model(input_ids, columns.repeat(batch))
        last_real = torch.arange(batch, device=self.device) * width + lens - 1
        return greedy_token_ids(self.model.compute_logits(hidden[last_real]))

    def _decode(
        self, first: torch.Tensor, lens: torch.Tensor, layout: _RowLayout, steps: int
    ) -> torch.Tensor:
        """Decode every row for `steps - 1` more tokens; returns [batch, steps] token ids."""
        tokens = [first]
        for step in range(steps - 1):
            positions = lens + step  # token `step` sits right after the row's own real tokens
            metadata = layout.decode_metadata(positions, int(lens.max()) + step + 1, self.gathered_decode)
            with set_forward_context(metadata):
                hidden = self.model(tokens[-1], positions)
            tokens.append(greedy_token_ids(self.model.compute_logits(hidden)))
        return torch.stack(tokens, dim=1)


class _RowLayout:
    """Row r's KV lives in slots [r*L, (r+1)*L): consecutive blocks r*L/bs ... (r+1)*L/bs - 1."""

    def __init__(self, batch: int, row_len: int, block_size: int, device: torch.device) -> None:
        self.row_len = row_len
        self.row_base = torch.arange(batch, device=device) * row_len
        self.context = torch.arange(row_len, device=device)
        self.block_size = block_size
        blocks_per_row = row_len // block_size
        self.block_tables = torch.arange(batch, device=device)[:, None] * blocks_per_row + torch.arange(
            blocks_per_row, device=device
        )

    def prefill_metadata(self, width: int) -> AttentionMetadata:
        """Every row's first `width` positions as a prefill span over its own slots."""
        slots = (self.row_base[:, None] + self.context[:width]).flatten()
        batch = len(self.row_base)
        spans = [
            PrefillSpan(r * width, (r + 1) * width, slots[r * width : (r + 1) * width]) for r in range(batch)
        ]
        return AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=0,
            decode_context_slots=None,
            decode_context_mask=None,
            prefills=spans,
            block_size=self.block_size,
        )

    def span_metadata(self, width: int) -> AttentionMetadata:
        """The same positions as in-place spans through the block tables (an in-place backend's
        short rows, or every row under --deterministic)."""
        batch = len(self.row_base)
        return AttentionMetadata(
            slot_mapping=(self.row_base[:, None] + self.context[:width]).flatten(),
            num_decode_tokens=batch * width,
            decode_context_slots=None,
            decode_context_mask=None,
            prefills=[],
            decode_block_tables=self.block_tables,
            decode_seq_lens=torch.full((batch,), width, device=self.row_base.device),
            decode_query_starts=torch.arange(batch + 1, device=self.row_base.device) * width,
            block_size=self.block_size,
        )

    def decode_metadata(self, positions: torch.Tensor, context_len: int, gathered: bool) -> AttentionMetadata:
        """One decode token per row at `positions`; gathered slots and mask only if the backend reads them."""
        context = self.context[:context_len]
        return AttentionMetadata(
            slot_mapping=self.row_base + positions,
            num_decode_tokens=len(positions),
            decode_context_slots=self.row_base[:, None] + context if gathered else None,
            decode_context_mask=(context <= positions[:, None])[:, None, None, :] if gathered else None,
            prefills=[],
            decode_block_tables=self.block_tables,
            decode_seq_lens=positions + 1,
            block_size=self.block_size,
        )


def _count_group(stats: NaiveBatchStats, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> None:
    batch, width, steps = len(prompts), max(len(p) for p in prompts), max(max_tokens)
    stats.num_requests += batch
    stats.num_groups += 1
    stats.prompt_tokens += sum(len(p) for p in prompts)
    stats.prefill_tokens += batch * width
    stats.output_tokens += sum(max_tokens)
    stats.decode_tokens += batch * (steps - 1)
