"""CUDA attention: one Triton kernel reads the paged KV cache in place for every row of a step.

Decodes, speculative verify spans, prompt chunks and prefix-cache hits all go to one launch
(`kernels/triton/paged_attention.py`) through their block tables: no context is gathered, no mask
is built, and the step's shapes alone choose the launch, so a CUDA graph can capture it. The kernel
dequantizes 8-bit caches, applies sliding windows with sinks and soft-caps scores, so soft-capped
models (Gemma 2) need not fall back to the reference. Writing new K/V stays the format's own.
"""

from __future__ import annotations

import os
import sys

import torch

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.forward_context import AttentionMetadata


class TritonPagedBackend(TorchSDPABackend):
    name = "triton"
    needs_gathered_decode = False
    max_decode_query_len = sys.maxsize  # every row, prompt chunks too, goes to the kernel's one launch

    def __init__(self, kv_cache_dtype: str = "auto", num_splits: int | None = None) -> None:
        super().__init__(kv_cache_dtype)
        try:
            from llmserve.kernels.triton.paged_attention import paged_attention
        except ImportError as error:  # no triton here: the caller picks another backend
            raise RuntimeError(f"the Triton attention kernel needs triton ({error})") from error
        self._paged_attention = paged_attention
        self.num_splits = num_splits  # KV splits per program; None: the kernel's choice from the shapes

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        """CUDA, or any device under the Triton interpreter (tests on CPU tensors)."""
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    def _decode(
        self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float, window=0, softcap=0.0
    ) -> torch.Tensor:
        query_starts = metadata.query_starts(query.shape[0], query.device)
        return self._paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            query_starts,
            metadata.block_size,
            scale,
            kv_code=self.kv_format.kernel_code,
            window=window,  # the engine's window, or a layer's own over the whole context
            sinks=metadata.attention_sinks,
            softcap=softcap,
            num_splits=self.num_splits,
        )
