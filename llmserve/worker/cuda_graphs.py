"""Decode steps on static buffers, replayed as CUDA graphs: one graph per padded batch size.

Why: a decode step issues a few hundred short kernels, and for all but large batches their launches,
not the reading of the weights, set the step's time on a GPU; a captured graph issues them in one
launch. A graph replays the same kernels on the same addresses and shapes, so a decode step here:
- stages its inputs (token ids, positions, KV slots, context lengths, block tables) in one pinned
  host array and moves them to persistent device buffers in one host-to-device copy; each batch
  size reads a prefix of them (query starts, one row per sequence, are written once);
- is padded up to the next captured size (1, 2, 4, 8, then every 8 up to max_num_seqs, as vLLM's);
  a padded row writes its K/V into a scratch block past the pool's blocks, which the block manager
  never hands out, and attends to that one slot, so it never touches a request's KV;
- runs the model from the embedding to the final norm and the logits of every row, copied into
  output buffers shared by all sizes (each size's own logits would hold sizes x vocabulary floats).
The attention backend reads the block tables in place (the Triton kernel on CUDA): shapes alone
choose its launch.

`DecodeGraphs.run_static` is that step on the static buffers. `capture` records it once per size at
start-up, and `run` replays it; without a capture (off CUDA: the tests) `run` calls it directly,
the same operations on the same buffers. What a graph cannot hold runs eagerly: steps with prompt
chunks, verify spans or rows that do not sample, and engines whose runner takes no static step
(`ModelRunner._uses_static_decode`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from llmserve.config import EngineConfig
from llmserve.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger("llmserve")

_FIRST_SIZES = (1, 2, 4)  # then every _SIZE_STEP rows up to max_num_seqs
_SIZE_STEP = 8


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8, ending with max_num_seqs itself."""
    steps = range(_SIZE_STEP, max_num_seqs, _SIZE_STEP)
    return sorted({*(s for s in (*_FIRST_SIZES, *steps) if s < max_num_seqs), max_num_seqs})


@dataclass(frozen=True)
class StaticInputs:
    """A padded size's views of the static device buffers, as a step's inputs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    rows: torch.Tensor  # 0..size-1: the flat index of each row's token (every row samples)


class _Staging:
    """One int64 array, pinned on the host and mirrored on the device: token ids, positions, slots
    and context lengths (`max_rows` each), then the [max_rows, columns] block tables, last, so that
    a step of `rows` rows copies one prefix."""

    def __init__(self, max_rows: int, columns: int, device: torch.device) -> None:
        self.max_rows, self.columns = max_rows, columns
        length = 4 * max_rows + max_rows * columns
        self.host = torch.zeros(length, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device = torch.zeros(length, dtype=torch.int64, device=device)
        self.host_fields = self._fields(self.host.numpy())
        self.device_fields = self._fields(self.device)

    def _fields(self, array):
        """(token ids, positions, slots, context lengths, block tables) views of a staging array."""
        m = self.max_rows
        vectors = tuple(array[i * m : (i + 1) * m] for i in range(4))
        return (*vectors, array[4 * m :].reshape(m, self.columns))

    def copy(self, rows: int) -> None:
        """The one host-to-device copy of a step of `rows` rows."""
        used = 4 * self.max_rows + rows * self.columns
        self.device[:used].copy_(self.host[:used], non_blocking=True)


class DecodeGraphs:
    """The static decode step's buffers and, on CUDA, its captured graphs (one per batch size)."""

    def __init__(self, model: nn.Module, config: EngineConfig, scratch_block: int) -> None:
        self.model = model
        scheduler, cache, arch = config.scheduler, config.cache, config.model.arch
        self.device = config.model.device
        self.sizes = capture_sizes(scheduler.max_num_seqs)
        self.block_size = cache.block_size
        self.scratch_block = scratch_block  # padded rows' K/V go to its first slot
        max_rows = self.sizes[-1]
        self._staging = _Staging(max_rows, -(-scheduler.max_model_len // cache.block_size), self.device)
        self._hidden = torch.zeros(max_rows, arch.hidden_size, dtype=config.model.dtype, device=self.device)
        self._logits = torch.zeros(max_rows, arch.vocab_size, dtype=torch.float32, device=self.device)
        rows = torch.arange(max_rows + 1, device=self.device)  # query starts: one token per sequence
        self._inputs = {
            size: self._views(size, rows, cache.sliding_window, cache.attention_sinks) for size in self.sizes
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # CUDA: marks the last step's copy out of the pinned array
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None

    @classmethod
    def create(cls, model: nn.Module, config: EngineConfig, scratch_block: int) -> DecodeGraphs:
        """The static decode step over a model whose attention layers are bound to the pool; on CUDA
        captured for every size now."""
        graphs = cls(model, config, scratch_block)
        if graphs.device.type == "cuda":
            graphs.capture()
        return graphs

    def _views(self, size: int, rows: torch.Tensor, window: int, sinks: int) -> StaticInputs:
        """Size `size`'s prefixes of the device buffers, and its attention metadata over them."""
        token_ids, positions, slots, seq_lens, tables = self._staging.device_fields
        metadata = AttentionMetadata(
            slot_mapping=slots[:size],
            num_decode_tokens=size,
            decode_context_slots=None,
            decode_context_mask=None,
            prefills=[],
            decode_block_tables=tables[:size],
            decode_seq_lens=seq_lens[:size],
            decode_query_starts=rows[: size + 1],
            block_size=self.block_size,
            sliding_window=window,
            attention_sinks=sinks,
        )
        return StaticInputs(token_ids[:size], positions[:size], metadata, rows[:size])

    def serves(self, rows: Sequence[tuple]) -> bool:
        """Whether a step's (request, new tokens) rows are a decode step a graph holds: one token
        each (no drafts), every row sampling (caught up), no embedding, at most the largest size."""
        return len(rows) <= self.sizes[-1] and all(
            count == 1
            and request.num_computed_tokens + 1 == request.num_tokens
            and not request.spec_token_ids
            and not getattr(request, "pooling", False)
            for request, count in rows
        )

    def stage(self, requests: Sequence) -> StaticInputs:
        """Write the decode step of `requests` (each catching up by its last token) to the static
        buffers, padded to the next captured size: that size's inputs."""
        num = len(requests)
        size = next(s for s in self.sizes if s >= num)
        if self._copied is not None:
            self._copied.synchronize()  # done by now: the last step's sampled tokens came after it
        token_ids, positions, slots, seq_lens, tables = self._staging.host_fields
        computed = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=num)
        token_ids[:num] = [r.all_token_ids[-1] for r in requests]
        positions[:num] = computed
        seq_lens[:num] = computed + 1
        columns = self._staging.columns
        for row, request in enumerate(requests):  # a loop over requests, as InputBuilder.build's
            table = request.block_ids[:columns]
            tables[row, : len(table)] = table
        blocks = tables[np.arange(num), computed // self.block_size]
        slots[:num] = blocks * self.block_size + computed % self.block_size
        self._pad(num, size)
        self._staging.copy(size)
        if self._copied is not None:
            self._copied.record()
        return self._inputs[size]

    def _pad(self, start: int, stop: int) -> None:
        """Rows start..stop-1 as padding: token 0 at position 0 in the scratch block's first slot,
        a context of that one slot."""
        token_ids, positions, slots, seq_lens, tables = self._staging.host_fields
        token_ids[start:stop] = positions[start:stop] = 0
        slots[start:stop] = self.scratch_block * self.block_size
        seq_lens[start:stop] = 1
        tables[start:stop, 0] = self.scratch_block

    def run_static(self, size: int) -> None:
        """The decode step of `size` rows on the static buffers: final hidden states and float32
        logits of every row into the output buffers. What a graph captures: no host sync, and the
        same operations on the same shapes whatever the batch holds."""
        inputs = self._inputs[size]
        with set_forward_context(inputs.attention):
            hidden = self.model(inputs.input_ids, inputs.positions)
        self._hidden[:size].copy_(hidden)
        self._logits[:size].copy_(self.model.compute_logits(hidden))

    def run(self, size: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged step (graph replay where captured): the first `num_rows` rows' final hidden
        states and logits, views of the output buffers, which the next step overwrites."""
        graph = self._graphs.get(size)
        if graph is None:
            self.run_static(size)
        else:
            graph.replay()
        return self._hidden[:num_rows], self._logits[:num_rows]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size's step, the largest first (the smaller ones reuse its memory pool)."""
        start = time.monotonic()
        self._pad(0, self.sizes[-1])  # warm-up and capture runs touch only the scratch block
        self._staging.copy(self.sizes[-1])
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # a capture runs on a side stream
        for size in reversed(self.sizes):
            self.run_static(size)  # warm-up: Triton compiles, cuBLAS picks, outside the capture
            try:
                self._graphs[size] = self._capture(size, pool, stream)
            except RuntimeError as error:  # a host sync or a data-dependent shape in the step
                raise RuntimeError(
                    f"capturing the decode step of {size} rows in a CUDA graph failed ({error}); "
                    "--enforce-eager runs every step without graphs"
                ) from error
        torch.cuda.synchronize(self.device)
        logger.info(
            "CUDA graphs: %d decode batch sizes (1 to %d) captured in %.2f s",
            len(self.sizes),
            self.sizes[-1],
            time.monotonic() - start,
        )

    def _capture(self, size: int, pool, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        """`run_static(size)` recorded on `stream` into the shared memory `pool`."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph, which collects garbage at every size
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                self.run_static(size)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph
