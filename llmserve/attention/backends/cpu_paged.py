"""CPU attention that reads the paged KV cache in place for decodes and short spans (compiled kernel).

Sequences with at most `max_decode_query_len` query tokens this step (decodes, speculative
verification of k drafts, short prompt tails) go to one `paged_attention` call, which walks each
sequence's block table directly; no padded copy of any context is gathered, and no mask is built.
It dequantizes 8-bit caches as it reads them (8 lanes at a time where AVX2 is, float32 and bf16
models alike) and visits only the sinks and the window when a sliding window is on.

Longer prefill spans are compute-bound: with a bfloat16 cache on an AVX-512 BF16 CPU, or a float32
cache on an AVX2 CPU, they go to `prefill_attention`, a blocked causal kernel that reads the context
through its slots (no gathered copy); anything else (8-bit caches, a sliding window, other dtypes)
keeps the reference SDPA path.
"""

from __future__ import annotations

import torch

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.forward_context import AttentionMetadata, PrefillSpan
from llmserve.kernels.cpu_ops import load_cpu_ops


class CPUPagedBackend(TorchSDPABackend):
    name = "cpu_paged"
    needs_gathered_decode = False
    # A verify pass of up to 15 drafts stays in this kernel; longer spans are matmul-shaped (_prefill).
    max_decode_query_len = 16

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        super().__init__(kv_cache_dtype)
        self.ops = load_cpu_ops()
        if self.ops is None:
            raise RuntimeError("the compiled CPU attention kernel could not be built")
        plain_cache = self.kv_format.kernel_code == 0
        self.fast_prefill_dtypes = {
            dtype
            for dtype in (torch.bfloat16, torch.float32)
            if plain_cache and self.ops.prefill_attention_supported(dtype)
        }

    def _decode(
        self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float, window=0, softcap=0.0
    ) -> torch.Tensor:
        query_starts = metadata.query_starts(query.shape[0], query.device)
        return self.ops.paged_attention(
            query.contiguous(),
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            query_starts,
            metadata.block_size,
            scale,
            self.kv_format.kernel_code,
            metadata.attention_sinks,
            window,  # the engine's window, or a layer's own over the whole context (sinks then 0)
        )

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
