"""Quantized mixture-of-experts layers: every expert's gate/up and down projections in int8 or int4
(RTN, or a GGUF's own blocks), the router kept in float.

A model's experts module (models/layers/moe.py's `MoEExperts`: stacked parameters gate_up_proj
[E, 2I, H] and down_proj [E, H, I]) is recognised by those parameters, since this package does not
import models/, and replaced by `QuantizedMoEExperts`, whose forward has the same contract. Expert
weights travel in a `QuantizationResult` and a saved checkpoint as one 2-D weight per expert, under
`<experts module>.<parameter>.<expert>` (model.layers.0.mlp.experts.gate_up_proj.3), so that the
formats, the checkpoint file and the weights cache need nothing new. Under tensor or expert
parallelism a file's expert weights (a GGUF's blocks, a checkpoint's codes) are read whole and cut
for the rank by `rank_experts`, as its layer's layout splits them (quantization/sharding.py).

Each expert's projection keeps one copy of its weight, in the compiled kernels' layout
(kernels/csrc/linear_quantized.cpp: int4 two codes a byte, int8 a byte, scales per group): its
routed rows run the kernel at any count where it takes the activation dtype (bf16; float32 at the
AVX2 level), else they multiply by the float weight rebuilt from that copy. The forward groups the
tokens by expert and runs only the experts some token chose. Where the experts of each projection
share one packed layout, each projection's copies are stacked and the whole layer (sort, gather,
both projections, SiLU, the weighted sum) is one compiled call (kernels/csrc/moe.cpp: no host sync,
no loop over experts); otherwise one kernel call per projection and expert (a host sync for the
group sizes, as the float layer's per-expert path), summed back by the same compiled step where the
kernels exist.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.distributed.expert_parallel import ExpertLayout, held_pairs
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.quantization.formats import (
    QuantizedWeight,
    column_groups,
    concat_rows,
    shard_columns,
    shard_rows,
)
from llmserve.quantization.kernels import (
    DequantizeKernel,
    GroupedExpertsKernel,
    LinearKernel,
    RoundedInputKernel,
    select_kernel,
)

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
_EXPERT_KEY = re.compile(r"(.+)\.(gate_up_proj|down_proj)\.(\d+)")


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every float experts module of `model` by name (stacked 3-D gate_up_proj and down_proj)."""
    return {
        name: module
        for name, module in model.named_modules()
        if all(
            isinstance(getattr(module, param, None), nn.Parameter) and getattr(module, param).dim() == 3
            for param in EXPERT_PARAMETERS
        )
    }


def router_names(model: nn.Module) -> set[str]:
    """The routers (`gate` beside each experts module): linears that quantization leaves in float."""
    return {f"{name.rpartition('.')[0]}.gate" for name in experts_modules(model)}


def expert_key(module: str, parameter: str, expert: int) -> str:
    return f"{module}.{parameter}.{expert}"


def parse_expert_key(key: str) -> tuple[str, str, int] | None:
    """(experts module, parameter, expert) of an expert weight's key; None for a linear layer's."""
    match = _EXPERT_KEY.fullmatch(key)
    return None if match is None else (match[1], match[2], int(match[3]))


def owner(key: str) -> str:
    """The module a quantized weight's key replaces: the experts module for an expert weight."""
    parsed = parse_expert_key(key)
    return key if parsed is None else parsed[0]


def quantize_experts(
    model: nn.Module, quantize: Callable[[torch.Tensor], QuantizedWeight]
) -> dict[str, QuantizedWeight]:
    """`quantize` of every expert's gate/up and down weight, under their expert keys."""
    weights: dict[str, QuantizedWeight] = {}
    for name, module in experts_modules(model).items():
        for param in EXPERT_PARAMETERS:
            for expert, weight in enumerate(getattr(module, param).detach()):
                weights[expert_key(name, param, expert)] = quantize(weight)
    return weights


_PARTS = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # block_sparse_moe.experts.N.w1


def gguf_expert_weights(model: nn.Module, tensors: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """The expert weights of a GGUF's natively read tensors (quantization/gguf_native.py names each
    expert's rows `<experts module>.<expert>.gate_proj.weight`, up_proj, down_proj)."""
    weights, _ = stacked_expert_weights(
        model, lambda name, expert, part: f"{name}.{expert}.{part}.weight", tensors
    )
    return weights


def checkpoint_expert_weights(
    model: nn.Module, layers: dict[str, QuantizedWeight]
) -> tuple[dict[str, QuantizedWeight], set[str]]:
    """The expert weights among a pre-quantized HF checkpoint's layers (by module name: Qwen3-MoE's
    `mlp.experts.N.gate_proj`, Mixtral's `block_sparse_moe.experts.N.w1`), and the names they used."""

    def source(name: str, expert: int, part: str) -> str:
        qwen = f"{name}.{expert}.{part}"
        mixtral = (
            f"{name.replace('.mlp.experts', '.block_sparse_moe.experts')}.{expert}.{_MIXTRAL_PARTS[part]}"
        )
        return qwen if qwen in layers else mixtral

    return stacked_expert_weights(model, source, layers)


def stacked_expert_weights(
    model: nn.Module, source: Callable[[str, int, str], str], tensors: dict[str, QuantizedWeight]
) -> tuple[dict[str, QuantizedWeight], set[str]]:
    """Each experts module's weights, `tensors[source(module, expert, part)]` for the parts gate_proj,
    up_proj and down_proj, gate and up fused per expert; and the names used. A module takes them only
    if every expert's three are there in fusable formats; else it stays in float."""
    weights: dict[str, QuantizedWeight] = {}
    used: set[str] = set()
    for name in experts_modules(model):
        layer: dict[str, QuantizedWeight] = {}
        names = [
            [source(name, expert, part) for part in _PARTS] for expert in range(_whole_count(model, name))
        ]
        for expert, parts in enumerate([[tensors.get(key) for key in keys] for keys in names]):
            gate_up = None if any(part is None for part in parts) else concat_rows(parts[:2])
            if gate_up is None:
                break
            layer[expert_key(name, "gate_up_proj", expert)] = gate_up
            layer[expert_key(name, "down_proj", expert)] = parts[2]
        else:
            weights.update(layer)
            used.update(key for keys in names for key in keys)
    return weights, used


def _layout(model: nn.Module, name: str) -> ExpertLayout | None:
    """The expert layout of experts module `name`'s layer (models/layers/moe_parallel.py), if it has one."""
    return getattr(model.get_submodule(name.rpartition(".")[0]), "layout", None)


def _whole_count(model: nn.Module, name: str) -> int:
    """The whole model's experts in layer `name` (a rank holds a run of them under expert parallelism)."""
    layout = _layout(model, name)
    return model.get_submodule(name).gate_up_proj.shape[0] if layout is None else layout.num_experts


def rank_experts(weights: dict[str, QuantizedWeight], model: nn.Module) -> dict[str, QuantizedWeight]:
    """The part of the whole model's expert weights (every expert, every unit; a file's blocks) that
    `model`'s rank holds, under the keys of its experts modules: under expert parallelism its run of
    experts, whole, numbered from 0; under tensor parallelism each expert's gate_up rows of its units
    ([gate; up]) and those units' input columns of down_proj, which must hold whole groups."""
    part: dict[str, QuantizedWeight] = {}
    for key, weight in weights.items():
        name, param, expert = parse_expert_key(key)
        layout = _layout(model, name)
        if layout is None or layout.world_size == 1:
            part[key] = weight
        elif expert in layout.experts:
            local = expert_key(name, param, expert - layout.experts.start)
            part[local] = _units(name, param, weight, _rank_layout(layout, param, weight, layout.rank))
    return part


def check_expert_cuts(weights: dict[str, QuantizedWeight], model: nn.Module) -> None:
    """Raise the one-line error of `rank_experts` where any rank's units cut a down_proj group, so
    that rank 0 reports another rank's bad cut too."""
    for key, weight in weights.items():
        name, param, _ = parse_expert_key(key)
        layout = _layout(model, name)
        if param != "down_proj" or layout is None or layout.expert_parallel:
            continue
        for rank in range(layout.world_size):
            _units(name, param, weight, _rank_layout(layout, param, weight, rank), column_groups)


def _rank_layout(layout: ExpertLayout, param: str, weight: QuantizedWeight, rank: int) -> ExpertLayout:
    """`rank`'s layout of the layer, from the whole expert weight's width (units: the layout has its own)."""
    units = weight.shape[0] // 2 if param == "gate_up_proj" else weight.shape[1]
    return ExpertLayout.of(layout.num_experts, units, layout.world_size, rank, layout.expert_parallel)


def _units(
    name: str, param: str, weight: QuantizedWeight, layout: ExpertLayout, cut: Callable = shard_columns
):
    """An expert's whole weight cut to `layout`'s units: gate_up's rows (whole rows: exact at any
    unit), down_proj's input columns by `cut(weight, start, stop)`, where a group must not straddle."""
    units = layout.units
    if layout.expert_parallel:  # whole experts
        return weight
    if param == "gate_up_proj":
        whole = weight.shape[0] // 2
        rows = torch.arange(units.start, units.stop)
        return shard_rows(weight, torch.cat([rows, rows + whole]), 2 * len(units))
    try:
        return cut(weight, units.start, units.stop)
    except ValueError:
        raise ValueError(
            f"quantized experts {name}.down_proj (groups of {weight.group_size} input columns) cannot be "
            f"split over tensor_parallel_size {layout.world_size}: rank {layout.rank}'s units "
            f"{units.start}..{units.stop} of each expert's {weight.shape[1]} do not hold whole groups "
            "(--enable-expert-parallel keeps each expert whole)"
        ) from None


def apply_experts(model: nn.Module, weights: dict[str, QuantizedWeight], dtype: torch.dtype, device) -> None:
    """Replace each experts module that `weights` (expert keys only) covers by a QuantizedMoEExperts;
    a module must get every expert's two weights, each of its float parameter's shape."""
    grouped: dict[str, dict[str, dict[int, QuantizedWeight]]] = {}
    for key, weight in weights.items():
        module, param, expert = parse_expert_key(key)
        grouped.setdefault(module, {}).setdefault(param, {})[expert] = weight
    for name, params in grouped.items():
        module = model.get_submodule(name)
        stacked = [_expert_list(name, param, module, params.get(param, {})) for param in EXPERT_PARAMETERS]
        parent, _, child = name.rpartition(".")
        experts = QuantizedMoEExperts(
            *stacked, dtype, torch.device(device), module.held.start, module.router_experts
        )
        setattr(model.get_submodule(parent), child, experts)


def _expert_list(name: str, param: str, module: nn.Module, weights: dict[int, QuantizedWeight]):
    stacked = getattr(module, param)
    if sorted(weights) != list(range(stacked.shape[0])):
        raise ValueError(
            f"{name}.{param}: quantized weights for {len(weights)} of {stacked.shape[0]} experts"
        )
    for expert, weight in weights.items():
        if tuple(weight.shape) != tuple(stacked.shape[1:]):
            raise ValueError(
                f"{name}.{param}: expert {expert}'s quantized weight is {tuple(weight.shape)}, the layer's "
                f"{tuple(stacked.shape[1:])} (a quantization of another split of the model)"
            )
    return [weights[expert] for expert in range(stacked.shape[0])]


def expert_kernel(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> LinearKernel:
    """The compiled kernels' one packed copy on the CPU where they take the weight (RoundedInputKernel);
    elsewhere the formats' own tensors (DequantizeKernel: every device) or, off the CPU, what
    `select_kernel` picks."""
    if RoundedInputKernel.serves(weight, dtype, device):
        return RoundedInputKernel(weight, dtype)
    if device.type == "cpu":
        return DequantizeKernel(weight, dtype)
    return select_kernel(weight, dtype, device)


class QuantizedMoEExperts(nn.Module):
    """Drop-in for `MoEExperts` (same forward, the same held run of the router's experts) with each
    expert's weights in a quantized kernel."""

    def __init__(
        self,
        gate_up: list[QuantizedWeight],
        down: list[QuantizedWeight],
        dtype: torch.dtype,
        device: torch.device,
        first_expert: int = 0,
        router_experts: int | None = None,
    ) -> None:
        super().__init__()
        self.held = range(first_expert, first_expert + len(gate_up))
        self.router_experts = router_experts or len(gate_up)
        self.gate_up = nn.ModuleList(expert_kernel(weight, dtype, device) for weight in gate_up)
        self.down = nn.ModuleList(expert_kernel(weight, dtype, device) for weight in down)
        # Both projections over all experts in one call each where the kernels allow (else None)
        self.grouped_gate_up = GroupedExpertsKernel.of(list(self.gate_up))
        self.grouped_down = GroupedExpertsKernel.of(list(self.down))
        self._ops = load_cpu_ops() if device.type == "cpu" else None

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts (those held) of weight * expert(token); weights, experts:
        [tokens, k], experts numbered as the router numbers them."""
        if self.runs_grouped(hidden.dtype):  # one compiled call: no host sync, no loop over experts
            gate_up, down = self.grouped_gate_up, self.grouped_down
            return self._ops.moe_experts(
                hidden.contiguous(), weights.float().contiguous(), experts.contiguous(),
                gate_up.qweight, gate_up.scales, down.qweight, down.scales, gate_up.out_features // 2,
                down.out_features, self.held.start, self.router_experts,
            )  # fmt: skip
        order, counts = held_pairs(experts, self.held, self.router_experts)
        tokens = order // experts.shape[1]
        out = self.per_expert(hidden[tokens], counts.tolist())
        if self._ops is not None:
            return self._ops.moe_combine(out, weights.float().contiguous(), order)
        out = out * weights.flatten()[order].unsqueeze(1).to(out.dtype)
        return torch.zeros_like(hidden).index_add_(0, tokens, out)

    def runs_grouped(self, dtype: torch.dtype) -> bool:
        kernels = (self.grouped_gate_up, self.grouped_down)
        return all(kernel is not None and kernel.takes(dtype) for kernel in kernels)

    def per_expert(self, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert's kernels over its rows (routed: sorted by expert), one expert at a time: where
        the grouped kernels do not serve, and their test oracle."""
        out = torch.empty_like(routed)
        start = 0
        for expert, count in enumerate(counts):
            if count:  # an expert no token chose is never read
                rows = slice(start, start + count)
                out[rows] = self.down[expert](self._silu_and_mul(self.gate_up[expert](routed[rows])))
                start += count
        return out

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The compiled kernel where there is one (the grouped call's), else PyTorch's."""
        if self._ops is not None:
            return self._ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The float (gate_up_proj, down_proj) the kernels multiply by, stacked as MoEExperts holds them."""
        return (
            torch.stack([kernel.dequantize(dtype) for kernel in self.gate_up]),
            torch.stack([kernel.dequantize(dtype) for kernel in self.down]),
        )
