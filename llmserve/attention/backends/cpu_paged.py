"""CPU attention that reads the paged KV cache in place for decodes (compiled kernel).

Decode rows go to `paged_decode_attention`, which walks each sequence's block table directly; no
padded copy of every context is gathered. It dequantizes 8-bit caches row by row and visits only
the sinks and the window when a sliding window is on. Prefill spans (compute-bound, few per step)
keep the reference SDPA path.
"""

from __future__ import annotations

import torch

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.attention.cpu_ops import load_cpu_ops
from llmserve.worker.forward_context import AttentionMetadata


class CPUPagedBackend(TorchSDPABackend):
    name = "cpu_paged"
    needs_gathered_decode = False

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        super().__init__(kv_cache_dtype)
        self.ops = load_cpu_ops()
        if self.ops is None:
            raise RuntimeError("the compiled CPU attention kernel could not be built")

    def _decode(
        self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return self.ops.paged_decode_attention(
            query.contiguous(),
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            metadata.block_size,
            scale,
            self.kv_format.kernel_code,
            metadata.attention_sinks,
            metadata.sliding_window,
        )
