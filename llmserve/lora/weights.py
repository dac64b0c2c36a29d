"""One linear layer's adapters, stacked by resident slot, and the delta they add to its output.

A fused layer (qkv_proj, gate_up_proj) holds its shards' adapters side by side: slot s's A is
[shards * R, in], R the largest rank, of which an adapter of rank r fills the first shards * r
rows (shard i's A in rows i*r..), its B block-diagonal (shard i's B, times the adapter's scale, in
shard i's output rows and columns i*r..), kept transposed as Bt [shards * R, out]. So one slot costs
two products of width shards * r whatever it targets, and an empty shard adds zeros.

    out[rows of slot s] += (x[rows] @ A[s]^T) @ Bt[s]

On a CPU with AVX2 and FMA one compiled call (kernels/csrc/lora.cpp), on CUDA one pair of Triton
launches (kernels/triton/lora.py), adds every row's delta from the step's per-token slots, each row
alone (the same whatever else the step holds). Elsewhere the rows are grouped by slot (manager.py):
one pair of matmuls per adapter in the step. A step where no row has an adapter adds nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.config.lora import LORA_KERNEL_MAX_WIDTH
from llmserve.kernels.cpu_ops import load_cpu_ops

# a step's rows by slot: (slot, flat row indices; None: every row of the step)
SlotGroups = list[tuple[int, torch.Tensor | None]]
_TRITON_MAX_ROWS = 256  # the most rows a step adds by the Triton kernel on CUDA


class LoRALayerWeights:
    def __init__(
        self,
        base: nn.Module,
        shard_sizes: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`base`: an `nn.Linear` or a `QuantizedLinear` (which has no `.weight`: the delta is kept in
        the model's float `dtype` over its quantized output); `shard_sizes`: the output rows of each
        checkpoint module fused into `base` (q, k, v ...)."""
        width = len(shard_sizes) * max_rank
        self.a = torch.zeros(max_loras, width, base.in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, width, base.out_features, dtype=dtype, device=device)
        self.max_rank = max_rank
        self.row_starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes) + 1)]  # and the end
        self.shard_sizes = shard_sizes
        # columns slot s's adapter uses (shards * rank; 0: not this layer), in host memory
        self.widths = torch.zeros(max_loras, dtype=torch.int64)
        self.shard_starts = torch.tensor(self.row_starts, dtype=torch.int64)
        self.kernel = _compiled_kernel(base.in_features, self.row_starts, width, dtype, device)
        # The Triton kernel's programs each re-read their row's slot stacks: steps of more rows (prompt
        # chunks) take the grouped matmuls, which share them. The CPU kernel tiles rows by slot.
        on_cuda = torch.device(device).type == "cuda"
        self.kernel_max_rows = _TRITON_MAX_ROWS if on_cuda and self.kernel is not None else None
        # the kernel's copies, on the device it runs on (a Triton kernel reads them there: no sync)
        self._kernel_widths = self.widths.to(device)
        self._kernel_starts = self.shard_starts.to(device)

    def load(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Write an adapter's (A, B) of each shard index it targets into `slot` (zeros elsewhere)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        rank = next(iter(shards.values()))[0].shape[0] if shards else 0  # one rank per adapter
        for shard, (a, b) in shards.items():
            column = shard * rank
            if a.shape[0] != rank:
                raise ValueError(f"LoRA weights of rank {a.shape[0]} in an adapter of rank {rank}")
            if a.shape[1] != self.a.shape[2] or b.shape[0] != self.shard_sizes[shard]:
                raise ValueError(
                    f"LoRA weights A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a layer of "
                    f"{self.a.shape[2]} inputs and {self.shard_sizes[shard]} outputs"
                )
            rows = slice(self.row_starts[shard], self.row_starts[shard] + b.shape[0])
            self.a[slot, column : column + rank] = a
            self.bt[slot, column : column + rank, rows] = (b * scale).T
        self.widths[slot] = len(self.shard_sizes) * rank
        self._kernel_widths[slot] = self.widths[slot]

    def add_delta(
        self, x: torch.Tensor, out: torch.Tensor, groups: SlotGroups, token_slots: torch.Tensor | None = None
    ) -> None:
        """Add each row's adapter delta to `out` ([rows, out_features]) in place: by the compiled
        kernel from `token_slots` (per row, -1: none) where it serves, else group by group."""
        x = x.reshape(-1, x.shape[-1])
        out2d = out.view(-1, out.shape[-1])
        max_rows = self.kernel_max_rows
        serves = self.kernel is not None and (max_rows is None or x.shape[0] <= max_rows)
        if serves and token_slots is not None and x.dtype == self.a.dtype:
            self.kernel(
                x.contiguous(), out2d, self.a, self.bt, token_slots, self._kernel_widths, self._kernel_starts
            )
            return
        for slot, rows in groups:
            width = int(self.widths[slot])
            if not width:
                continue
            inputs = x if rows is None else x.index_select(0, rows)
            delta = (inputs @ self.a[slot, :width].T) @ self.bt[slot, :width]
            if rows is None:
                out2d += delta
            else:
                out2d.index_add_(0, rows, delta)


def _compiled_kernel(
    in_features: int, shard_starts: list[int], width: int, dtype: torch.dtype, device: torch.device
):
    """kernels/csrc/lora.cpp's `lora_delta` where it takes this layer: a CPU with AVX2 and FMA, float32
    or bf16, the input and every shard's output rows in whole vectors of 8, a width it holds; on CUDA
    kernels/triton/lora.py's where Triton imports; else None."""
    if torch.device(device).type == "cuda":
        try:
            from llmserve.kernels.triton import lora
        except ImportError:
            return None
        return lora.lora_delta if dtype in lora.FLOAT_DTYPES else None
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if in_features % 8 or any(start % 8 for start in shard_starts) or width > LORA_KERNEL_MAX_WIDTH:
        return None
    ops = load_cpu_ops()
    return ops.lora_delta if ops is not None and ops.lora_delta_supported() else None
