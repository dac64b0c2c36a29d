"""CPU attention that reads the paged KV cache in place for decodes and short spans (compiled kernel).

Sequences with at most `max_decode_query_len` query tokens this step (decodes, speculative
verification of k drafts, short prompt tails) go to one `paged_attention` call, which walks each
sequence's block table directly; no padded copy of any context is gathered, and no mask is built (a
token tree's verify span is one too: each query's ancestors as bits, `decode_tree_masks`).
It dequantizes 8-bit caches as it reads them (8 lanes at a time where AVX2 is, float32 and bf16
models alike) and visits only the sinks and the window when a sliding window is on.

Longer prefill spans are compute-bound: with a bfloat16 or float32 cache they go to
`prefill_attention`, a blocked causal kernel that reads the context through its slots (no gathered
copy): bf16 products on AVX-512 BF16 or AMX, else float32 arithmetic on AVX2 and FMA
(`prefill_attention_path`); anything else (8-bit caches, a sliding window, other dtypes) keeps the
reference SDPA path.

int4 and int2 caches (attention/low_bit.py): decodes go to `paged_attention_low_bit`, which reads
the packed codes, the sequences' full-precision windows and their sinks in place; every longer span
(`max_decode_query_len` 1) runs `prefill_attention` in pieces over a dequantized copy of their
context; a combination the kernels do not take runs the torch reference.

Batch invariance (`serve_every_span`, worker/batch_invariance.py): the two kernels sum in different
orders, so a prompt token's attention would depend on the length of the chunk it came in. There every
span goes to `paged_attention`, whose query rows each give what a decode of them gives, cut into pieces
of at most 16 queries (one sequence's piece per `paged_attention` sequence) so that its per-row score
buffers stay the size of a verification's.
"""

from __future__ import annotations

import sys

import torch

from llmserve.attention import low_bit
from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.config.kv_cache_dtype import LOW_BIT_SINK_TOKENS, LOW_BIT_WINDOW_BLOCKS
from llmserve.forward_context import AttentionMetadata, PrefillSpan
from llmserve.kernels.cpu_ops import load_cpu_ops


class CPUPagedBackend(TorchSDPABackend):
    name = "cpu_paged"
    needs_gathered_decode = False
    # A verify pass of up to 15 drafts stays in this kernel; longer spans are matmul-shaped (_prefill).
    max_decode_query_len = 16
    piece_len = 0  # > 0: every span in the paged kernel, in pieces of this many queries at most
    takes_tree_masks = True  # token trees' verify spans as decode spans, each draft seeing its ancestors

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        super().__init__(kv_cache_dtype)
        self.ops = load_cpu_ops()
        if self.ops is None:
            raise RuntimeError("the compiled CPU attention kernel could not be built")
        plain_cache = self.kv_format.kernel_code == 0
        # what prefill_attention takes (plain rows: a low-bit cache's spans are dequantized for it)
        self.ops_prefill_dtypes = {
            dtype for dtype in (torch.bfloat16, torch.float32) if self.ops.prefill_attention_supported(dtype)
        }
        if self.kv_format.is_low_bit:
            self.max_decode_query_len = 1  # spans: the reference (low_bit.prefill)
            self.takes_tree_masks = False
        self.fast_prefill_dtypes = {
            dtype
            for dtype in (torch.bfloat16, torch.float32)
            if plain_cache and self.ops.prefill_attention_supported(dtype)
        }

    def serve_every_span(self) -> None:
        """Batch invariance: prompt chunks too in the paged kernel (module docstring); not over an
        int4/int2 cache, whose spans take the reference (worker/batch_invariance.py says so)."""
        if self.kv_format.is_low_bit:
            return
        self.piece_len = type(self).max_decode_query_len
        self.max_decode_query_len = sys.maxsize
        self.takes_tree_masks = False  # (trees are refused under --deterministic anyway)
        self._pieces: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def _decode(
        self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float, window=0, softcap=0.0
    ) -> torch.Tensor:
        query_starts = metadata.query_starts(query.shape[0], query.device)
        tables, seq_lens = metadata.decode_block_tables, metadata.decode_seq_lens
        if self.piece_len:
            tables, seq_lens, query_starts = self._span_pieces(tables, seq_lens, query_starts)
        return self.ops.paged_attention(
            query.contiguous(),
            key_cache,
            value_cache,
            tables,
            seq_lens,
            query_starts,
            metadata.block_size,
            scale,
            self.kv_format.kernel_code,
            metadata.attention_sinks,
            window,  # the engine's window, or a layer's own over the whole context (sinks then 0)
            metadata.decode_tree_masks,
        )

    def _low_bit_prefill(self, query, span: low_bit.LowBitSpan, scale: float, softcap: float) -> torch.Tensor:
        """The span in pieces whose queries share a window start (low_bit.prefill_segments), each piece's
        context dequantized into plain rows for the prefill kernel."""
        if softcap or query.dtype not in self.ops_prefill_dtypes or query.shape[-1] not in (64, 128):
            return super()._low_bit_prefill(query, span, scale, softcap)
        out = torch.empty_like(query)
        for first, end, keys, values in low_bit.prefill_segments(self.kv_format, span):
            slots = torch.arange(keys.shape[0], device=query.device)
            out[first:end] = self.ops.prefill_attention(query[first:end], keys, values, slots, scale)
        return out

    def _low_bit_decode(
        self, query, key_cache, value_cache, recent, metadata: AttentionMetadata, scale, softcap
    ):
        group = query.shape[1] // key_cache.shape[1]
        if (
            softcap
            or group > 16
            or not self.ops.paged_attention_low_bit_supported(query.dtype, query.shape[-1])
        ):
            return super()._low_bit_decode(query, key_cache, value_cache, recent, metadata, scale, softcap)
        plan = metadata.recent_kv
        num = metadata.decode_seq_lens.shape[0]
        return self.ops.paged_attention_low_bit(
            query.contiguous(),
            key_cache,
            value_cache,
            *recent,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            plan.window_slot_tensor[:num],
            plan.sink_entry_tensor[:num],
            metadata.block_size,
            LOW_BIT_WINDOW_BLOCKS,
            LOW_BIT_SINK_TOKENS,
            scale,
            self.kv_format.bits,
        )

    def _span_pieces(
        self, tables: torch.Tensor, seq_lens: torch.Tensor, query_starts: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The step's spans cut into pieces of `piece_len` queries, once per step (every layer reads
        the same metadata; the last step's answer is kept while its seq_lens tensor is the one given)."""
        if self._pieces is None or self._pieces[0] is not seq_lens:
            self._pieces = (seq_lens, span_pieces(tables, seq_lens, query_starts, self.piece_len))
        return self._pieces[1]

    def _prefill(
        self,
        query,
        key_cache,
        value_cache,
        span: PrefillSpan,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if (
            query.dtype in self.fast_prefill_dtypes
            and key_cache.dtype == query.dtype
            and query.shape[-1] in (64, 128)
            and span.context_positions is None
            and not window
            and not softcap
        ):
            return self.ops.prefill_attention(query, key_cache, value_cache, span.context_slots, scale)
        return super()._prefill(query, key_cache, value_cache, span, metadata, scale, window, softcap)


def span_pieces(
    tables: torch.Tensor, seq_lens: torch.Tensor, query_starts: torch.Tensor, piece_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block tables, context lengths, query starts) with every span of more than `piece_len` queries
    cut into consecutive pieces of `piece_len` (the last shorter): piece j of a span of n queries over
    a context of length L is a span of its queries over the first L - n + (its end) positions, reading
    the same block table. Unchanged where no span is longer."""
    counts = query_starts[1:] - query_starts[:-1]
    if int(counts.max()) <= piece_len:
        return tables, seq_lens, query_starts
    pieces = (counts + piece_len - 1) // piece_len
    owner = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), pieces)
    first_piece = torch.repeat_interleave(pieces.cumsum(0) - pieces, pieces)
    index = torch.arange(len(owner), device=counts.device) - first_piece  # the piece's place in its span
    end = torch.minimum((index + 1) * piece_len, counts[owner])  # queries of the span up to its end
    piece_counts = end - index * piece_len
    starts = torch.cat([query_starts[:1], query_starts[0] + piece_counts.cumsum(0)])
    return tables[owner].contiguous(), seq_lens[owner] - counts[owner] + end, starts
