"""A Llama model's decoder layers for a decode step in one compiled call.

At small batch a decode step spent a large share of its time calling the compiled kernels from
Python: ~12 module calls per layer, argument checks and views, a cost that does not shrink with the
batch. `DecodeStack` (kernels/csrc/decode_stack.cpp) runs the same kernels in the same order from
C++, so its output is bit-identical to the module path (tested) and the model uses it whenever it
applies: every sequence this step is a decode or a short span (speculative verification), and the
model runs on the CPU with the in-place paged attention backend and a plain, int8 or fp8 KV cache
(new rows quantized by the ops the cache format uses; Qwen3's norms over each query and key head
included), either in bf16
with its linear layers bf16, int8 (per channel or GGUF Q8_0) or group-wise int4 (GGUF Q5_0's 5-bit
codes too: the int4 kernel tells them by their packed width) with their small-batch kernels (a q/k/v
layer of two formats, a Q4_K_M's Q4_K q/k beside its Q6_K v, as two calls, one a part), or in
float32 (on CPUs without native bf16) with every linear layer
on the float32 kernel or, quantized, on the int8 and int4 kernels where they take float32 inputs.
Above the small-batch kernel's 8 rows it takes what the modules take: int8 and int4 layers their
compiled kernels at any row count; bf16 `SmallBatchLinear` layers the AMX kernel on the packed copy
up to `AMX_MAX_ROWS` and oneDNN's GEMM on their blocked copy beyond where the CPU has AMX, else the
small-batch kernel in tiles of 8 rows at any row count; with float32 layers it serves up to 8 rows.
Anything else (prefill chunks, other quantized formats, 4-bit and 2-bit KV caches, CUDA) takes the
module path.
With LoRA adapters bound (`bind_lora`) it adds each row's adapter delta after the projections, as
the modules' hooks do, by the same compiled kernel. Mixture-of-experts layers (Mixtral, Qwen3-MoE)
join it where their experts are int8/int4 on the grouped kernels and the model is on one rank: the
router as a linear layer, softmax, top k and renormalization as SparseMoE.route computes them, then
the one `moe_experts` call QuantizedMoEExperts makes.

Where every dense layer's projections are int8, int4 (a GGUF's blocks, the default model's; a q/k/v
of two formats too, without adapters) or bf16, and a step has at most 8 rows and one rank (adapters
too), the stack holds its threads in one parallel region
for the whole step: each projection's blocks and attention's items are split among them with a
barrier after each, and the small per-row operations are repeated on every thread's own copy of the
row, instead of starting and joining the threads five times a layer (decode_stack.h;
`one_region_calls` counts those steps).

Under tensor parallelism the stack holds the rank's shards and sums the o and down projections'
outputs over the ranks inside the call, through the group's shared-memory collectives (one host) or
its gloo all-reduce called back from C++ (several hosts): the same sums the modules make, in the
same order, so the two paths stay bit-identical per rank.
"""

from __future__ import annotations

import torch

from llmserve.distributed.group import TensorParallelGroup
from llmserve.forward_context import AttentionMetadata
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.kernels.small_batch_linear import AMX_MAX_ROWS, MAX_ROWS, PackedLinear, SmallBatchLinear
from llmserve.quantization.kernels import RoundedInputKernel, StackedKernel


class FusedDecodeStack:
    def __init__(
        self,
        stack,
        embed_tokens,
        attention_layers,
        max_rows: float,
        tp: TensorParallelGroup,
        has_experts: bool = False,
    ) -> None:
        self.stack = stack
        self.embed_tokens = embed_tokens
        self.max_rows = max_rows  # MAX_ROWS, or unbounded where every layer runs any row count
        self.tp = tp
        self._all_reduce_bound = tp.world_size == 1
        self.calls = 0  # steps it ran (tests check that a configuration takes it)
        # > 0: only steps whose spans have at most this many queries (batch invariance: the attention
        # backend cuts longer ones into pieces of it, which bounds the kernel's score buffers)
        self.max_span = 0
        # The caches the stack was built with; a caller that rebinds a layer's cache (the naive
        # batching baseline does) gets the module path, which reads the layers' current caches.
        self.bound = [(layer, layer.key_cache, layer.value_cache) for layer in attention_layers]
        self.lora_bound = False  # steps with LoRA adapters run here too (bind_lora)
        self.has_experts = has_experts  # some layers are mixture-of-experts ones

    @property
    def one_region_calls(self) -> int:
        """Steps the stack ran with its threads held in one parallel region (decode_stack.h says when)."""
        return self.stack.one_region_calls()

    def bind_lora(self, lora_layers: list[tuple]) -> None:
        """Steps whose rows have adapters run here too, each layer's stacked adapters (lora/weights.py:
        `LoRALayerWeights` of qkv, o, gate_up and down per decoder layer) added by the compiled delta
        after its projection; where a layer lacks it, `lora_bound` stays False and the modules serve
        those steps (an expert layer's MLP takes no adapters in the stack: those steps too)."""
        if self.has_experts or any(weights.kernel is None for layer in lora_layers for weights in layer):
            return
        tensors = [t for layer in lora_layers for w in layer for t in (w.a, w.bt, w.widths, w.shard_starts)]
        self.stack.set_lora(tensors)
        self.lora_bound = True

    def serves(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        return (
            num_tokens <= self.max_rows
            and not metadata.prefills
            and metadata.decode_block_tables is not None
            and (not self.max_span or num_tokens <= self.max_span or self._spans_within(metadata))
            and all(layer.key_cache is key and layer.value_cache is value for layer, key, value in self.bound)
        )

    def _spans_within(self, metadata: AttentionMetadata) -> bool:
        starts = metadata.decode_query_starts
        return starts is None or int((starts[1:] - starts[:-1]).max()) <= self.max_span

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's final hidden states for a decode step (what the model's forward returns);
        `lora_slots`: each row's adapter slot (-1: none) where the step has adapters (bind_lora)."""
        if not self._all_reduce_bound:  # the group connects after the model is built
            self._bind_all_reduce()
        self.calls += 1
        query_starts = metadata.query_starts(input_ids.shape[0], input_ids.device)
        return self.stack.forward(
            self.embed_tokens(input_ids),
            positions,
            metadata.slot_mapping,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            query_starts,
            metadata.block_size,
            metadata.attention_sinks,
            metadata.sliding_window,
            lora_slots,
            metadata.decode_tree_masks,
        )

    def _bind_all_reduce(self) -> None:
        if self.tp.shm is not None:
            self.stack.set_shm_all_reduce(self.tp.shm)
        else:
            self.stack.set_python_all_reduce(self.tp.all_reduce)
        self._all_reduce_bound = True


_EMPTY = torch.empty(0)


def _or_empty(tensor: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if tensor is None else tensor


StackWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _expert_tensors(mlp, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """A mixture-of-experts layer's (stacked gate_up codes, their scales, down's, its scales, the
    int64 moe_params the stack reads) where its experts run as one `moe_experts` call in a `dtype`
    model (int8/int4 experts on their grouped kernels) and the layer is whole (one rank: the ranks'
    expert-load counts are the modules'); else None."""
    from llmserve.quantization.moe import QuantizedMoEExperts

    experts = mlp.experts
    tp = getattr(mlp, "tp", None)
    if not isinstance(experts, QuantizedMoEExperts) or not experts.runs_grouped(dtype):
        return None
    if tp is not None and tp.world_size > 1:
        return None
    gate_up, down = experts.grouped_gate_up, experts.grouped_down
    params = [
        experts.held.start,
        experts.router_experts,
        mlp.top_k,
        int(mlp.renormalize),
        gate_up.out_features // 2,
    ]
    return [
        gate_up.qweight,
        gate_up.scales,
        down.qweight,
        down.scales,
        torch.tensor(params, dtype=torch.int64),
    ]


def _small_batch_weights(module, dtype: torch.dtype) -> StackWeights | None:
    """(packed weight, its scales: none, per row, per 16/32 columns or int4's parameters, the oneDNN
    copy for more than 8 rows or None) of a linear layer the stack can run in a `dtype` model: bf16
    (SmallBatchLinear); float32 (PackedLinear with the float32 kernel, whose oneDNN copy is replaced
    when the weight changes: the stack keeps it to 8 rows); int8 or int4 on their compiled kernels
    (any row count); else None."""
    kernel = getattr(module, "kernel", None)
    if isinstance(kernel, RoundedInputKernel) and kernel.takes(dtype):
        return kernel.small_batch_qweight, kernel.small_batch_scales, None
    if dtype == torch.float32:
        if type(module) is PackedLinear and module.small_batch_weight is not None:
            return module.small_batch_weight, _EMPTY, None
        return None
    if type(module) is SmallBatchLinear:
        return module.small_batch_weight, _EMPTY, module.packed_weight
    return None


def _two_part_weights(module, dtype: torch.dtype) -> tuple[StackWeights, tuple] | None:
    """A q/k/v layer whose shards' formats do not join (StackedKernel) in two parts on their compiled
    kernels: (the first part's weights as `_small_batch_weights` gives them, (the second's packed
    weight, its scales, the first's output rows as an int64 [1])); else None."""
    kernel = getattr(module, "kernel", None)
    if not isinstance(kernel, StackedKernel) or len(kernel.parts) != 2:
        return None
    head, tail = kernel.parts
    if not all(isinstance(part, RoundedInputKernel) and part.takes(dtype) for part in (head, tail)):
        return None
    rows = torch.tensor([head.out_features], dtype=torch.int64)
    return (head.small_batch_qweight, head.small_batch_scales, None), (
        tail.small_batch_qweight,
        tail.small_batch_scales,
        rows,
    )


def build_decode_stack(model, attention_backend) -> FusedDecodeStack | None:
    """The fused stack for `model` (a LlamaForCausalLM whose attention layers are bound to their KV
    cache views), or None where it does not apply."""
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend
    from llmserve.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or not model.fused_decode_stack:
        return None  # a family whose layers differ from Llama's runs its modules
    inner = model.model
    layers = list(inner.layers)
    if (
        not isinstance(attention_backend, CPUPagedBackend)
        or attention_backend.kv_format.kernel_code not in (0, 1, 2)  # plain, int8, fp8: not int4/int2
        or inner.norm.weight.dtype not in (torch.bfloat16, torch.float32)
        or inner.norm.weight.device.type != "cpu"
    ):
        return None  # checked first: off the CPU the kernels are not built at all
    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "DecodeStack"):
        return None
    dtype = inner.norm.weight.dtype
    tensors: list[torch.Tensor] = []
    any_rows = True  # every layer can run more than MAX_ROWS rows
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        experts = _expert_tensors(mlp, dtype) if hasattr(mlp, "experts") else None
        if hasattr(mlp, "experts") and experts is None:
            return None  # float experts, or experts over ranks: the modules
        mlp_linears = (mlp.gate,) if experts else (mlp.gate_up_proj, mlp.down_proj)
        modules = (attention.qkv_proj, attention.o_proj, *mlp_linears)
        linears = [_small_batch_weights(m, dtype) for m in modules]
        qkv_tail = _two_part_weights(attention.qkv_proj, dtype)
        if qkv_tail is not None:
            linears[0], qkv_tail = qkv_tail
        if any(linear is None for linear in linears) or attention.attn.key_cache is None:
            return None
        if any(m.bias is not None for m in modules[1:]):
            return None
        head_norms = (attention.q_norm, attention.k_norm) if hasattr(attention, "q_norm") else ()
        norms = (layer.input_layernorm, layer.post_attention_layernorm, *head_norms)
        if any(norm.eps != inner.norm.eps or norm.weight.dtype != dtype for norm in norms):
            return None
        # a layer runs any row count on its oneDNN copy, its bf16 kernel or its int8/int4 kernel (an
        # expert layer's grouped kernels take any)
        any_rows = any_rows and all(
            linear[2] is not None
            or linear[0].dtype == torch.uint8
            or (type(module) is SmallBatchLinear and module.kernel_takes_every_row_count)
            for linear, module in zip(linears, modules, strict=True)
        )
        (qkv, qkv_scales, qkv_onednn), (o, o_scales, o_onednn) = linears[:2]
        if experts:  # the MLP's slots hold the stacked experts; the router is a linear layer of its own
            gate_up, gate_up_scales, down, down_scales, moe_params = experts
            gate_up_onednn = down_onednn = None
            moe = (*linears[2], moe_params)
        else:
            (gate_up, gate_up_scales, gate_up_onednn), (down, down_scales, down_onednn) = linears[2:]
            moe = (None, None, None, None)
        qkv_bias = attention.qkv_proj.bias
        tensors += [
            layer.input_layernorm.weight.detach(),
            qkv,
            qkv_scales,
            _EMPTY if qkv_bias is None else qkv_bias.detach(),
            o,
            o_scales,
            layer.post_attention_layernorm.weight.detach(),
            gate_up,
            gate_up_scales,
            down,
            down_scales,
            attention.attn.key_cache,
            attention.attn.value_cache,
            *map(_or_empty, (qkv_onednn, o_onednn, gate_up_onednn, down_onednn)),
            *((norm.weight.detach() for norm in head_norms) if head_norms else (_EMPTY, _EMPTY)),
            *map(_or_empty, moe),
            *(qkv_tail or (_EMPTY, _EMPTY, _EMPTY)),
        ]
    first = layers[0].self_attn
    # the bf16 layers' choices (they share them); a stack of quantized layers has none
    bf16 = [m for m in model.modules() if type(m) is SmallBatchLinear]
    stack = ops.DecodeStack(
        tensors,
        inner.norm.weight.detach(),
        first.rotary.cos,
        first.rotary.sin,
        first.attn.num_heads,  # this rank's heads and units: all of them without tensor parallelism
        first.attn.num_kv_heads,
        model.arch.head_dim,
        len(model.shard.intermediate),
        inner.norm.eps,
        first.attn.scale,
        AMX_MAX_ROWS if any(m.amx for m in bf16) else 0,  # as the modules choose
        max((m.kernel_max_rows for m in bf16), default=MAX_ROWS),
        attention_backend.kv_format.kernel_code,
    )
    max_rows = float("inf") if any_rows else MAX_ROWS
    attention_layers = [layer.self_attn.attn for layer in layers]
    has_experts = any(hasattr(layer.mlp, "experts") for layer in layers)
    return FusedDecodeStack(stack, inner.embed_tokens, attention_layers, max_rows, model.tp, has_experts)
