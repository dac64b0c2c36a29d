"""Linear layers that switch to a compiled matrix-vector kernel at small batch (bf16 or float32, CPU).

At 1-8 rows a linear layer reads every weight once and does little else: it is bound by memory
bandwidth, which PyTorch's bf16 GEMM does not reach there, and decode at low concurrency and
speculative verification spend most of their time in it (`benchmarks.tools.linear_micro`
measures the kernels' GB/s). `use_small_batch_linear` turns the model's plain `nn.Linear`s into
`SmallBatchLinear`s (same parameters, shared weights stay shared) whose forward takes the kernel
for few rows and `F.linear` otherwise; quantized layers keep their own kernels. Like quantization,
this is a transform of the loaded model: the model file does not change. The kernel reads its own
copy of the weight, packed once in blocks of 32 output rows (`small_batch_pack`, see linear.cpp),
so that it streams sequentially and needs no horizontal sums.

Above 8 rows, on a CPU with AMX, the layer runs the AMX kernel (linear_amx.cpp) on the small-batch
kernel's own copy, whose blocks are already the tile product's B operand (no padding), up to
`AMX_MAX_ROWS`; beyond, oneDNN's GEMM (below) was faster again, and below it AMX beat both oneDNN
and the small-batch kernel, the output projection of a decode step included (`python -m
benchmarks.tools.linear_micro --amx`; docs/benchmarks.md, "Kernel micro-benchmarks").

Where the CPU has no AMX (or `use_small_batch_linear(..., amx=False)`), the small-batch kernel takes
every row count, in tiles of 8 that each pass over a block of 32 output rows while it is in cache, and
a row's bits do not depend on the batch. On a Zen 5 (AVX-512 BF16, no AMX) it beat oneDNN's GEMM at
every decode size, whose every call pays a set-up, and matched it at prompt chunks of 512 to 2,048
rows (`python -m benchmarks.tools.linear_micro --tiled`; docs/benchmarks.md, "Kernel
micro-benchmarks"); on AVX2 CPUs (no AVX-512 BF16) the kernel runs float32 FMAs over the same packed
copy (linear.cpp), where oneDNN capped at AVX2 packs no bf16 weight and `F.linear` was slower at every
row count (commit c1a5ba1 gives the figures). So the packed copy is the layer's only one: the
checkpoint's weight is freed once packed (`_release_unread_weights`; kept where another module shares
it, a tied embedding's lookups).
With AMX, rows above `AMX_MAX_ROWS` run oneDNN's GEMM on a copy of the weight packed once into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU backend
does): `F.linear` on a plain weight repacks it on every call. oneDNN builds (and caches, up to 1,024)
a primitive for each (row count, layer shape) it sees, ~100 KB each at the tiny test model's shapes:
left alone, the varied token counts of a server's steps grew its memory until that cache was full,
so the rows it gets are rounded up to one of 8 sizes per octave (`onednn_rows`: at most 1/8 more
rows, left unset: a row's result depends only on that row, so the others' bits do not change).

float32 weights on the CPU (the default where the CPU has no native bf16 and a path would run PyTorch's
bf16 arithmetic: config's `EngineArgs._dtype`) become
`PackedLinear`s: the compiled float32 kernel (linear_f32.cpp, AVX2 and FMA) on its own packed copy
at every row count where AVX2 is the CPU's best (above 8 rows on AVX-512 CPUs, oneDNN on a
oneDNN-blocked copy), oneDNN alone where the build has no kernel. `F.linear` in float32 goes to
MKL's sgemm, which is slow at the few rows a verify pass has; on an AVX2 CPU the kernel beat oneDNN
at every row count too (above 8 rows it runs the rows through each group of outputs in tiles of 4).
Each row's result does not depend on the row count (the same FMA chain whatever the batch; checked
bitwise), so verifying drafts, decoding one token and a prefill compute the same logits. A module
whose weights' low bits matter less than their bytes (a draft head: its drafts are verified anyway)
can keep the kernel's copy in bf16 (`use_small_batch_linear(..., float32_kernel_weights=torch.bfloat16)`),
read at half the bandwidth.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels.cpu_ops import load_cpu_ops

# Above this the GEMM in F.linear is compute-bound and faster (kSmallBatchRows in decode_stack.cpp).
MAX_ROWS = 8
_BLOCK_ROWS = 32  # output rows per block of the packed layout (small_batch_pack)
# Above this oneDNN's GEMM beats the AMX kernel on this project's machine (module docstring).
AMX_MAX_ROWS = 1280
# Without AMX, bf16 layers run the small-batch kernel up to this many rows, oneDNN's GEMM on a blocked
# copy above: every row count, so the packed copy is the only one (module docstring).
KERNEL_MAX_ROWS = sys.maxsize


class SmallBatchLinear(nn.Linear):
    small_batch_weight: torch.Tensor  # `weight` in the small-batch kernel's layout (32-row blocks)
    amx: bool = False  # 9 to AMX_MAX_ROWS rows by the AMX kernel on that same copy (linear_amx.cpp)
    kernel_max_rows: int = MAX_ROWS  # the small-batch kernel up to this many rows (KERNEL_MAX_ROWS: no AMX)
    packed_weight: torch.Tensor | None = None  # oneDNN-blocked copy of `weight`, with AMX (module docstring)
    # `weight`: None once released (`_release_unread_weights`), the packed copies being the layer's own

    @property
    def kernel_takes_every_row_count(self) -> bool:
        """Without AMX: the packed copy serves every row count, no oneDNN copy is kept."""
        return self.kernel_max_rows == sys.maxsize

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.numel() // self.in_features
        if rows == 0:
            return input.new_empty(*input.shape[:-1], self.out_features)
        if rows <= self.kernel_max_rows:
            flat = input.reshape(rows, self.in_features).contiguous()
            out = load_cpu_ops().small_batch_linear(flat, self.small_batch_weight, self.out_features)
            out = out.view(*input.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        if self.amx and input.dtype == torch.bfloat16 and input.numel() <= AMX_MAX_ROWS * self.in_features:
            flat = input.reshape(-1, self.in_features).contiguous()
            out = load_cpu_ops().amx_linear(flat, self.small_batch_weight, self.bias, self.out_features)
            return out.view(*input.shape[:-1], self.out_features)
        if self.packed_weight is not None and input.dtype == torch.bfloat16:
            return onednn_linear(input, self.packed_weight, self.bias)
        if self.weight is None:  # freed: the packed copies are the layer's only ones, and they take bf16
            raise TypeError(f"a bf16 linear layer on its packed copy takes bf16 inputs, not {input.dtype}")
        return F.linear(input, self.weight, self.bias)


class LogitsLinear(nn.Linear):
    """A bf16 output projection (a module with `float_logits`, models/layers/lm_head.py): float32 out,
    on the kernel's layout alone (no oneDNN copy): the small-batch kernel up to 8 rows, AMX's above
    where the CPU has it, else the small-batch kernel at every row count (each tile of 8 rows reuses a
    block of weights from cache, so they are read once)."""

    float_logits = True
    small_batch_weight: torch.Tensor
    amx: bool = False  # rows above 8 by the AMX kernel on the same copy (linear_amx.cpp)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.reshape(-1, self.in_features).contiguous()
        if rows.shape[0] == 0:
            return input.new_empty(*input.shape[:-1], self.out_features, dtype=torch.float32)
        if self.amx and rows.shape[0] > MAX_ROWS:
            out = load_cpu_ops().amx_linear(rows, self.small_batch_weight, self.bias, self.out_features, True)
            return out.view(*input.shape[:-1], self.out_features)
        out = load_cpu_ops().small_batch_linear_float_out(rows, self.small_batch_weight, self.out_features)
        out = out.view(*input.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.float()

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the weight, read from the packed copy (small_batch_pack in linear.cpp: blocks
        of 32 rows, column pair by column pair: [N'/32, K/2, 32, 2]): the very bf16 values."""
        packed = self.small_batch_weight
        blocks = packed.view(packed.shape[0] // _BLOCK_ROWS, packed.shape[1] // 2, _BLOCK_ROWS, 2)
        flat = index.reshape(-1).to(packed.device)
        rows = blocks[flat // _BLOCK_ROWS, :, flat % _BLOCK_ROWS]  # [T, K/2, 2]
        return rows.reshape(*index.shape, self.in_features)

    def table(self) -> torch.Tensor:
        """The whole weight [out_features, in_features], rebuilt from the packed copy (a new tensor)."""
        return self.weight_rows(torch.arange(self.out_features, device=self.small_batch_weight.device))


class PackedLinear(nn.Linear):
    """float32 on the CPU: the compiled kernel at every row count where this build has it, else oneDNN,
    on a copy of the weight packed once for it (module docstring)."""

    packed_weight: torch.Tensor | None  # oneDNN-blocked, for rows above 8 (None: the kernel takes them)
    small_batch_weight: torch.Tensor | None  # the float32 kernel's layout, float32 or bf16 (None: no kernel)
    packed_from: tuple[int, int]  # (data_ptr, version) of the weight the copy was made from
    # the kernel at every row count even where oneDNN has a copy (batch invariance:
    # worker/batch_invariance.py); each sums a row in its own order
    every_row_count: bool = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype != torch.float32 or input.device.type != "cpu":
            return F.linear(input, self.weight, self.bias)
        if self.packed_from != _identity(self.weight):  # written or replaced since: pack it again
            self._pack_again()
        # oneDNN, where it has a copy, takes more rows
        few_rows = self.every_row_count or input.numel() <= MAX_ROWS * self.in_features
        if self.small_batch_weight is not None and (self.packed_weight is None or few_rows):
            rows = input.reshape(-1, self.in_features).contiguous()
            out = load_cpu_ops().small_batch_linear_f32(rows, self.small_batch_weight, self.out_features)
            out = out.view(*input.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return onednn_linear(input, self.packed_weight, self.bias)

    def _pack_again(self) -> None:
        """The copy again from the current weight; the kernel's in place where the shape allows,
        since the fused decode stack (models/decode_stack.py) holds that tensor too. A prefill runs
        the modules before any decode does, so the stack never reads a stale copy."""
        kernel_dtype = self.small_batch_weight.dtype if self.small_batch_weight is not None else None
        self.packed_weight, small_batch = _pack_float32(self.weight, kernel_dtype)
        if small_batch is not None and small_batch.shape == self.small_batch_weight.shape:
            self.small_batch_weight.copy_(small_batch)
        else:
            self.small_batch_weight = small_batch
        self.packed_from = _identity(self.weight)


def onednn_rows(rows: int) -> int:
    """The row count oneDNN runs for `rows`: rounded up to a multiple of 1/8 of the power of two below
    it (9-16 rows as they are), so at most 1/8 more rows and 8 sizes per octave (module docstring)."""
    step = 1 << max(rows.bit_length() - 4, 0)
    return -(-rows // step) * step


def onednn_linear(
    input: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`input @ weight.T + bias` by oneDNN on its packed copy, its rows padded to `onednn_rows`."""
    rows = input.numel() // input.shape[-1]
    padded = onednn_rows(rows)
    if padded == rows:
        return _onednn_pointwise(input, packed_weight, bias)
    flat = input.new_empty(padded, input.shape[-1])  # the extra rows are never read back: no zeros written
    flat[:rows].copy_(input.reshape(rows, input.shape[-1]))
    out = _onednn_pointwise(flat, packed_weight, bias)[:rows]
    return out.view(*input.shape[:-1], out.shape[-1])


def _onednn_pointwise(
    input: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(input, packed_weight, bias, "none", [], "")


def _pack_float32(
    weight: torch.Tensor, kernel_dtype: torch.dtype | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A float32 weight's (oneDNN copy, kernel copy): the kernel's in `kernel_dtype` (float32 or bf16;
    None: no kernel in this build), oneDNN's where the kernel does not take every row count."""
    kernel = None
    if kernel_dtype is not None:  # the kernel is in this build (use_small_batch_linear checked)
        kernel = load_cpu_ops().small_batch_pack_f32(weight.detach().to(kernel_dtype))
        if kernel_takes_every_row_count():
            return None, kernel
    return pack_for_onednn(weight), kernel


def kernel_takes_every_row_count() -> bool:
    """Whether the float32 kernel also serves more than 8 rows: where the CPU's best vector unit is
    AVX2 (measured there: module docstring). With AVX-512, oneDNN's GEMM uses it and the kernel
    (AVX2) was not measured against it, so oneDNN keeps the rows above 8."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def _identity(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version


def current_packs(model: nn.Module) -> list[PackedLinear]:
    """The `PackedLinear`s whose copies were made from their weight as it is now."""
    return [m for m in model.modules() if type(m) is PackedLinear and m.packed_from == _identity(m.weight)]


def note_moved_weights(modules: list[PackedLinear]) -> None:
    """Their weights moved with their copies (worker/weight_arena.py): not a write, so the copies stay
    (`forward` would pack them again for a weight at a new address)."""
    for module in modules:
        module.packed_from = _identity(module.weight)


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout, or None where this torch cannot."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):  # a build without the op, or a weight it will not take
        return None


def use_small_batch_linear(
    model: nn.Module, float32_kernel_weights: torch.dtype = torch.float32, amx: bool = True
) -> int:
    """Swap every plain `nn.Linear` on the CPU for its faster layout: bf16 weights with an input width
    the compiled kernel takes (a multiple of 32) become `SmallBatchLinear`s where this build has the
    kernel (an output projection, `float_logits`, a `LogitsLinear`), float32 weights become
    `PackedLinear`s where this build has the float32 kernel or oneDNN can pack them, their kernel copy
    in `float32_kernel_weights` (float32; bf16 for a draft head); bf16 rows above 8 run on AMX where the
    CPU has it (`amx=False`: on a oneDNN copy, as elsewhere); returns how many."""
    if all(param.device.type != "cpu" for param in model.parameters()):
        return 0  # nothing to swap: the CPU kernels are not even built (a minute, once) on CUDA
    ops = load_cpu_ops()
    has_kernel = ops is not None and ops.small_batch_linear_supported()
    has_float32_kernel = ops is not None and ops.small_batch_linear_f32_supported()
    has_amx = amx and has_kernel and ops.amx_linear_supported()
    swapped = 0
    # shared weights (tied embeddings) share one copy of each layout
    packed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # float32
    kernel_copies: dict[int, torch.Tensor] = {}  # bf16
    onednn_copies: dict[int, torch.Tensor | None] = {}  # bf16
    for module in model.modules():
        weight = getattr(module, "weight", None)
        # an output projection (models/layers/lm_head.py): float32 logits
        head = isinstance(module, nn.Linear) and getattr(module, "float_logits", False)
        if (type(module) is not nn.Linear and not head) or weight.device.type != "cpu":
            continue
        if weight.dtype == torch.bfloat16 and has_kernel and module.in_features % 32 == 0:
            weight.data = weight.data.contiguous()
            if id(weight) not in kernel_copies:
                kernel_copies[id(weight)] = ops.small_batch_pack(weight.detach())
            module.small_batch_weight = kernel_copies[id(weight)]
            module.amx = has_amx
            module.kernel_max_rows = MAX_ROWS if has_amx else KERNEL_MAX_ROWS
            if head:  # the kernels take every row count: no oneDNN copy
                module.__class__ = LogitsLinear
            else:
                module.__class__ = SmallBatchLinear
                onednn_rows_above = has_amx or not module.kernel_takes_every_row_count
                if onednn_rows_above and id(weight) not in onednn_copies:
                    onednn_copies[id(weight)] = pack_for_onednn(weight)
                module.packed_weight = onednn_copies.get(id(weight))
            swapped += 1
        elif weight.dtype == torch.float32:
            if id(weight) not in packed:
                kernel_dtype = float32_kernel_weights if has_float32_kernel else None
                onednn, small_batch = _pack_float32(weight, kernel_dtype)
                packed[id(weight)] = (small_batch, onednn)
            small_batch, onednn = packed[id(weight)]
            if onednn is not None or small_batch is not None:
                module.__class__ = PackedLinear
                module.packed_weight, module.small_batch_weight = onednn, small_batch
                module.packed_from = _identity(weight)
                swapped += 1
    _release_unread_weights(model)
    return swapped


def _release_unread_weights(model: nn.Module) -> None:
    """Free the checkpoint's weight of every bf16 layer that no row count reads it for (its packed
    copies take them all: a `LogitsLinear`'s always) and no other module shares (a tied embedding
    looks rows up in it, until `quantization/embedding.embed_from_packed_head` reads them from the
    packed copy): the layer's packed copy is then its only one."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    for module in model.modules():
        if type(module) not in (SmallBatchLinear, LogitsLinear) or module.weight is None:
            continue
        if uses[id(module.weight)] > 1:
            continue
        every_row_count = type(module) is LogitsLinear or module.kernel_takes_every_row_count
        if every_row_count or module.packed_weight is not None:
            module.weight = None
